"""The fused FP8 pass (``ampscale.fp8.amax`` / ``amax_and_cast``) against the reference paths.

Bit for bit against :func:`ampscale.fp8.tensor_amax` and :func:`ampscale.fp8.quantize`, on
every dtype, with inf and NaN anywhere (first, last, middle; in a head before the vector loop's
line boundary, in the loop's body, in its tail), zero-size and 0-d arrays, views at every
element offset inside a cache line, strided views, many tensors across the threads' cuts, and
every kernel family: portable C, AVX2+F16C, AVX-512 (native where the CPU has it, and built
with SIMDe's emulated intrinsics everywhere, as ``tests/test_native_kernels.py`` does).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ampscale
import ampscale.fp8 as fp8
from ampscale.fp8 import _fused
from ampscale.fp8._pass import DIVIDE_IN
from tests.test_fp8_cast import sample

backend = pytest.importorskip("ampscale.backends.numpy")
native = backend._native

DTYPES = ["float16", "bfloat16", "float32", "float64"]
FORMATS = sorted(fp8.FORMATS)
NAN32 = 0x7FC00000
needs_native = pytest.mark.skipif(native is None, reason="native kernel not built")


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _bits(x: Any) -> int:
    return int(np.float32(x).view(np.uint32))


def _same_amax(got: Any, reference: Any) -> bool:
    """Bit for bit, but for a NaN: any NaN of the reference is a NaN here, the canonical one."""
    got, reference = np.float32(got), np.float32(reference)
    if np.isnan(reference):
        return _bits(got) == NAN32
    return _bits(got) == _bits(reference)


def _references(arrays: list[np.ndarray]) -> list[np.float32]:
    with np.errstate(invalid="ignore", over="ignore"):  # float64 amaxes past float32's range: inf
        return [np.float32(fp8.tensor_amax(a)) for a in arrays]


def _random(n: int, dtype: str, seed: int, scale: float = 1.0) -> np.ndarray:
    """Finite values over many binades (within half the dtype's range)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n) * scale * np.exp(rng.uniform(-8, 8, n))
    limit = float(ml_dtypes.finfo(_np_dtype(dtype)).max) / 2
    return np.clip(values, -limit, limit).astype(_np_dtype(dtype))


# ------------------------------------------------------------------------------ kernel families


def _simde_include() -> str | None:
    for root in (os.environ.get("SIMDE_INCLUDE"), "/usr/include", "/usr/local/include"):
        if root and (Path(root) / "simde" / "x86" / "avx512.h").exists():
            return root
    return None


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The NumPy extension built with SIMDe's emulated AVX-512 intrinsics (a test-only build)."""
    include = _simde_include()
    if include is None:
        if os.environ.get("AMPSCALE_REQUIRE_SIMDE"):
            pytest.fail("AMPSCALE_REQUIRE_SIMDE is set but the SIMDe headers are missing")
        pytest.skip("SIMDe headers not installed (apt-get install libsimde-dev)")
    source = Path(backend.__file__).parents[1] / "_native" / "cpu" / "_numpy.c"
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
        str(source),
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


@pytest.fixture(params=["generic", "avx2", "best", "emulated-avx512"])
def kernels(request: pytest.FixtureRequest) -> Any:
    """The extension module with one kernel family selected."""
    if native is None:
        pytest.skip("native kernel not built")
    if request.param == "emulated-avx512":
        yield request.getfixturevalue("emulated")
        return
    try:
        native.use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param} kernels")
    yield native
    native.use_isa("best")


def _buffers(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a for a in arrays]


def _kinds(arrays: list[np.ndarray]) -> bytes:
    return bytes(_fused.KINDS[a.dtype.name] for a in arrays)


def _run_amax(module: Any, arrays: list[np.ndarray], threads: int = 1) -> tuple[np.ndarray, bool]:
    out = np.full(len(arrays), -1.0, np.float32)
    finite = module.fp8_amax(_buffers(arrays), _kinds(arrays), out, threads)
    return out, finite


def _run_cast(
    module: Any, arrays: list[np.ndarray], scales: list[float], fmt: str, divide: bool = False, threads: int = 1
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    outs = [np.full(a.size, 0xAA, np.uint8) for a in arrays]
    amaxes = np.full(len(arrays), -1.0, np.float32)
    clipped = np.full(len(arrays), -1, np.int64)
    module.fp8_amax_cast(
        _buffers(arrays),
        _kinds(arrays),
        outs,
        np.asarray(scales, np.float32),
        _fused.FORMAT_CODES[fmt],
        divide,
        _fused.nan_byte(fmt, "numpy"),
        amaxes,
        clipped,
        threads,
    )
    return outs, amaxes, clipped


def _reference_cast(a: np.ndarray, scale: float, fmt: str, divide: bool = False) -> tuple[np.ndarray, int]:
    with np.errstate(over="ignore"):  # float64 values past float32's range widen to inf
        q, clipped = _fused.reference_cast_numpy(a, np.float32(scale), fmt, divide)
    return q.view(np.uint8).reshape(-1), clipped


# ------------------------------------------------------------------------------ amax


def _with_specials(n: int, dtype: str, where: list[int], values: list[float], seed: int) -> np.ndarray:
    a = _random(n, dtype, seed)
    for index, value in zip(where, values, strict=True):
        a[index] = value
    return a


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_finds_inf_and_nan_anywhere(kernels: Any, dtype: str) -> None:
    """NaN anywhere wins over inf anywhere; inf anywhere over every finite value; in the head,
    the 4-vector body and the tail of the loops, at sizes around each loop's step."""
    arrays, expected = [], []
    for n in (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099):
        for position in sorted(p for p in {0, 1, n // 2, n - 2, n - 1} if 0 <= p < n):
            for special in (np.inf, -np.inf, np.nan, -np.nan):
                arrays.append(_with_specials(n, dtype, [position], [special], seed=n + position))
                expected.append(np.nan if np.isnan(special) else np.inf)
            if n > 2:  # a NaN and an inf in one array: NaN, whichever comes first
                other = (position + n // 3 + 1) % n
                arrays.append(_with_specials(n, dtype, [position, other], [np.inf, np.nan], seed=n))
                expected.append(np.nan)
    out, finite = _run_amax(kernels, arrays)
    assert not finite
    for k, (got, want, a) in enumerate(zip(out, expected, _references(arrays), strict=True)):
        assert _same_amax(got, want), (k, arrays[k].size, got, want)
        assert _same_amax(got, a), (k, got, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_of_finite_values_is_the_reference_bit_for_bit(kernels: Any, dtype: str) -> None:
    """Every magnitude order: subnormals only, -0 and 0, the dtype's max, huge float64 values
    that round to inf in float32 (the reference's astype does so too), random values."""
    dt = _np_dtype(dtype)
    info = ml_dtypes.finfo(dt)
    tiny = float(info.smallest_subnormal)
    arrays = [
        np.array([-0.0], dt),
        np.array([0.0, -0.0, 0.0], dt),
        np.array([-tiny, tiny / 2 if dtype == "float64" else tiny], dt),
        np.array([float(info.max), -float(info.max)], dt),
        np.array([-float(info.smallest_normal), 3 * tiny], dt),
        *[_random(n, dtype, seed=n) for n in (1, 3, 33, 100, 777, 5000)],
        np.zeros(0, dt),
    ]
    if dtype == "float64":
        arrays += [np.array([3.4028235677973366e38, 1.0]), np.array([1e-300, -1e-310]), np.array([1e300])]
    out, finite = _run_amax(kernels, arrays)
    refs = _references(arrays)
    assert all(_same_amax(g, r) for g, r in zip(out, refs, strict=True)), list(zip(out, refs, strict=True))
    empty = next(k for k, a in enumerate(arrays) if a.size == 0)
    assert _bits(out[empty]) == 0  # +0
    assert finite == bool(np.isfinite(refs).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_at_every_offset_within_a_cache_line(kernels: Any, dtype: str) -> None:
    """Views starting at every element inside a 64-byte line (so the AVX-512 head runs from 0 to
    a full line), with the maximum and a NaN in the head, at the line boundary and in the tail."""
    dt = _np_dtype(dtype)
    itemsize = dt.itemsize
    base = _random(4096 + 64, dtype, seed=3)
    arrays, expected_nan = [], []
    for offset in range(64 // itemsize):
        for n in (5, 64 // itemsize, 300, 1000):
            arrays.append(base[offset : offset + n])
            expected_nan.append(False)
    big = _random(4096 + 64, dtype, seed=4)
    for offset in range(64 // itemsize):
        for where in (0, max(0, (64 // itemsize) - offset - 1), 64 // itemsize - offset, 999):
            copy = big.copy()
            copy[offset + where] = np.nan
            arrays.append(copy[offset : offset + 1000])
            expected_nan.append(True)
            copy2 = big.copy()
            copy2[offset + where] = float(ml_dtypes.finfo(dt).max)
            arrays.append(copy2[offset : offset + 1000])
            expected_nan.append(False)
    out, _ = _run_amax(kernels, arrays)
    refs = _references(arrays)
    for k, (g, r) in enumerate(zip(out, refs, strict=True)):
        assert _same_amax(g, r), (k, g, r)
        assert bool(np.isnan(g)) == expected_nan[k]


def test_amax_of_mixed_dtypes_in_one_call(kernels: Any) -> None:
    arrays = [
        _random(n, d, seed=i) for i, (n, d) in enumerate(zip((10, 300, 7, 5000, 0, 64), DTYPES * 2, strict=False))
    ]
    arrays[3][17] = np.inf
    out, finite = _run_amax(kernels, arrays)
    assert not finite
    assert all(_same_amax(g, r) for g, r in zip(out, _references(arrays), strict=True))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_the_threads_cuts_merge_to_the_same_amaxes(kernels: Any, threads: int) -> None:
    """Above the parallel threshold the bytes are cut into equal ranges, inside tensors: each
    tensor's pieces merge to its own amax, whichever piece holds the maximum or the NaN."""
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.integers(1, 300_000, 24)] + [1_500_000, 3, 0, 2_000_001]
    arrays = [_random(n, DTYPES[k % 4], seed=k) for k, n in enumerate(sizes)]
    total = sum(a.nbytes for a in arrays)
    assert total > native.PARALLEL_THRESHOLD * 4  # several pieces
    for k in range(0, len(arrays), 3):  # a special near every tensor's end and start
        if arrays[k].size:
            arrays[k][-1] = np.nan if k % 2 else np.inf
            arrays[k][0] = -np.inf
    one, finite_one = _run_amax(kernels, arrays, threads=1)
    many, finite_many = _run_amax(kernels, arrays, threads=threads)
    assert one.view(np.uint32).tolist() == many.view(np.uint32).tolist()
    assert finite_one == finite_many
    assert all(_same_amax(g, r) for g, r in zip(many, _references(arrays), strict=True))


# ------------------------------------------------------------------------------ amax and cast


def _cast_inputs(dtype: str, size: int | None = None) -> np.ndarray:
    """Values of ``dtype`` at and next to every rounding boundary of every FP8 format: every
    bit pattern of a 16-bit dtype; float32's stratified sample; that sample widened to float64
    and moved one float64 ulp either way (so the float64 -> float32 rounding decides)."""
    if dtype in ("float16", "bfloat16"):
        values = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(_np_dtype(dtype))
    else:
        values = sample()
        if dtype == "float64":
            wide = values.astype(np.float64)
            with np.errstate(invalid="ignore"):
                values = np.concatenate([wide, np.nextafter(wide, np.inf), np.nextafter(wide, -np.inf)])
    if size is not None and values.size > size:
        keep = np.random.default_rng(9).choice(values.size, size, replace=False)
        values = values[np.sort(keep)]
    return np.ascontiguousarray(values)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@needs_native
def test_cast_is_the_reference_cast_bit_for_bit(fmt: str, dtype: str) -> None:
    """Every format x dtype, with scales that are exact (1), inexact (3), huge and tiny, and the
    divide of the presets that store the inverse scale: the payload, amax and clipped count of
    each leaf are the reference's."""
    x = _cast_inputs(dtype)
    cases = [
        (1.0, False),
        (3.0, False),
        (2.0**-10, False),
        (2.0**20, False),
        (3.0, True),
        (0.0, False),
        (np.inf, False),
    ]
    for scale, divide in cases:
        outs, amaxes, clipped = _run_cast(native, [x], [scale], fmt, divide)
        expected, expected_clipped = _reference_cast(x, scale, fmt, divide)
        wrong = np.nonzero(outs[0] != expected)[0]
        assert wrong.size == 0, (scale, divide, x[wrong[:5]], outs[0][wrong[:5]], expected[wrong[:5]])
        assert clipped[0] == expected_clipped, (scale, divide)
        assert _same_amax(amaxes[0], _references([x])[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_in_every_family(kernels: Any, fmt: str) -> None:
    """Each family's cast loops (and their heads and tails at odd sizes and offsets), every dtype
    in one call, against the reference."""
    arrays = []
    for k, dtype in enumerate(DTYPES):
        values = _cast_inputs(dtype, size=20_000)
        arrays += [values, values[k + 1 : k + 1 + 777], values[: 64 - k]]
    scales = [3.0 if k % 2 else 0.5 for k in range(len(arrays))]
    for divide in (False, True):
        outs, amaxes, clipped = _run_cast(kernels, arrays, scales, fmt, divide)
        for k, a in enumerate(arrays):
            expected, expected_clipped = _reference_cast(a, scales[k], fmt, divide)
            assert (outs[k] == expected).all(), (k, a.dtype)
            assert clipped[k] == expected_clipped
            assert _same_amax(amaxes[k], _references([a])[0])


@pytest.mark.parametrize("threads", [2, 5])
def test_cast_across_the_threads_cuts(kernels: Any, threads: int) -> None:
    arrays = [
        _random(n, DTYPES[k % 4], seed=k, scale=40.0) for k, n in enumerate([1_000_003, 7, 2_500_000, 0, 333_333])
    ]
    arrays[0][500_000] = np.nan
    arrays[2][-1] = -np.inf
    scales = [100.0, 1.0, 0.25, 1.0, 3.0]
    one = _run_cast(kernels, arrays, scales, "e4m3fn", threads=1)
    many = _run_cast(kernels, arrays, scales, "e4m3fn", threads=threads)
    for k, a in enumerate(arrays):
        expected, expected_clipped = _reference_cast(a, scales[k], "e4m3fn")
        assert (many[0][k] == expected).all()
        assert (one[0][k] == expected).all()
        assert many[2][k] == one[2][k] == expected_clipped
        assert _same_amax(many[1][k], _references([a])[0])
    assert many[2][0] > 0  # the test saturates something


# ------------------------------------------------------------------------------ the public API


def test_amax_api_on_trees_views_and_scalars() -> None:
    base = _random(10_000, "float32", seed=1)
    strided = base[::3]  # not contiguous: copied, then read in the same pass
    fortran = np.asfortranarray(_random(600, "float64", seed=2).reshape(20, 30))
    swapped = _random(50, "float32", seed=3).astype(">f4")
    tree = {
        "a": [strided, fortran],
        "b": (swapped, np.float16(3.5), np.zeros((0, 4), np.float32)),
        "c": _random(9, "bfloat16", seed=4),
    }
    before = [x.copy() for x in (base, fortran, swapped)]
    amaxes, finite = fp8.amax(tree, with_finite=True)
    leaves = [strided, fortran, swapped, np.asarray(np.float16(3.5)), tree["b"][2], tree["c"]]
    assert amaxes.dtype == np.float32
    assert amaxes.shape == (6,)
    assert all(_same_amax(g, r) for g, r in zip(amaxes, _references(leaves), strict=True))
    assert finite.dtype == np.bool_
    assert finite.shape == ()
    assert bool(finite)
    for x, y in zip(before, (base, fortran, swapped), strict=True):  # read only
        assert x.tobytes() == y.tobytes()
    swapped[7] = np.nan
    assert np.isnan(fp8.amax(tree)[2])


def test_with_finite_is_the_loss_scalers_gradient_check() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        tree = [_random(int(n), DTYPES[trial % 4], seed=trial * 10 + k) for k, n in enumerate(rng.integers(0, 900, 5))]
        if trial % 3 == 0:
            leaf = tree[trial % 5]
            if leaf.size:
                leaf[rng.integers(leaf.size)] = [np.inf, np.nan, -np.inf][trial % 3]
        amaxes, finite = fp8.amax(tree, with_finite=True)
        assert bool(finite) == bool(ampscale.all_finite(tree))
        assert bool(finite) == bool(np.isfinite(amaxes).all())


def test_amax_and_cast_api_keeps_layout_and_structure() -> None:
    fortran = np.asfortranarray(_random(600, "float32", seed=2, scale=100).reshape(20, 30))
    tree = {"w": fortran, "v": [_random(50, "float16", seed=3)[::2], np.float32(7.0)]}
    payloads, amaxes, clipped = fp8.amax_and_cast(tree, [2.0, 0.5, 100.0], "e5m2")
    assert set(payloads) == {"w", "v"}
    assert payloads["w"].flags.f_contiguous
    assert payloads["w"].shape == (20, 30)
    assert payloads["w"].dtype == ml_dtypes.float8_e5m2
    leaves = [fortran, tree["v"][0], np.asarray(tree["v"][1])]
    for q, leaf, scale in zip([payloads["w"], *payloads["v"]], leaves, [2.0, 0.5, 100.0], strict=True):
        assert np.asarray(q).tobytes() == fp8.quantize(leaf, np.float32(scale), "e5m2").tobytes()
    assert clipped.dtype == np.int64
    assert clipped.tolist()[2] == 0
    assert all(_same_amax(g, r) for g, r in zip(amaxes, _references(leaves), strict=True))


def test_without_the_native_kernels_the_numpy_path_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = [_random(1000, d, seed=k, scale=50) for k, d in enumerate(DTYPES)]
    tree[1][3] = np.nan
    fast = fp8.amax(tree), fp8.amax_and_cast(tree, np.float32([1, 2, 3, 4]), "e4m3fn")
    monkeypatch.setattr(_fused, "_native", lambda: None)
    slow = fp8.amax(tree), fp8.amax_and_cast(tree, np.float32([1, 2, 3, 4]), "e4m3fn")
    assert fast[0].tobytes() == slow[0].tobytes()
    for p, q in zip(fast[1][0], slow[1][0], strict=True):
        assert p.tobytes() == q.tobytes()
    assert fast[1][1].tobytes() == slow[1][1].tobytes()
    assert fast[1][2].tolist() == slow[1][2].tolist()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: fp8.amax([]), ValueError, "at least one array"),
        (lambda: fp8.amax([np.int32([1])]), TypeError, "leaf [0] has dtype int32"),
        (lambda: fp8.amax([np.float32([1]), [1.0]]), TypeError, "got float"),
        (lambda: fp8.amax([np.float32([1])], with_finite=1), TypeError, "with_finite must be a bool"),
        (lambda: fp8.amax_and_cast([np.float32([1])], [1.0], "e4m3"), ValueError, "fmt must be one of"),
        (lambda: fp8.amax_and_cast([np.float32([1])], [1.0, 2.0], "e4m3fn"), ValueError, "shape (1,)"),
        (lambda: fp8.amax_and_cast([np.float32([1])], np.float64([1.0]), "e4m3fn"), TypeError, "float32"),
        (lambda: fp8.amax_and_cast([np.float32([1])], ["x"], "e4m3fn"), TypeError, "scales must be"),
        (lambda: fp8.amax_and_cast([np.float32([1])], [1.0], "e5m2", divide="no"), TypeError, "divide must be"),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_it(call: Any, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


@needs_native
def test_the_extension_refuses_bad_buffers_before_writing() -> None:
    x = np.float32([1.0, 2.0])
    out = np.full(1, -1.0, np.float32)
    with pytest.raises(ValueError, match="amaxes must be a writable contiguous buffer of 2 items"):
        native.fp8_amax([x, x], 2, out, 1)
    with pytest.raises(ValueError, match="kind of buffer 0 must be in"):
        native.fp8_amax([x], 9, out, 1)
    with pytest.raises(ValueError, match="format must be in"):
        native.fp8_amax_cast(
            [x], 2, [np.empty(2, np.uint8)], np.float32([1]), 4, False, 0x7F, out, np.empty(1, np.int64), 1
        )
    payload = np.full(3, 0xAA, np.uint8)
    with pytest.raises(ValueError, match="need an output of 2 bytes"):
        native.fp8_amax_cast([x], 2, [payload], np.float32([1]), 0, False, 0x7F, out, np.empty(1, np.int64), 1)
    assert out.tolist() == [-1.0]
    assert payload.tolist() == [0xAA] * 3


# ------------------------------------------------------------------------------ torch on the CPU


@pytest.fixture
def torch_native(request: pytest.FixtureRequest) -> Any:
    torch = pytest.importorskip("torch")
    from ampscale.backends import torch as torch_backend

    if not torch_backend.native_cpu_kernel():
        pytest.skip("the native kernel does not run torch tensors here")
    return torch


@pytest.mark.parametrize("path", ["native", "torch ops"])
def test_torch_cpu_amax_and_cast_are_torch_references(torch_native: Any, path: str) -> None:
    torch = torch_native
    from ampscale.backends import torch as torch_backend

    rng = np.random.default_rng(7)
    leaves = []
    for k, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64) * 3):
        t = torch.from_numpy(rng.standard_normal(int(rng.integers(0, 3000))) * 300).to(dtype)
        if k % 4 == 1 and t.numel():
            t[int(rng.integers(t.numel()))] = float("nan")
        if k % 4 == 2 and t.numel():
            t[-1] = float("-inf")
        leaves.append(t)
    leaves.append(torch.randn(40, 30).t())  # not contiguous
    leaves.append(torch.randn(50, requires_grad=True))
    leaves.append(torch.tensor(-2.5))  # 0-d
    scales = torch.tensor([0.5 + k for k in range(len(leaves))], dtype=torch.float32)
    previous = torch_backend.native_cpu_kernel()
    torch_backend.native_cpu_kernel(path == "native")
    try:
        amaxes, finite = fp8.amax(leaves, with_finite=True)
        results = {fmt: fp8.amax_and_cast(leaves, scales, fmt) for fmt in FORMATS}
        divided = fp8.amax_and_cast(leaves, scales, "e4m3fn", divide=True)
    finally:
        torch_backend.native_cpu_kernel(previous)
    assert amaxes.dtype == torch.float32
    assert finite.dtype == torch.bool
    assert not bool(finite)
    for k, t in enumerate(leaves):
        assert _same_amax(amaxes[k].item(), fp8.tensor_amax(t.detach()).item()), k
    for fmt, (payloads, cast_amaxes, clipped) in [*results.items(), ("e4m3fn/", divided)]:
        assert cast_amaxes.numpy().tobytes() == amaxes.numpy().tobytes()
        for k, t in enumerate(leaves):
            reference = fp8.quantize(
                t.detach(), scales[k], fmt.rstrip("/"), divide=fmt.endswith("/"), compute_dtype=DIVIDE_IN
            )
            assert payloads[k].dtype == reference.dtype
            assert payloads[k].shape == t.shape
            assert torch.equal(payloads[k].view(torch.uint8), reference.view(torch.uint8)), (fmt, k)
            bound = fp8.FORMATS[fmt.rstrip("/")]
            wide = t.detach().float()
            product = wide / scales[k] if fmt.endswith("/") else wide * scales[k]
            assert clipped[k].item() == int((product.abs() > bound).sum()), (fmt, k)


def test_torch_refuses_bad_scales_and_devices(torch_native: Any) -> None:
    torch = torch_native
    x = torch.ones(3)
    with pytest.raises(TypeError, match="scales must be a torch array"):
        fp8.amax_and_cast([x], np.float32([1.0]), "e4m3fn")
    with pytest.raises(TypeError, match="float32"):
        fp8.amax_and_cast([x], torch.ones(1, dtype=torch.float64), "e4m3fn")
    with pytest.raises(TypeError, match="mixes frameworks"):
        fp8.amax([x, np.ones(3, np.float32)])
    meta = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match="one device"):
        fp8.amax([x, meta])
