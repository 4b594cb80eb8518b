"""The fused FP8 pass under JAX: the CPU custom call against the XLA path and the references.

* The custom call (``ampscale_fp8_amax_v1`` / ``ampscale_fp8_amax_cast_v1``) and the XLA path
  give the same bits, under ``jit`` and eagerly, on every dtype (float64 with x64), with inf and
  NaN anywhere, empty and 0-d leaves, more leaves than one call takes.
* The amax is the exact ``max(|x|)`` (NumPy's reference on the same values); XLA's own float
  ``max(abs(x))`` flushes subnormals on the CPU, so where a leaf's largest magnitude is
  subnormal the reference path of JAX says 0 and this pass the exact value: checked as such.
* The payload is ``ampscale.fp8.quantize`` on the same JAX arrays, byte for byte (XLA's flushing
  of subnormal products included: the handler computes in the calling thread's environment).
* ``shard_map`` (one custom call per shard), automatic sharding and ``jax.export`` (the XLA
  path), ``vmap``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import ml_dtypes  # noqa: E402

import ampscale.fp8 as fp8  # noqa: E402
from ampscale.backends import _jax_custom_call  # noqa: E402
from ampscale.fp8 import _fused, _fused_jax  # noqa: E402
from ampscale.fp8._pass import DIVIDE_IN  # noqa: E402
from tests.test_fp8_cast import sample  # noqa: E402

if not _fused_jax._ready()[0]:
    pytest.skip(f"the FP8 custom call is unavailable: {_fused_jax._ready()[1]}", allow_module_level=True)

DTYPES = ["float16", "bfloat16", "float32", "float64"]
FORMATS = sorted(fp8.FORMATS)
NAN32 = 0x7FC00000


def _numpy_leaves(dtype: str, seed: int) -> list[np.ndarray]:
    """Leaves of ``dtype`` with inf and NaN at the first, middle and last place, subnormals,
    -0, an empty and a 0-d leaf."""
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(np_dtype)
    leaves = []
    for n, where, special in [(1000, 0, np.nan), (999, 500, np.inf), (1001, 1000, -np.inf), (64, 63, -np.nan)]:
        a = (rng.standard_normal(n) * 30).astype(np_dtype)
        a[where] = special
        leaves.append(a)
    leaves += [
        (rng.standard_normal(4097) * 100).astype(np_dtype),
        np.array([float(info.smallest_subnormal), -3 * float(info.smallest_subnormal)], np_dtype),
        np.array([-0.0, 0.0], np_dtype),
        np.zeros((0, 3), np_dtype),
        np.asarray(np.array(-7.5, np_dtype)),
        np.array([float(info.max)], np_dtype),
    ]
    return leaves


def _exact(a: np.ndarray) -> np.float32:
    return np.float32(_fused.bits_amax_numpy(a))


def _bits(values: Any) -> list[int]:
    return np.asarray(values, np.float32).view(np.uint32).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_call_and_xla_path_give_the_exact_amaxes(dtype: str) -> None:
    with jax.enable_x64(dtype == "float64"):
        host = _numpy_leaves(dtype, seed=1)
        leaves = [jnp.asarray(a) for a in host]
        fast = jax.jit(fp8.amax)(leaves)
        assert _fused_jax.last_lowering().startswith("custom call")
        with _jax_custom_call.use_custom_call(False):  # a new function: jit keeps a traced one's choice
            slow = jax.jit(lambda t: fp8.amax(t))(leaves)
            assert _fused_jax.last_lowering().startswith("XLA path")
        eager, finite = fp8.amax(leaves, with_finite=True)
    assert _bits(fast) == _bits(slow) == _bits(eager) == _bits([_exact(a) for a in host])
    assert _bits(fast)[:4] == [NAN32, 0x7F800000, 0x7F800000, NAN32]
    assert not bool(finite)
    with jax.enable_x64(dtype == "float64"):
        references = [fp8.tensor_amax(leaf) for leaf in leaves]
    for k, (got, reference) in enumerate(zip(np.asarray(fast), references, strict=True)):
        if np.isnan(reference):
            assert np.isnan(got)
        elif 0 < got < np.finfo(np.float32).tiny:
            assert float(reference) == 0.0  # XLA's float max flushed float32 subnormals: this is exact
        else:
            assert _bits([got]) == _bits([reference]), k


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_is_xlas_quantize_byte_for_byte(fmt: str, dtype: str) -> None:
    with jax.enable_x64(dtype == "float64"):
        values = sample()[::7]
        if dtype in ("float16", "bfloat16"):
            np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
            values = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np_dtype)
        elif dtype == "float64":
            with np.errstate(invalid="ignore"):  # signalling NaNs come out quiet
                values = values.astype(np.float64)
        leaves = [jnp.asarray(values), jnp.asarray(values[3:1003]), jnp.asarray(values[:1])]
        scales = jnp.asarray([1.0, 3.0, 2.0**-6], jnp.float32)
        for divide in (False, True):

            def run(leaves: Any, scales: Any = scales, divide: bool = divide) -> Any:
                return fp8.amax_and_cast(leaves, scales, fmt, divide=divide)

            payloads, amaxes, clipped = jax.jit(run)(leaves)
            assert _fused_jax.last_lowering().startswith("custom call")
            with _jax_custom_call.use_custom_call(False):
                xla = jax.jit(lambda t, run=run: run(t))(leaves)
            for k, leaf in enumerate(leaves):
                reference = fp8.quantize(leaf, scales[k], fmt, divide=divide, compute_dtype=DIVIDE_IN)
                assert payloads[k].dtype == reference.dtype
                got, want = np.asarray(payloads[k]).view(np.uint8), np.asarray(reference).view(np.uint8)
                assert (got == want).all(), (k, divide, np.nonzero(got != want)[0][:5])
                assert (np.asarray(xla[0][k]).view(np.uint8) == want).all()
            assert _bits(amaxes) == _bits(xla[1])
            assert np.asarray(clipped).tolist() == np.asarray(xla[2]).tolist()
            assert clipped.dtype == jnp.int32


def test_many_leaves_mixed_dtypes_in_several_calls() -> None:
    rng = np.random.default_rng(3)
    host = [(rng.standard_normal(int(rng.integers(0, 300))) * 10).astype(DTYPES[k % 3]) for k in range(300)]
    host[17][...] = 0
    if host[250].size:
        host[250][-1] = np.inf
    leaves = [jnp.asarray(a) for a in host]
    assert len(leaves) > 2 * _fused_jax.GROUP
    fast = jax.jit(fp8.amax)(leaves)
    assert _bits(fast) == _bits([_exact(a) for a in host])
    scales = jnp.asarray(rng.uniform(0.5, 50, len(leaves)) * 4000, jnp.float32)  # some saturate
    payloads, amaxes, clipped = jax.jit(lambda x: fp8.amax_and_cast(x, scales, "e5m2"))(leaves)
    assert _bits(amaxes) == _bits(fast)
    for k in (0, 129, 299):
        expected = np.asarray(fp8.quantize(leaves[k], scales[k], "e5m2")).view(np.uint8)
        assert (np.asarray(payloads[k]).view(np.uint8) == expected).all()
        product = host[k].astype(np.float32) * np.float32(scales[k])
        assert int(clipped[k]) == int((np.abs(product) > fp8.FORMATS["e5m2"]).sum())


def test_trees_and_with_finite_under_jit() -> None:
    tree = {"w": jnp.ones((4, 4)) * -3, "b": [jnp.asarray([1.0, jnp.inf], jnp.bfloat16), jnp.zeros(())]}
    amaxes, finite = jax.jit(lambda t: fp8.amax(t, with_finite=True))(tree)
    assert np.asarray(amaxes).tolist() == [np.inf, 0.0, 3.0]  # tree order: b[0], b[1], w
    assert not bool(finite)
    payloads, _, _ = fp8.amax_and_cast(tree, jnp.ones(3), "e4m3fn")
    assert set(payloads) == {"w", "b"}
    assert payloads["w"].shape == (4, 4)


def test_shard_map_runs_one_call_per_shard_and_automatic_sharding_the_xla_path() -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    mesh = jax.make_mesh((4,), ("x",))
    host = (np.random.default_rng(0).standard_normal((8, 100)) * np.arange(1, 9)[:, None]).astype(np.float32)
    host[5, 3] = np.nan
    x = jax.device_put(jnp.asarray(host), NamedSharding(mesh, P("x")))

    def per_shard(block: Any) -> Any:
        return fp8.amax([block])

    shards = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    assert _fused_jax.last_lowering().startswith("custom call")
    assert _bits(shards) == _bits([_exact(host[2 * k : 2 * k + 2]) for k in range(4)])
    whole = jax.jit(lambda t: fp8.amax(t))([x])
    assert _fused_jax.last_lowering() == "XLA path: automatic sharding over 4 devices"
    assert _bits(whole) == [NAN32]


def test_vmap_and_export_take_the_xla_path() -> None:
    batch = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) - 6)
    assert np.asarray(jax.vmap(lambda row: fp8.amax([row]))(batch)).tolist() == [[6.0], [2.0], [5.0]]
    exported = jax.export.export(jax.jit(lambda t: fp8.amax(t)))([jax.ShapeDtypeStruct((4,), jnp.float32)])
    assert _fused_jax.last_lowering().startswith("XLA path: jax.export")
    assert "ampscale_fp8_amax_v1" not in exported.mlir_module()  # no custom call in the artifact
    assert np.asarray(exported.call([jnp.asarray([1.0, -9.0, 2.0, 3.0])])).tolist() == [9.0]


def test_bad_scales_are_refused_before_tracing_anything() -> None:
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        fp8.amax_and_cast([jnp.ones(3), jnp.ones(2)], jnp.ones(3), "e4m3fn")
    with pytest.raises(TypeError, match="float32"):
        fp8.amax_and_cast([jnp.ones(3)], jnp.ones(1, jnp.bfloat16), "e4m3fn")
    with pytest.raises(TypeError, match="leaf \\[0\\] has dtype int32"):
        fp8.amax([jnp.ones(3, jnp.int32)])


# ------------------------------------------------------------------------------ the CUDA handler, without a GPU


def test_the_library_holds_the_fp8_cuda_handlers() -> None:
    import ctypes

    from ampscale._native import ffi_build

    library = ctypes.CDLL(_jax_custom_call.status().library)
    for name in ("ampscale_fp8_amax_v1_cuda", "ampscale_fp8_amax_cast_v1_cuda", "ampscale_ffi_fp8_cuda_bind"):
        assert getattr(library, name, None) is not None, name
    assert "cuda/jax_ffi_fp8_cuda.cc" in ffi_build.UNITS
    assert "cuda/fp8_kernels.cu" in ffi_build.SOURCES  # a layout change rebuilds the handlers


class FakeFp8Driver:
    """``libcuda.so.1`` for the FP8 handlers, on the CPU: the launches run the kernel's host build
    (``ampscale_fp8_jax_host_pass``), the memsets write zeros. Function handle 9 is the kernel."""

    CONTEXT = 0x5150

    def __init__(self) -> None:
        import ctypes

        from ampscale._native.cuda import _fp8
        from tests.fake_cuda import harness_for_source

        self.harness = harness_for_source(_fp8.module_source())
        p, q = ctypes.c_void_p, ctypes.c_longlong
        self.harness.ampscale_fp8_jax_host_pass.argtypes = [p, q, p, q, p, p, ctypes.c_int]
        self.calls: list[tuple[Any, ...]] = []
        voidp, uint = ctypes.c_void_p, ctypes.c_uint
        self.cuLaunchKernel = ctypes.CFUNCTYPE(
            ctypes.c_int, voidp, uint, uint, uint, uint, uint, uint, uint, voidp, ctypes.POINTER(voidp), voidp
        )(self._launch)
        self.cuMemsetD32Async = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, uint, ctypes.c_size_t, voidp)(
            self._memset
        )
        self.cuCtxGetCurrent = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(voidp))(self._get)
        self.cuCtxPushCurrent_v2 = ctypes.CFUNCTYPE(ctypes.c_int, voidp)(lambda c: 0)
        self.cuCtxPopCurrent_v2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(voidp))(lambda c: 0)
        self.cuGetErrorString = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))(
            lambda r, out: 0
        )

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        import ctypes

        self.calls.append(("launch", function, gx, bx, stream))
        pointer = ctypes.c_void_p.from_address
        scales, amaxes, clipped = (pointer(params[k]).value for k in (1, 3, 4))
        options = ctypes.c_longlong.from_address(params[2]).value
        self.harness.ampscale_fp8_jax_host_pass(params[0], gx, scales, options, amaxes, clipped, 7)
        return 0

    def _memset(self, target, value, count, stream) -> int:
        import ctypes

        self.calls.append(("memset", count, stream))
        ctypes.memset(target, 0, 4 * count)
        assert value == 0
        return 0

    def _get(self, out) -> int:
        out[0] = self.CONTEXT
        return 0


def _run_fp8_handler(library: Any, arrays: list[np.ndarray], fmt: str | None, scales: np.ndarray | None) -> Any:
    import ctypes

    n = len(arrays)
    outs = [np.full(a.size, 0xAA, np.uint8) for a in arrays]
    amaxes = np.full(n, -1.0, np.float32)
    clipped = np.full(n, -1, np.int32)
    pointers = ctypes.c_void_p * max(n, 1)
    error = ctypes.create_string_buffer(256)
    result = library.ampscale_ffi_fp8_cuda_run(
        3,
        0xABC0,
        n,
        pointers(*(a.ctypes.data for a in arrays)),
        pointers(*(o.ctypes.data for o in outs)) if fmt else None,
        (ctypes.c_longlong * max(n, 1))(*(a.size for a in arrays)),
        (ctypes.c_int * max(n, 1))(*(_fused.KINDS[a.dtype.name] for a in arrays)),
        None if scales is None else scales.ctypes.data,
        0 if fmt is None else _fused.FORMAT_CODES[fmt],
        0,
        amaxes.ctypes.data,
        clipped.ctypes.data,
        error,
        len(error),
    )
    assert result == 0, error.value
    return outs, amaxes, clipped


def test_the_cuda_handler_on_a_fake_driver_gives_the_references(tmp_path: Any) -> None:
    """The handlers' host logic (memsets, tables of at most 64 tensors by value, grids, slots, the
    empty tensors skipped), their launches run by the kernel's host build."""
    import ctypes
    import shutil

    from ampscale._native.cuda import _fp8

    copy = tmp_path / "libhandler.so"  # a private copy: its per-process tables stay its own
    shutil.copy(_jax_custom_call.status().library, copy)
    library = ctypes.CDLL(str(copy))
    _fp8.declare(library)
    fake = FakeFp8Driver()
    _fp8.set_driver(library, cuda=fake)
    assert library.ampscale_ffi_fp8_cuda_bind(3, FakeFp8Driver.CONTEXT, 9) == 0
    rng = np.random.default_rng(5)
    arrays = [
        (rng.standard_normal(int(n)) * 300).astype(DTYPES[k % 4]) for k, n in enumerate(rng.integers(0, 3000, 150))
    ]
    arrays[1] = np.zeros(0, np.float32)
    arrays[70] = (rng.standard_normal(70_000) * 300).astype(np.float32)  # two blocks
    arrays[70][65_600] = np.nan
    arrays[99][...] = np.inf if arrays[99].size else 0
    _, amaxes, _ = _run_fp8_handler(library, arrays, None, None)
    assert amaxes.view(np.uint32).tolist() == np.array([_exact(a) for a in arrays]).view(np.uint32).tolist()
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert len(launches) == 3  # 149 non-empty tensors, 64 per launch
    assert all(c[3] == _fp8.THREADS and c[4] == 0xABC0 for c in launches)
    assert fake.calls[0] == ("memset", 150, 0xABC0)
    scales = np.float32(rng.uniform(0.5, 4, len(arrays)))
    for fmt in FORMATS:
        outs, cast_amaxes, clipped = _run_fp8_handler(library, arrays, fmt, scales)
        assert cast_amaxes.tobytes() == amaxes.tobytes()
        for k, a in enumerate(arrays):
            with np.errstate(over="ignore"):
                expected, count = _fused.reference_cast_numpy(a, scales[k], fmt, False)
            assert (outs[k] == expected.view(np.uint8).reshape(-1)).all(), (fmt, k)
            assert clipped[k] == count


@pytest.fixture
def cuda_state(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, str]]:
    state: list[tuple[bool, str]] = []
    monkeypatch.setattr(_fused_jax, "_cuda", state)
    monkeypatch.setattr(_fused_jax, "_cuda_warned", [False])
    return state


def _lower_for(platforms: tuple[str, ...], cast: bool = False) -> str:
    leaves = [jnp.ones(3), jnp.ones(2, jnp.float16)]
    if cast:
        fn = jax.jit(lambda t: fp8.amax_and_cast(t, jnp.ones(2), "e4m3fn"))
    else:
        fn = jax.jit(lambda t: fp8.amax(t))
    return fn.trace(leaves).lower(lowering_platforms=platforms).as_text()


def test_lowering_for_cuda_uses_the_handler_where_the_kernel_is_bound(cuda_state: Any, monkeypatch: Any) -> None:
    cuda_state[:] = [(True, "NVRTC cubin for sm_90, 1 device")]
    assert "custom_call @ampscale_fp8_amax_v1(" in _lower_for(("cuda",))
    assert _fused_jax.last_lowering() == "custom call (CUDA)"
    assert _lower_for(("cpu", "cuda"), cast=True).count("custom_call @ampscale_fp8_amax_cast_v1(") == 2
    cuda_state[:] = []
    from ampscale.backends import _jax_custom_call as loss_call

    monkeypatch.setattr(loss_call, "_cuda_devices", list)  # as on a machine without a GPU
    assert "ampscale_fp8_amax_v1" not in _lower_for(("cuda",))
    assert _fused_jax.last_lowering() == "XLA path: CUDA kernels unavailable (no CUDA device in this process)"


def test_large_leaves_split_across_xlas_threads_merge_to_the_exact_amaxes() -> None:
    """Above the kernels' parallel threshold the handler cuts the bytes into pieces run on XLA's
    intra-op pool: a leaf cut in two merges its pieces' maxima (and counts)."""
    rng = np.random.default_rng(8)
    host = [rng.standard_normal(n).astype(d) for n, d in [(1_500_001, "float32"), (900_000, "float16"), (7, "float32")]]
    host[0][750_000] = -1e30  # near the middle, where the bytes are cut
    host[1][-1] = np.inf
    leaves = [jnp.asarray(a) for a in host]
    assert sum(a.nbytes for a in host) > 2 * (1 << 21)
    amaxes = jax.jit(lambda t: fp8.amax(t))(leaves)
    assert _fused_jax.last_lowering().startswith("custom call")
    assert _bits(amaxes) == _bits([_exact(a) for a in host])
    scales = jnp.asarray([1e-28, 1.0, 1.0], jnp.float32)
    payloads, _, clipped = jax.jit(lambda t: fp8.amax_and_cast(t, scales, "e4m3fn"))(leaves)
    for k, leaf in enumerate(leaves):
        expected = np.asarray(fp8.quantize(leaf, scales[k], "e4m3fn")).view(np.uint8)
        assert (np.asarray(payloads[k]).view(np.uint8) == expected).all()
    counts = [_fused.reference_cast_numpy(a, np.float32(scales[k]), "e4m3fn", False)[1] for k, a in enumerate(host)]
    assert np.asarray(clipped).tolist() == counts == [0, 1, 0]  # -1e30 * 1e-28 is -100; the inf is clipped


def test_registered_pytrees_are_flattened_by_jax() -> None:
    """A tree node only JAX knows (a registered class) is flattened by ``jax.tree_util``."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: Any
        b: Any

    params = Params(w=jnp.asarray([[1.0, -8.0]]), b=jnp.asarray([3.0], jnp.bfloat16))
    assert np.asarray(jax.jit(lambda p: fp8.amax(p))(params)).tolist() == [8.0, 3.0]  # the fields in order
    payloads, _, _ = fp8.amax_and_cast(params, jnp.asarray([1.0, 1.0]), "e5m2")
    assert isinstance(payloads, Params)
    with pytest.raises(TypeError, match="got object"):
        fp8.amax([object()])
