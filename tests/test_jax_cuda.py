"""The JAX custom call's CUDA handler, checked on a machine without a GPU.

* The handler is built by the host compiler against jaxlib's FFI headers, into the library with
  the CPU handler, and exports its entry points.
* Its kernels (``jax_kernels.cu`` after ``kernels.cu``) compile with NVRTC (pip's wheel) and nvcc
  to PTX for sm_80 and sm_90, with no ``fma``, no ``.ftz``, the leaf table read from the
  launch's parameters (no local copy) and bfloat16 rounded by the device's ``cvt``.
* The handler's host logic (every launch, its grid and table, the copies for results that do
  not alias their operands, the context switch, the errors) runs on the CPU against a fake
  driver whose launches run the very same kernel source built by the host compiler, and the
  results are compared bit for bit with NumPy.
* The lowering for CUDA: the custom call where the kernels are loaded, the pure-XLA path with the
  reason (and one warning where there is a GPU) where they cannot be, and ``jax.export``.

The GPU runs are in ``tests/test_jax_cuda_gpu.py`` (``scripts/gpu-check.sh``).
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import shutil
import subprocess
import warnings
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import ampscale  # noqa: E402
from ampscale._native import ffi_build as _ffi_build  # noqa: E402
from ampscale._native.cuda import _jax, _plan, driver, nvrtc  # noqa: E402
from ampscale.backends import _jax_custom_call  # noqa: E402
from ampscale.backends import jax as jax_backend  # noqa: E402

TARGET = _jax_custom_call.TARGET
NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
BF16 = np.dtype(ml_dtypes.bfloat16)
KINDS = {np.dtype(np.float16): 0, BF16: 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: ``struct AmpscaleJaxLeaves``, as the kernel reads it
TABLE = np.dtype(
    [
        ("data", "<u8", (_jax.LEAVES,)),
        ("meta", "<i8", (_jax.LEAVES,)),
        ("first_chunk", "<i8", (_jax.LEAVES + 1,)),
        ("count", "<i8"),
    ]
)
try:
    nvrtc.load()
    NVRTC_MISSING = None
except OSError as exc:
    NVRTC_MISSING = str(exc)


def _library_path() -> str:
    status = jax_backend.custom_call_status()
    if not status.available:
        pytest.skip(f"the handler library is unavailable here: {status.reason}")
    assert status.library is not None
    return status.library


def test_the_library_holds_the_cuda_handler() -> None:
    """Built by the host compiler against the FFI headers, no CUDA toolkit: the CUDA handler and
    its set-up entry points are exported beside the CPU handler."""
    if _ffi_build.find_compiler() is not None and _ffi_build.jaxlib_headers() is not None:
        assert jax_backend.custom_call_status().available  # CI has both: the build must not be skipped
    library = ctypes.CDLL(_library_path())
    for name in ("ampscale_check_and_unscale_v1_cuda", "ampscale_ffi_cuda_set_driver", "ampscale_ffi_cuda_bind"):
        assert getattr(library, name, None) is not None, name
    assert "cuda/jax_ffi_cuda.cc" in _ffi_build.UNITS
    assert "cuda/jax_kernels.cu" in _ffi_build.SOURCES  # a kernel layout change rebuilds the handler


# ------------------------------------------------------------------------------ the PTX


def _entry(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start : ptx.index("\n}\n", start)]


def check_ptx(ptx: str, arch: str) -> None:
    assert f".target {arch}" in ptx
    assert not re.search(r"\bfma\.", ptx), "contracted to FMA"
    assert ".ftz" not in ptx, "flush-to-zero"
    begin = _entry(ptx, "ampscale_jax_begin")
    unscale = _entry(ptx, "ampscale_jax_unscale")
    assert "st.global.u8" in begin
    # the table is a 3,088-byte parameter, read where the driver put it: no per-thread copy
    assert f".param .align 8 .b8 ampscale_jax_unscale_param_2[{TABLE.itemsize}]" in unscale
    # every parameter together within the 4 KB that every driver accepts (the larger limit of
    # CUDA 12.1+ is not used: see AMPSCALE_JAX_LEAVES)
    signature = unscale[: unscale.index(")")]
    sizes = [int(n) for n in re.findall(r"\.b8 \w+\[(\d+)\]", signature)]
    sizes += [8 for _ in re.findall(r"\.param \.u64 ", signature)]
    assert len(sizes) == 3
    assert sum(sizes) <= 4096
    assert "__local_depot" not in unscale
    assert "cvt.rn.bf16.f32" in unscale  # bfloat16 NaNs as XLA stores them on sm_80 and later


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be loaded: {NVRTC_MISSING}")
@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_with_nvrtc(arch: int) -> None:
    ptx, kind = nvrtc.compile_source(_jax.module_source(), arch, _plan.COMPILE_OPTIONS, ptx=True)
    assert kind == "ptx"
    check_ptx(ptx.decode(errors="replace").rstrip("\0"), f"sm_{arch}")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_kernels_compile_with_nvcc(tmp_path: pathlib.Path, arch: str) -> None:
    source = tmp_path / "jax.cu"
    source.write_text(_jax.module_source())
    out = tmp_path / "jax.ptx"
    assert NVCC is not None
    subprocess.run([NVCC, "--ptx", f"-arch={arch}", *_plan.COMPILE_OPTIONS, "-o", str(out), str(source)], check=True)
    check_ptx(out.read_text(), arch)


def test_the_module_is_header_free_and_the_layout_is_shared() -> None:
    source = _jax.module_source()
    assert "#include" not in source
    for name in _jax.FUNCTIONS:
        assert f'extern "C" __global__ void {name}(' in source
    assert (_jax.LEAVES, _jax.CHUNK, _jax.THREADS) == (128, 65536, 512)
    handler = (pathlib.Path(_ffi_build.HERE) / "cuda" / "jax_ffi_cuda.cc").read_text()
    assert '#include "jax_kernels.cu"' in handler  # the handler's table is the kernel's


# ------------------------------------------------------------------------------ a fake driver


class FakeDriver:
    """``libcuda.so.1`` for the handler, on the CPU: launches run the host build of the kernels.

    Function handles: 1 is ``ampscale_jax_begin``, 2 ``ampscale_jax_unscale``. Every call is
    recorded; ``fail`` makes the next launch of that handle fail with CUresult 700.
    """

    CONTEXT = 0x5150

    def __init__(self, harness: ctypes.CDLL) -> None:
        self.harness = harness
        self.calls: list[tuple[Any, ...]] = []
        self.tables: list[np.ndarray] = []
        self.current = self.CONTEXT
        self.fail: int | None = None
        self.message = ctypes.c_char_p(b"an illegal memory access was encountered")
        voidp, uint = ctypes.c_void_p, ctypes.c_uint
        self.cuLaunchKernel = ctypes.CFUNCTYPE(
            ctypes.c_int, voidp, uint, uint, uint, uint, uint, uint, uint, voidp, ctypes.POINTER(voidp), voidp
        )(self._launch)
        self.cuCtxGetCurrent = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(voidp))(self._get)
        self.cuCtxPushCurrent_v2 = ctypes.CFUNCTYPE(ctypes.c_int, voidp)(self._push)
        self.cuCtxPopCurrent_v2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(voidp))(self._pop)
        self.cuMemcpyDtoDAsync_v2 = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, voidp
        )(self._copy)
        self.cuGetErrorString = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))(
            self._error
        )

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        self.calls.append(("launch", function, (gx, gy, gz), (bx, by, bz), shared, stream))
        if function == self.fail:
            return 700
        pointer = ctypes.c_void_p.from_address
        if function == 1:
            self.harness.ampscale_jax_host_begin(pointer(params[0]).value)
        else:
            inv, finite = pointer(params[0]).value, pointer(params[1]).value
            table = np.frombuffer(ctypes.string_at(params[2], TABLE.itemsize), TABLE)[0]
            self.tables.append(table)
            self.harness.ampscale_jax_host_unscale(inv, finite, params[2], gx, 7)
        return 0

    def _get(self, out) -> int:
        out[0] = self.current
        return 0

    def _push(self, context) -> int:
        self.calls.append(("push", context))
        return 0

    def _pop(self, out) -> int:
        self.calls.append(("pop",))
        out[0] = self.CONTEXT
        return 0

    def _copy(self, target, source, size, stream) -> int:
        self.calls.append(("copy", target, source, size, stream))
        ctypes.memmove(target, source, size)
        return 0

    def _error(self, result, out) -> int:
        out[0] = self.message.value
        return 0

    def launches(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "launch"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The JAX kernels built for the CPU (``-DAMPSCALE_HOST_TEST``)."""
    if CXX is None:
        pytest.skip("no C++ compiler on PATH")
    directory = tmp_path_factory.mktemp("jax_cuda")
    (directory / "module.cpp").write_text(_jax.module_source())
    out = directory / "libjax_host.so"
    flags = ["-DAMPSCALE_HOST_TEST", "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
    subprocess.run([CXX, *flags, "-o", str(out), str(directory / "module.cpp")], check=True, timeout=300)
    so = ctypes.CDLL(str(out))
    p = ctypes.c_void_p
    so.ampscale_jax_host_begin.argtypes = [p]
    so.ampscale_jax_host_unscale.argtypes = [p, p, p, ctypes.c_longlong, ctypes.c_int]
    return so


@pytest.fixture
def handler(tmp_path: pathlib.Path, harness: ctypes.CDLL) -> tuple[ctypes.CDLL, FakeDriver]:
    """A private copy of the handler library (its tables are per process: a real GPU's stay
    untouched), bound to the fake driver for device 3."""
    copy = tmp_path / "libhandler.so"
    shutil.copy(_library_path(), copy)
    library = ctypes.CDLL(str(copy))
    _jax.declare(library)
    fake = FakeDriver(harness)
    _jax.set_driver(library, cuda=fake)
    assert library.ampscale_ffi_cuda_bind(3, FakeDriver.CONTEXT, 1, 2) == 0
    return library, fake


STREAM = 0xABC0


def run(
    library: ctypes.CDLL,
    arrays: list[np.ndarray],
    inv: float,
    targets: list[np.ndarray] | None = None,
    ordinal: int = 3,
) -> tuple[bool, str]:
    """One call of the handler over ``arrays`` (unscaled in place, or into ``targets``)."""
    n = len(arrays)
    targets = arrays if targets is None else targets
    inverse = np.asarray(inv, np.float32)
    finite = np.full(1, 7, np.uint8)  # neither 0 nor 1: the begin launch must set it
    pointers = ctypes.c_void_p * max(n, 1)
    error = ctypes.create_string_buffer(512)
    result = library.ampscale_ffi_cuda_run(
        ordinal,
        STREAM,
        inverse.ctypes.data,
        finite.ctypes.data,
        n,
        pointers(*(a.ctypes.data for a in arrays)),
        pointers(*(t.ctypes.data for t in targets)),
        (ctypes.c_longlong * max(n, 1))(*(a.size for a in arrays)),
        (ctypes.c_int * max(n, 1))(*(KINDS[a.dtype] for a in arrays)),
        error,
        len(error),
    )
    if result != 0:
        return False, error.value.decode()
    assert finite[0] in (0, 1)
    return bool(finite[0]), ""


def reference(x: np.ndarray, inv: float) -> np.ndarray:
    inv32 = np.float32(inv)
    with np.errstate(over="ignore", invalid="ignore"):
        if x.dtype == np.float64:
            return x * np.float64(inv32)
        return (x.astype(np.float32) * inv32).astype(x.dtype)


def assert_unscaled(out: np.ndarray, expected: np.ndarray) -> None:
    """Bit for bit, except that a NaN's payload is the device's (checked on the GPU)."""
    nan = np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(out.astype(np.float64)), nan)
    bits = UINT[out.dtype.itemsize]
    np.testing.assert_array_equal(out[~nan].view(bits), expected[~nan].view(bits))


def leaves(rng: np.random.Generator, sizes: list[int], dtypes: list[Any]) -> list[np.ndarray]:
    out = []
    for i, size in enumerate(sizes):
        with np.errstate(over="ignore"):
            out.append((rng.standard_normal(size) * 100).astype(dtypes[i % len(dtypes)]))
    return out


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_bit_for_bit_across_chunks_and_launches(handler, dtype) -> None:
    """300 buffers of one dtype (three launches of at most 128), sizes across the 64 Ki-element
    chunks, empty ones among them; every element unscaled as NumPy does."""
    library, _ = handler
    rng = np.random.default_rng(0)
    choices = [0, 1, 3, 17, 1000, 65535, 65536, 65537, 140_000]
    sizes = [int(s) for s in rng.choice(choices, 300, p=[0.05, *[0.95 / 8] * 8])]
    arrays = leaves(rng, sizes, [dtype])
    for inv in (2.0**-7, 1.0, 3.0):
        expected = [reference(a, inv) for a in arrays]
        finite, error = run(library, arrays, inv)
        assert error == ""
        assert finite is all(bool(np.isfinite(e.astype(np.float64)).all()) for e in expected)
        for a, e in zip(arrays, expected, strict=True):
            assert_unscaled(a, e)


def test_launches_grids_and_tables(handler) -> None:
    library, fake = handler
    rng = np.random.default_rng(1)
    sizes = [5, 0, 70_000, *([1] * 130), 0, 200_000]
    arrays = leaves(rng, sizes, [np.float32, np.float16, BF16, np.float64])
    assert run(library, arrays, 0.5) == (True, "")
    launches = fake.launches()
    assert [c[1] for c in launches] == [1, 2, 2]  # the flag first, then two table launches
    assert all(c[5] == STREAM for c in launches)  # all on XLA's stream
    assert launches[0][2:4] == ((1, 1, 1), (1, 1, 1))
    non_empty = [i for i, s in enumerate(sizes) if s]
    first, second = non_empty[: _jax.LEAVES], non_empty[_jax.LEAVES :]
    for table, members, launch in zip(fake.tables, (first, second), launches[1:], strict=True):
        count = len(members)
        chunks = [-(-sizes[i] // _jax.CHUNK) for i in members]
        assert table["count"] == count
        assert table["data"][:count].tolist() == [arrays[i].ctypes.data for i in members]
        assert (table["meta"][:count] >> 8).tolist() == [sizes[i] for i in members]
        assert (table["meta"][:count] & 0xFF).tolist() == [KINDS[arrays[i].dtype] for i in members]
        assert table["first_chunk"][: count + 1].tolist() == np.concatenate([[0], np.cumsum(chunks)]).tolist()
        assert launch[2] == (sum(chunks), 1, 1)
        assert launch[3] == (_jax.THREADS, 1, 1)
    assert not any(c[0] in ("push", "pop", "copy") for c in fake.calls)  # XLA's context is the module's


def test_a_call_of_the_lowering_is_one_flag_launch_and_one_table_launch(handler) -> None:
    """Why the table stays at 128 leaves (jax_kernels.cu, AMPSCALE_JAX_LEAVES): the lowering puts
    at most GROUP leaves in a call, and a full group takes one table launch, so a larger table
    (CUDA 12.1's large parameters) would save no launch."""
    assert _jax_custom_call.GROUP <= _jax.LEAVES
    library, fake = handler
    arrays = leaves(np.random.default_rng(3), [3] * _jax_custom_call.GROUP, [np.float32, np.float16])
    assert run(library, arrays, 0.5) == (True, "")
    assert [c[1] for c in fake.launches()] == [1, 2]


def test_only_empty_buffers_or_none_give_a_true_flag(handler) -> None:
    library, fake = handler
    assert run(library, [np.zeros(0, np.float32), np.zeros(0, np.float16)], 2.0) == (True, "")
    assert run(library, [], 2.0) == (True, "")
    assert [c[1] for c in fake.launches()] == [1, 1]  # the flag only


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_bad_value_anywhere_clears_the_flag(handler, bad: float) -> None:
    library, _ = handler
    rng = np.random.default_rng(2)
    sizes = [7, 65537, 3, *([2] * 140), 131_072]
    for where in (0, 1, len(sizes) - 1, 100, 140):
        arrays = leaves(rng, sizes, [np.float32, BF16, np.float16])
        for position in {0, sizes[where] - 1, min(65536, sizes[where] - 1)}:
            probe = [a.copy() for a in arrays]
            probe[where][position] = bad
            expected = [reference(a, 0.25) for a in probe]
            assert run(library, probe, 0.25) == (False, ""), (where, position)
            for a, e in zip(probe, expected, strict=True):
                assert_unscaled(a, e)


def test_a_finite_value_that_overflows_when_unscaled_clears_the_flag(handler) -> None:
    library, _ = handler
    x = np.asarray([60000.0, 1.0], np.float16)
    assert run(library, [x], 2.0) == (False, "")
    assert np.isinf(x[0])


def test_results_that_do_not_alias_are_copied_then_unscaled(handler) -> None:
    library, fake = handler
    rng = np.random.default_rng(3)
    sources = leaves(rng, [10, 0, 70_000], [np.float32, np.float16, BF16])
    kept = [s.copy() for s in sources]
    targets = [np.full_like(s, 9) for s in sources]
    assert run(library, sources, 0.125, targets) == (True, "")
    for source, before, target in zip(sources, kept, targets, strict=True):
        np.testing.assert_array_equal(source, before)  # never written
        assert_unscaled(target, reference(before, 0.125))
    copies = [c for c in fake.calls if c[0] == "copy"]
    assert [(c[1], c[2], c[3], c[4]) for c in copies] == [
        (t.ctypes.data, s.ctypes.data, s.nbytes, STREAM) for s, t in zip(sources, targets, strict=True) if s.size
    ]
    assert fake.calls.index(copies[-1]) < fake.calls.index(fake.launches()[0])  # copied before any launch


def test_another_current_context_is_switched_for_the_call(handler) -> None:
    library, fake = handler
    fake.current = 0x7777
    assert run(library, [np.ones(4, np.float32)], 0.5) == (True, "")
    assert fake.calls[0] == ("push", FakeDriver.CONTEXT)
    assert fake.calls[-1] == ("pop",)


def test_errors_name_the_cause(handler) -> None:
    library, fake = handler
    finite, error = run(library, [np.ones(4, np.float32)], 0.5, ordinal=0)
    assert not finite
    assert "not loaded for device 0" in error
    assert "register_custom_call()" in error
    fake.current = 0x7777
    fake.fail = 2
    finite, error = run(library, [np.ones(4, np.float32)], 0.5)
    assert "cuLaunchKernel (ampscale_jax_unscale) failed: an illegal memory access was encountered" in error
    assert "(CUresult 700)" in error
    assert fake.calls[-1] == ("pop",)  # the caller's context is restored on failure too
    error = ctypes.create_string_buffer(200)
    one = (ctypes.c_void_p * 1)(np.ones(1).ctypes.data)
    bad_kind = library.ampscale_ffi_cuda_run(
        3, 0, None, None, 1, one, one, (ctypes.c_longlong * 1)(1), (ctypes.c_int * 1)(9), error, 200
    )
    assert bad_kind == -1
    assert error.value == b"gradient 0: dtype code 9 or count 1 is invalid"
    assert library.ampscale_ffi_cuda_bind(-1, 1, 1, 1) == -1
    assert library.ampscale_ffi_cuda_bind(1, 1, None, 1) == -1


def test_set_driver_names_a_missing_entry_point(tmp_path: pathlib.Path) -> None:
    copy = tmp_path / "libhandler.so"
    shutil.copy(_library_path(), copy)
    library = ctypes.CDLL(str(copy))
    _jax.declare(library)

    class Partial:
        cuLaunchKernel = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    with pytest.raises(OSError, match=r"libcuda\.so\.1 has no cuCtxGetCurrent"):
        _jax.set_driver(library, cuda=Partial)


# ------------------------------------------------------------------------------ the lowering


def _fused(leaves, inv):
    return _jax_custom_call.check_and_unscale(leaves, inv)


LEAVES = [jnp.ones(3), jnp.ones(2, jnp.float16)]


def _lower_for_cuda(platforms: tuple[str, ...] = ("cuda",)) -> str:
    # a new function each time: jit caches lowerings
    traced = jax.jit(lambda g, inv: _fused(g, inv)).trace(LEAVES, jnp.float32(0.5))
    return traced.lower(lowering_platforms=platforms).as_text()


@pytest.fixture
def cuda_state(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, str]]:
    """The process's CUDA readiness, undecided (the library loaded first), restored after the test."""
    state: list[tuple[bool, str]] = []
    monkeypatch.setattr(_jax_custom_call, "_cuda", state)
    monkeypatch.setattr(_jax_custom_call, "_cuda_warned", False)
    return state


def test_lowering_for_cuda_uses_the_custom_call_where_the_kernels_are_loaded(cuda_state) -> None:
    cuda_state[:] = [(True, "NVRTC cubin for sm_90, 1 device")]
    text = _lower_for_cuda()
    assert f"custom_call @{TARGET}(" in text
    assert text.count("output_operand_alias<output_tuple_indices = [") == len(LEAVES)  # in place
    assert jax_backend.custom_call_status().last_lowering == "custom call (CUDA)"
    both = _lower_for_cuda(("cpu", "cuda"))  # one module for both platforms: the call in each branch
    assert both.count(f"custom_call @{TARGET}(") == 2


def test_without_the_kernels_the_xla_path_is_lowered_with_the_reason(cuda_state, monkeypatch) -> None:
    monkeypatch.setattr(_jax_custom_call, "_cuda_devices", list)  # as on a machine without a GPU
    text = _lower_for_cuda()
    assert TARGET not in text
    assert jax_backend.custom_call_status().last_lowering == (
        "XLA path: CUDA kernels unavailable (no CUDA device in this process)"
    )
    status = jax_backend.custom_call_status()
    assert not status.cuda_available
    assert "CUDA: pure-XLA path (no CUDA device in this process)" in str(status)


def test_on_a_gpu_whose_kernels_cannot_load_one_warning_says_why(cuda_state, monkeypatch) -> None:
    monkeypatch.setattr(_jax_custom_call, "_cuda_devices", lambda: ["a GPU"])
    monkeypatch.setattr(driver, "unavailable_reason", lambda: "the NVRTC library (libnvrtc) was not found; tried x")
    with pytest.warns(ampscale.PerformanceWarning, match="JAX CUDA custom call is unavailable.*libnvrtc") as caught:
        assert TARGET not in _lower_for_cuda()
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TARGET not in _lower_for_cuda()  # once per process
    assert "libnvrtc" in jax_backend.custom_call_status().last_lowering


@pytest.mark.parametrize("failure", ["driver", "nvrtc"])
def test_the_reason_names_what_failed(cuda_state, monkeypatch, failure: str) -> None:
    monkeypatch.setattr(_jax_custom_call, "_cuda_devices", lambda: [jax.devices()[0]])
    if failure == "driver":
        monkeypatch.setattr(driver, "unavailable_reason", lambda: "the CUDA driver libcuda.so.1 could not be loaded: x")
    else:
        monkeypatch.setattr(driver, "unavailable_reason", lambda: None)
        monkeypatch.setattr(_jax, "set_driver", lambda library: None)

        def refuse(library, ordinal):
            raise nvrtc.NvrtcError("NVRTC could not compile ampscale.cu (--gpu-architecture=sm_90): boom")

        monkeypatch.setattr(_jax, "bind", refuse)
    ready, why = _jax_custom_call._cuda_ready()
    assert not ready
    assert ("libcuda.so.1" if failure == "driver" else "NVRTC could not compile") in why
    assert _jax_custom_call._cuda_ready() == (ready, why)  # decided once per process


def test_exports_stay_portable_and_can_keep_the_call_for_cuda(cuda_state) -> None:
    from jax import export

    def fn():
        return jax.jit(lambda g: ampscale.create_scaler(backend="jax", init_scale=2.0).unscale(g))

    portable = export.export(fn(), platforms=["cuda"])(LEAVES)
    assert TARGET not in portable.mlir_module()
    with _jax_custom_call.use_custom_call(in_exports=True):
        kept = export.export(
            fn(), platforms=["cpu", "cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET)]
        )(LEAVES)
    # kept for CUDA too, though this process has no GPU: the process that runs it loads the kernels
    assert kept.mlir_module().count(f"custom_call @{TARGET}(") == 2
    out, finite = kept.call(LEAVES)  # and it runs here, on the CPU
    assert bool(finite)
    np.testing.assert_array_equal(np.asarray(out[0]), np.full(3, 0.5, np.float32))


def test_info_and_doctor_say_where_cuda_stands(capsys) -> None:
    from ampscale.__main__ import info

    status = jax_backend.custom_call_status()
    cuda = f"CUDA: {'on' if status.cuda_available else 'pure-XLA path'} ({status.cuda_reason})"
    assert info() == 0
    assert cuda in capsys.readouterr().out
    scaler = ampscale.create_scaler(backend="jax").update(True)
    assert cuda in ampscale.doctor(scaler).evidence["jax custom call"]
