"""The native NumPy kernel, variant by variant: the flag covers the values written, and the
underflow count is exact at any size.

Every kernel family this CPU runs is tested (portable C, AVX2+F16C, AVX-512 where present). The
AVX-512 family is also tested where the CPU lacks it: the extension is compiled a second time
with SIMDe's portable versions of the intrinsics (``-DAMPSCALE_EMULATE_AVX512``, a test-only
build; skipped when the SIMDe headers or a C compiler are missing), and that build runs the
AVX-512 code paths, lane layout, flushes and tails included, on any x86 CPU.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import BF16

backend = pytest.importorskip("ampscale.backends.numpy")
if not backend.NATIVE:
    pytest.skip("native kernel not built", allow_module_level=True)

SOURCE = Path(backend.__file__).parents[1] / "_native" / "cpu" / "_numpy.c"
KINDS = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
DTYPES = [d for d in KINDS if d != "bfloat16" or BF16 is not None]


def _np_dtype(name: str) -> Any:
    return BF16 if name == "bfloat16" else np.dtype(name)


def _simde_include() -> str | None:
    for root in (os.environ.get("SIMDE_INCLUDE"), "/usr/include", "/usr/local/include"):
        if root and (Path(root) / "simde" / "x86" / "avx512.h").exists():
            return root
    return None


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The extension built with emulated AVX-512 intrinsics, loaded under its own name."""
    include = _simde_include()
    if include is None:
        if os.environ.get("AMPSCALE_REQUIRE_SIMDE"):  # set by CI, which installs them
            pytest.fail("AMPSCALE_REQUIRE_SIMDE is set but the SIMDe headers are missing")
        pytest.skip("SIMDe headers not installed (apt-get install libsimde-dev)")
    out = tmp_path_factory.mktemp("emulated") / ("_numpy" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    command = [
        *compiler,
        "-O1",
        "-std=c11",
        "-fPIC",
        "-shared",
        "-pthread",
        "-DAMPSCALE_EMULATE_AVX512",
        f"-I{include}",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(out),
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"could not build the emulated kernel: {exc}")
    spec = importlib.util.spec_from_file_location("_numpy", out)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.use_isa("best") == "avx512"
    return module


def _variants() -> list[str]:
    return ["generic", "avx2", "best", "emulated-avx512"]


@pytest.fixture(params=_variants())
def kernel(request: pytest.FixtureRequest) -> Any:
    """``check_and_unscale`` of one kernel family."""
    if request.param == "emulated-avx512":
        yield request.getfixturevalue("emulated").check_and_unscale
        return
    native = backend._native
    try:
        native.use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param} kernels")
    yield native.check_and_unscale
    native.use_isa("best")


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32 if a.itemsize == 4 else np.uint64)


def _reference(values: np.ndarray, inv: float) -> np.ndarray:
    """torch's arithmetic: float32 opmath (float64 for float64), rounded to the dtype."""
    with np.errstate(all="ignore"):
        if values.dtype == np.float64:
            return values * np.float64(np.float32(inv))
        return (values.astype(np.float32) * np.float32(inv)).astype(values.dtype)


def _run(kernel: Any, values: np.ndarray, dtype: str, inv: float, multiply: bool, threads: int = 1) -> tuple:
    array = values.copy()
    buffer = array.view(np.uint16) if dtype == "bfloat16" else array
    finite = kernel([buffer], KINDS[dtype], inv, multiply, threads)
    return array, finite


# sizes that cover every vector loop (16 to 64 elements an iteration) and its scalar tail
SIZES = [1, 15, 31, 33, 63, 64, 65, 129, 1000]
BIG = {"float16": 60000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_finite_input_that_overflows_when_unscaled_is_flagged(kernel: Any, dtype: str) -> None:
    """Scale below 1: the flag is of the values stored, in every position and every variant."""
    kind = _np_dtype(dtype)
    inv = 8.0  # a scale of 1/8
    for size in SIZES:
        for position in sorted({0, size // 2, size - 1}):
            values = np.full(size, 1.5, dtype=np.float64)
            values[position] = BIG[dtype]
            values = values.astype(kind)
            out, finite = _run(kernel, values, dtype, inv, True)
            assert finite is False, (dtype, size, position)
            np.testing.assert_array_equal(_bits(out), _bits(_reference(values, inv)))
            # checking only (or an inverse of exactly 1) tests the inputs, which are finite
            assert _run(kernel, values, dtype, inv, False)[1] is True
            assert _run(kernel, values, dtype, 1.0, True)[1] is True


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rounding_to_infinity_in_the_gradient_dtype_is_flagged(kernel: Any, dtype: str) -> None:
    """A float32 product that is finite but rounds to inf in the gradient's own dtype."""
    if dtype not in DTYPES:
        pytest.skip("ml_dtypes not installed")
    kind = _np_dtype(dtype)
    largest = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": float(np.finfo(np.float32).max)}[dtype]
    values = np.full(100, largest, dtype=np.float64).astype(kind)
    # the float32 product is finite for float16 and bfloat16, and rounds to inf in their dtype
    inv = {"float16": 1.0003, "bfloat16": 1.003, "float32": 1.0 + 2.0**-23}[dtype]
    with np.errstate(over="ignore"):
        assert np.isfinite(np.float32(largest) * np.float32(inv)) == (dtype != "float32")
    out, finite = _run(kernel, values, dtype, inv, True)
    expected = _reference(values, inv)
    assert not np.isfinite(expected.astype(np.float64)).all()
    assert finite is False
    np.testing.assert_array_equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs_and_an_infinite_inverse(kernel: Any, dtype: str) -> None:
    kind = _np_dtype(dtype)
    for bad in (np.inf, -np.inf, np.nan):
        for inv in (2.0**-20, 0.5, 3.0, float("inf")):
            values = np.full(70, 0.25).astype(kind)
            values[37] = bad
            assert _run(kernel, values, dtype, inv, True)[1] is False, (bad, inv)
            assert _run(kernel, values, dtype, inv, False)[1] is False, (bad, inv)
    # a scale so small that float32(1 / scale) is inf: 0 * inf is nan, so no step passes
    zeros = np.zeros(70).astype(kind)
    out, finite = _run(kernel, zeros, dtype, float("inf"), True)
    assert finite is False
    assert np.isnan(out.astype(np.float64)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_values_stay_finite_and_exact(kernel: Any, dtype: str) -> None:
    rng = np.random.default_rng(11)
    kind = _np_dtype(dtype)
    for inv in (2.0**-16, 1 / 3, 2.0, 8.0):
        values = (rng.standard_normal(4099) * 100).astype(kind)
        out, finite = _run(kernel, values, dtype, inv, True)
        expected = _reference(values, inv)
        assert finite is bool(np.isfinite(expected.astype(np.float64)).all())
        np.testing.assert_array_equal(_bits(out), _bits(expected))


def test_the_threaded_split_flags_the_overflow_in_any_part(kernel: Any) -> None:
    size = backend._native.PARALLEL_THRESHOLD + 1001
    for position in (0, size // 3, size - 1):
        values = np.ones(size, np.float32)
        values[position] = 3e38
        assert _run(kernel, values, "float32", 4.0, True, threads=4)[1] is False
    assert _run(kernel, np.ones(size, np.float32), "float32", 4.0, True, threads=4)[1] is True


EXPONENT = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_counting_variant_stores_and_flags_what_the_plain_kernel_does(kernel: Any, dtype: str) -> None:
    """Underflow tracking runs separate kernels: they must write the same bits and raise the same
    flag as the plain ones, at every size (vector loops and tails), and count the inputs whose
    exponent bits are all zero (zeros and subnormals), specials mixed in."""
    rng = np.random.default_rng(5)
    kind = _np_dtype(dtype)
    tiny = {"float16": 2.0**-20, "bfloat16": 1e-39, "float32": 1e-40, "float64": 1e-310}[dtype]
    for size in [*SIZES, 4099]:
        for special in (None, np.inf, np.nan, BIG[dtype]):
            values = rng.standard_normal(size) * 8.0
            values[rng.random(size) < 0.2] = 0.0
            values[rng.random(size) < 0.2] = tiny
            if special is not None:
                values[rng.integers(size)] = special
            values = values.astype(kind)
            expected_count = int(np.count_nonzero((_bits(values).astype(np.uint64) & np.uint64(EXPONENT[dtype])) == 0))
            for inv, multiply in ((2.0**-16, True), (8.0, True), (1.0, True), (8.0, False)):
                plain, plain_finite = _run(kernel, values, dtype, inv, multiply)
                counted = values.copy()
                view = counted.view(np.uint16) if dtype == "bfloat16" else counted
                finite, count = kernel([view], KINDS[dtype], inv, multiply, 1, True)
                case = (size, special, inv, multiply)
                assert finite is plain_finite, case
                assert count == expected_count, case
                np.testing.assert_array_equal(_bits(counted), _bits(plain), err_msg=str(case))


def _at_offset(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``values`` starting ``offset`` elements past a 64-byte boundary."""
    raw = np.zeros(values.nbytes + (offset + 1) * values.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64 + offset * values.itemsize
    out = raw[start : start + values.nbytes].view(values.dtype)
    out[...] = values
    assert (out.ctypes.data - offset * values.itemsize) % 64 == 0
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_start_within_a_cache_line_gives_the_same_bits_flag_and_count(kernel: Any, dtype: str) -> None:
    """The AVX-512 kernels leave the elements before the first 64-byte boundary to the AVX2
    ones: for every start offset within a cache line, with an overflow or a nan in the head,
    at its last element, at the first of the loop or in the tail, the stored bits, the flag and
    the underflow count are those of the reference."""
    kind = _np_dtype(dtype)
    per_line = 64 // np.dtype(kind).itemsize
    rng = np.random.default_rng(11)
    for size in (1, per_line - 1, per_line + 1, 3 * per_line + 5, 200):
        base = rng.standard_normal(size) * 4.0
        base[rng.random(size) < 0.25] = 0.0
        for offset in range(per_line):
            head = (per_line - offset) % per_line
            for position in sorted({None, 0, head - 1, head, size - 1} - {-1}, key=lambda p: -1 if p is None else p):
                if position is not None and position >= size:
                    continue
                for special in (np.nan, BIG[dtype]) if position is not None else (None,):
                    values = base.copy()
                    if position is not None:
                        values[position] = special
                    values = values.astype(kind)
                    inv = 8.0  # a scale of 1/8: a big finite input overflows when unscaled
                    expected = _reference(values, inv)
                    bad = ~np.isfinite(expected.astype(np.float64))
                    zeros = int(np.count_nonzero((_bits(values).astype(np.uint64) & np.uint64(EXPONENT[dtype])) == 0))
                    case = (size, offset, position, special)
                    plain = _at_offset(values, offset)
                    view = plain.view(np.uint16) if dtype == "bfloat16" else plain
                    assert kernel([view], KINDS[dtype], inv, True, 1) is (not bad.any()), case
                    np.testing.assert_array_equal(_bits(plain), _bits(expected), err_msg=str(case))
                    counted = _at_offset(values, offset)
                    view = counted.view(np.uint16) if dtype == "bfloat16" else counted
                    finite, count = kernel([view], KINDS[dtype], inv, True, 1, True)
                    assert finite is (not bad.any()), case
                    assert count == zeros, case
                    np.testing.assert_array_equal(_bits(counted), _bits(expected), err_msg=str(case))


@pytest.mark.parametrize("dtype", DTYPES)
def test_underflow_count_matches_numpy_past_two_to_the_twenty_zeros(kernel: Any, dtype: str) -> None:
    """More than 2**21 zeros: a 16-bit lane counter then holds 32768 before its flush (32 or 64
    float16 values an iteration, 2**15 iterations between flushes)."""
    kind = _np_dtype(dtype)
    size = (1 << 22) + 77
    values = np.zeros(size, dtype=kind)  # the first 2**21 all zero: every lane fills up
    values[(1 << 21) + 3 :: 97] = 1.0
    values[(1 << 21) + 5 :: 1013] = {"float16": 2.0**-20, "bfloat16": 1e-39, "float32": 1e-40, "float64": 1e-310}[dtype]
    magnitude = np.abs(values.astype(np.float64))
    smallest_normal = 2.0**-126 if dtype == "bfloat16" else float(np.finfo(kind).smallest_normal)
    expected = int(np.count_nonzero(magnitude < smallest_normal))
    assert expected > 1 << 21
    for threads in (1, 3):
        for multiply in (True, False):
            buffer = values.copy()
            view = buffer.view(np.uint16) if dtype == "bfloat16" else buffer
            finite, count = kernel([view], KINDS[dtype], 0.5, multiply, threads, True)
            assert finite is True
            assert count == expected, (threads, multiply)


def test_pure_numpy_path_checks_the_values_stored() -> None:
    """Strided and read-only arrays take the exact pure-NumPy path: the same rule."""
    for dtype in DTYPES:
        kind = _np_dtype(dtype)
        holder = np.ones(40).astype(kind)
        holder[6] = BIG[dtype]
        strided = holder[::2]  # holds element 6
        finite = backend.BACKEND.check_and_unscale([strided], 8.0)[1]
        assert not bool(finite), dtype
        read_only = np.full(10, BIG[dtype]).astype(kind)
        read_only.setflags(write=False)
        out, finite = backend.BACKEND.check_and_unscale([read_only], 8.0)
        assert not bool(finite), dtype
        assert bool(backend.BACKEND.check_and_unscale([read_only], None)[1])
        np.testing.assert_array_equal(_bits(np.asarray(out[0])), _bits(_reference(read_only, 8.0)))


def test_the_kernel_unscales_a_repeated_buffer_once_and_refuses_partial_overlap(kernel: Any) -> None:
    """Aliasing is decided in C, before any element changes: one sort of the buffers by address
    (none when already in order), exact duplicates skipped, partial overlap refused."""
    base = np.arange(1, 101, dtype=np.float32)
    assert kernel([base, base, base[:]], KINDS["float32"], 0.5, True, 1) is True
    np.testing.assert_array_equal(base, np.arange(1, 101, dtype=np.float32) / 2)
    for arrays in ([base, base[10:]], [base[50:], base[:60]], [np.ones(4, np.float32), base[:30], base[29:40]]):
        before = base.copy()
        with pytest.raises(ValueError, match=r"\(\d+, \d+\)") as info:  # OverlapError(first, second)
            kernel(arrays, KINDS["float32"], 0.5, True, 1)
        assert type(info.value).__name__ == "OverlapError"
        np.testing.assert_array_equal(base, before)
    assert kernel([base, base[10:]], KINDS["float32"], 0.5, False, 1) is True  # reading twice is fine
    separate = [np.ones(8, np.float32) for _ in range(50)]
    assert kernel(separate[::-1] + separate[:1], KINDS["float32"], 0.5, True, 1) is True
    assert all((a == 0.5).all() for a in separate)
