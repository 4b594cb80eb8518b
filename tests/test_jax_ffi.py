"""The JAX backend's CPU custom call: bit for bit the pure-XLA path and jmp, wherever it runs.

Every comparison is of raw bits (NaN payloads, signed zeros and flushed denormals included),
between the custom call (``_jax_custom_call``, the native kernels inside XLA) and the pure-XLA
path the backend uses where the custom call cannot run, under jit, scan, vmap, shard_map on 4
CPU devices, with and without donation, and with the custom call turned off.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import ampscale  # noqa: E402
from ampscale._native import ffi_build as _ffi_build  # noqa: E402
from ampscale.backends import _jax_custom_call  # noqa: E402
from ampscale.backends import jax as jax_backend  # noqa: E402

TARGET = _jax_custom_call.TARGET
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _can_build() -> bool:
    return _ffi_build.find_compiler() is not None and _ffi_build.jaxlib_headers() is not None


@pytest.fixture(scope="module", autouse=True)
def _custom_call_available() -> None:
    """Every test here needs the handler: built at install or compiled now (once, cached)."""
    if os.environ.get("AMPSCALE_JAX_CUSTOM_CALL", "1") in ("0", "off", "false", "no"):
        pytest.skip("AMPSCALE_JAX_CUSTOM_CALL turns the custom call off")
    status = jax_backend.custom_call_status()
    if not status.available and not _can_build():
        pytest.skip(f"no C++ compiler or jaxlib headers here: {status.reason}")


def test_the_custom_call_is_built_where_a_compiler_and_jaxlib_are() -> None:
    """Fails if the build silently did not happen (CI has both a compiler and jax)."""
    status = jax_backend.custom_call_status()
    assert status.available, status.reason
    assert status.active
    assert status.kernel_isa in ("avx512", "avx2+f16c", "generic")
    assert status.library is not None
    assert os.path.exists(status.library)
    assert "on (" in str(status)


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _bits(x: object) -> np.ndarray:
    a = np.asarray(x)
    return a.reshape(-1).view(UINT[a.dtype.itemsize])


def _specials(dtype: np.dtype) -> np.ndarray:
    """inf, -inf, NaNs with payloads (quiet, signalling, negative), zeros, denormals, the extremes."""
    info = ml_dtypes.finfo(dtype) if dtype == np.dtype(ml_dtypes.bfloat16) else np.finfo(dtype)
    bits = info.bits
    uint = UINT[bits // 8]
    exponent_bits = {16: 5, 32: 8, 64: 11}[bits] if dtype != np.dtype(ml_dtypes.bfloat16) else 8
    mantissa = bits - 1 - exponent_bits
    exp_all = ((1 << exponent_bits) - 1) << mantissa
    sign = 1 << (bits - 1)
    quiet = 1 << (mantissa - 1)
    raw = [
        exp_all,  # inf
        sign | exp_all,  # -inf
        exp_all | quiet,  # canonical quiet nan
        exp_all | quiet | 5,  # quiet nan with a payload
        sign | exp_all | quiet | 3,  # negative nan with a payload
        exp_all | 1,  # signalling nan
        sign | exp_all | (quiet >> 1),  # negative signalling nan
        0,
        sign,  # -0
        1,  # smallest denormal
        sign | (quiet - 1),  # a negative denormal
        1 << mantissa,  # smallest normal
    ]
    values = np.array(raw, dtype=uint).view(dtype)
    return np.concatenate([values, np.array([info.max, -info.max, info.tiny], dtype=dtype)])


def _leaves(dtype_name: str, seed: int, sizes: tuple[int, ...]) -> list[np.ndarray]:
    dtype = _np_dtype(dtype_name)
    rng = np.random.default_rng(seed)
    specials = _specials(dtype)
    leaves = []
    for size in sizes:
        with np.errstate(over="ignore"):  # float16 values past 65504 become inf, as intended
            values = (rng.standard_normal(size) * 2.0 ** rng.integers(-20, 20)).astype(dtype)
        if size:
            # specials at the first and last elements and a few random ones (SIMD tails included)
            at = np.unique(np.concatenate([[0, size - 1], rng.integers(0, size, 3)]))
            values[at] = rng.choice(specials, len(at))
        leaves.append(values)
    return leaves


def _fused_jit(donate: bool = False):
    def run(leaves, inv):
        fused = _jax_custom_call.check_and_unscale(leaves, inv)
        assert fused is not None
        return fused

    return jax.jit(run, donate_argnums=0 if donate else ())


_xla_jit = jax.jit(jax_backend._check_and_unscale_xla)


def _assert_same(a: tuple, b: tuple) -> None:
    (outs_a, finite_a), (outs_b, finite_b) = a, b
    assert bool(finite_a) == bool(finite_b)
    for x, y in zip(outs_a, outs_b, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).shape == np.asarray(y).shape
        np.testing.assert_array_equal(_bits(x), _bits(y))


INVERSES = (2.0**-16, 1.0, 1 / 3, 0.1, 3.0, 2.0**20, 0.0, float("inf"))


def check_against_the_xla_path(dtype: str, seed: int, sizes: tuple[int, ...]) -> None:
    """Leaves of ``sizes`` with specials anywhere, and a 0-d one, through the custom call and the
    pure-XLA path, at every inverse in INVERSES, with and without the specials."""
    with jax.enable_x64(dtype == "float64"):
        leaves = [jnp.asarray(x) for x in _leaves(dtype, seed, sizes)]
        leaves.append(jnp.asarray(_specials(_np_dtype(dtype))[seed]))  # a 0-d leaf
        fused = _fused_jit()
        assert TARGET in fused.lower(leaves, jnp.float32(1)).as_text()
        for inv in INVERSES:
            inv32 = jnp.float32(inv)
            _assert_same(fused(leaves, inv32), _xla_jit(leaves, inv32))
            # and with every value finite: the flag must say so
            clean = [jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype)) for x in leaves]
            _assert_same(fused(clean, inv32), _xla_jit(clean, inv32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_bit_for_bit_the_xla_path_on_every_dtype(dtype: str, seed: int) -> None:
    check_against_the_xla_path(dtype, seed, (0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1000))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_float16_and_bfloat16_value_and_float_payloads(dtype: str) -> None:
    """Every 16-bit pattern (all NaN payloads) and float32/64 NaN payloads, as XLA's convert rounds."""
    with jax.enable_x64(dtype == "float64"):
        np_dtype = _np_dtype(dtype)
        if np_dtype.itemsize == 2:
            values = np.arange(1 << 16, dtype=np.uint16).view(np_dtype)
        else:
            uint = UINT[np_dtype.itemsize]
            rng = np.random.default_rng(5)
            values = rng.integers(0, np.iinfo(uint).max, 1 << 16, dtype=uint, endpoint=True).view(np_dtype)
            values[:16] = _specials(np_dtype)[:16].repeat(2)[:16]
        leaves = [jnp.asarray(values)]
        for inv in (1.0, 0.5, 2.0, 1 / 3, 2.0**-24, 2.0**24):
            _assert_same(_fused_jit()(leaves, jnp.float32(inv)), _xla_jit(leaves, jnp.float32(inv)))


def test_one_call_over_mixed_dtypes_and_more_than_one_group(monkeypatch) -> None:
    monkeypatch.setattr(_jax_custom_call, "GROUP", 8)  # the grouping, without hundreds of leaves
    rng = np.random.default_rng(1)
    leaves = []
    for i in range(2 * _jax_custom_call.GROUP + 5):
        name = ("float16", "bfloat16", "float32")[i % 3]
        leaves.append(jnp.asarray(rng.standard_normal(int(rng.integers(0, 40))).astype(_np_dtype(name))))
    leaves.append(jnp.asarray(np.ones(3, dtype=ml_dtypes.float8_e4m3fn)))  # not in the call: XLA path
    fused = _fused_jit()
    text = fused.lower(leaves, jnp.float32(1)).as_text()
    assert text.count(f"@{TARGET}(") == 3  # groups of at most GROUP leaves
    _assert_same(fused(leaves, jnp.float32(0.25)), _xla_jit(leaves, jnp.float32(0.25)))
    sized = [i for i, x in enumerate(leaves) if x.size]
    for poisoned in (sized[0], sized[len(sized) // 2], sized[-2], sized[-1]):
        bad = list(leaves)
        bad[poisoned] = bad[poisoned].at[-1].set(jnp.nan)
        out = fused(bad, jnp.float32(0.25))
        assert not bool(out[1])
        _assert_same(out, _xla_jit(bad, jnp.float32(0.25)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_thread_boundaries_and_denormals_flushed_as_xla_does(dtype: str) -> None:
    """Above the parallel threshold XLA's pool threads run pieces under the caller's FTZ/DAZ."""
    np_dtype = _np_dtype(dtype)
    n = 1 << 20  # two leaves, 2^21 elements: split across the pool's threads
    tiny = np.array([1], dtype=UINT[np_dtype.itemsize]).view(np_dtype)[0]  # smallest denormal
    leaves = [jnp.full((n,), tiny, np_dtype), jnp.full((n,), tiny, np_dtype)]
    inv = jnp.float32(2.0**10)  # a normal product, unless the input is flushed to zero first
    fused = _fused_jit()
    _assert_same(fused(leaves, inv), _xla_jit(leaves, inv))
    total = 2 * n
    for position in (0, total // 2 - 1, total // 2, total // 2 + 1, total - 1, n // 2 + 3):
        leaf, index = divmod(position, n)
        bad = list(leaves)
        bad[leaf] = bad[leaf].at[index].set(jnp.inf)
        out = fused(bad, jnp.float32(0.5))
        assert not bool(out[1]), position
        _assert_same(out, _xla_jit(bad, jnp.float32(0.5)))


def test_a_scale_below_one_flags_values_that_overflow_when_unscaled() -> None:
    leaves = [jnp.asarray(np.array([60000.0, 1.0], np.float16)), jnp.ones(5, jnp.bfloat16)]
    out = _fused_jit()(leaves, jnp.float32(2.0))
    assert not bool(out[1])
    _assert_same(out, _xla_jit(leaves, jnp.float32(2.0)))
    big = [jnp.full((1 << 20,), 40000.0, jnp.float16)]  # threaded, overflowing everywhere
    assert not bool(_fused_jit()(big, jnp.float32(2.0))[1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_bit_for_bit_jmp_unscale(dtype: str) -> None:
    jmp = pytest.importorskip("jmp")
    leaves = {"w": jnp.asarray(_leaves(dtype, 7, (300,))[0]), "b": jnp.asarray(_leaves(dtype, 8, (17,))[0])}
    for scale in (2.0**15, 3.0, 1.0, 0.5):
        loss_scale = jmp.DynamicLossScale(jnp.float32(scale))
        # jmp promotes 16-bit leaves to float32: its values, in the leaf's dtype, are the reference
        theirs = jax.tree_util.tree_map(lambda x, ref: x.astype(ref.dtype), loss_scale.unscale(leaves), leaves)
        scaler = ampscale.create_scaler(backend="jax", init_scale=scale)
        ours, finite = jax.jit(lambda s, g: s.unscale(g))(scaler, leaves)
        assert bool(finite) == bool(jmp.all_finite(theirs))
        for key in leaves:
            np.testing.assert_array_equal(_bits(ours[key]), _bits(theirs[key]))


def test_float64_against_jmp_with_x64() -> None:
    jmp = pytest.importorskip("jmp")
    with jax.enable_x64(True):
        leaves = [jnp.asarray(_leaves("float64", 3, (100,))[0])]
        loss_scale = jmp.DynamicLossScale(jnp.float32(1024.0))
        scaler = ampscale.create_scaler(backend="jax", init_scale=1024.0)
        ours, finite = jax.jit(lambda s, g: s.unscale(g))(scaler, leaves)
        theirs = loss_scale.unscale(leaves)
        assert bool(finite) == bool(jmp.all_finite(theirs))
        np.testing.assert_array_equal(_bits(ours[0]), _bits(theirs[0]))


def _scaled_step(scaler, grads):
    grads, finite = scaler.unscale(grads)
    return grads, finite, scaler.update(finite)


def test_the_backend_uses_it_under_jit_with_and_without_donation() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=4.0)
    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4, jnp.float16), "c": jnp.ones((), jnp.bfloat16)}
    plain = jax.jit(_scaled_step)
    assert TARGET in plain.lower(scaler, grads).as_text()
    kept = jax.tree_util.tree_map(jnp.copy, grads)
    out, finite, _ = plain(scaler, grads)
    assert bool(finite)
    for key in grads:  # not donated: the inputs are untouched (XLA copies, then unscales in place)
        np.testing.assert_array_equal(_bits(grads[key]), _bits(kept[key]))
    donated = jax.jit(_scaled_step, donate_argnums=1)
    out2, _, _ = donated(scaler, jax.tree_util.tree_map(jnp.copy, grads))
    with _jax_custom_call.use_custom_call(False):
        reference, _, _ = jax.jit(_scaled_step)(scaler, grads)
    for key in grads:
        np.testing.assert_array_equal(_bits(out[key]), _bits(reference[key]))
        np.testing.assert_array_equal(_bits(out2[key]), _bits(reference[key]))


def test_donated_buffers_are_unscaled_in_place() -> None:
    grads = [jnp.ones(1000) * 8, jnp.ones(70, jnp.float16) * 8]
    pointers = [g.unsafe_buffer_pointer() for g in grads]
    out, finite = _fused_jit(donate=True)(grads, jnp.float32(0.125))
    assert bool(finite)
    assert [o.unsafe_buffer_pointer() for o in out] == pointers
    assert all(bool(jnp.all(o == 1)) for o in out)


def test_eager_calls_and_turning_it_off_give_the_same_bits() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10)
    grads = [jnp.asarray(x) for x in _leaves("float16", 11, (50, 3))]
    on = scaler.unscale(grads)
    with _jax_custom_call.use_custom_call(False):
        assert not jax_backend.custom_call_status().enabled
        assert _jax_custom_call.check_and_unscale(grads, jnp.float32(1)) is None
        off = scaler.unscale(grads)
        text = jax.jit(lambda g: scaler.unscale(g)).lower(grads).as_text()
        assert TARGET not in text
    _assert_same(on, off)
    with pytest.raises(TypeError, match="enabled must be a bool"), _jax_custom_call.use_custom_call("no"):  # type: ignore[arg-type]
        pass
    assert _jax_custom_call.enabled()


def test_scan_vmap_grad_and_transfer_guard() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0, growth_interval=1)

    def body(carry, poison):
        scaler, g = carry
        g = jnp.where(poison, jnp.inf, g)
        (g,), finite, scaler = _scaled_step(scaler, [g])
        return (scaler, g), finite  # carried as is: no arithmetic on it, so the custom call runs

    poison = jnp.array([False, False, True, False])
    scan = jax.jit(lambda s, g: jax.lax.scan(body, (s, g), poison))
    assert TARGET in scan.lower(scaler, jnp.ones(5)).as_text()
    start = jnp.ones(5)
    with jax.transfer_guard("disallow"):  # traced and run without a host transfer
        (final, _), finites = scan(scaler, start)
    with _jax_custom_call.use_custom_call(False):
        (final_x, _), finites_x = jax.jit(lambda s, g: jax.lax.scan(body, (s, g), poison))(scaler, jnp.ones(5))
    # the inf stays in the carried gradient after the third step
    assert np.asarray(finites).tolist() == np.asarray(finites_x).tolist() == [True, True, False, False]
    assert final.get_scale() == final_x.get_scale()

    batched = jnp.ones((3, 4)).at[1, 2].set(jnp.nan)
    vmapped = jax.jit(jax.vmap(lambda g: scaler.unscale([g])))
    (out,), finite = vmapped(batched)
    with _jax_custom_call.use_custom_call(False):
        (out_x,), finite_x = jax.jit(jax.vmap(lambda g: scaler.unscale([g])))(batched)
    assert np.asarray(finite).tolist() == np.asarray(finite_x).tolist() == [True, False, True]
    np.testing.assert_array_equal(_bits(out), _bits(out_x))

    grad = jax.grad(lambda x: jnp.sum(scaler.unscale([x * x])[0][0]))(jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(grad), np.arange(3.0))  # d/dx sum(x^2 / 2) = x


def _four_devices() -> list:
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported")
    return devices[:4]


def test_shard_map_runs_it_per_shard_and_sharded_jit_uses_the_xla_path() -> None:
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(_four_devices()), ("data",))
    scaler = ampscale.create_scaler(backend="jax", axis_name="data", init_scale=4.0)
    grads = jnp.asarray(_leaves("float32", 2, (64,))[0]).reshape(4, 16)
    grads = jnp.where(jnp.isfinite(grads), grads, 0).at[2, 5].set(jnp.inf)  # one shard overflows
    shared = jnp.full((3,), 8.0, jnp.bfloat16)  # replicated: keeps its replicated type

    def per_shard(scaler, g, w):
        (g, w), finite = scaler.unscale((g, w))
        return g, w, finite[None]

    fn = jax.jit(
        shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec()),
            out_specs=(PartitionSpec("data"), PartitionSpec(), PartitionSpec("data")),
        )
    )
    assert TARGET in fn.lower(scaler, grads, shared).as_text()
    assert jax_backend.custom_call_status().last_lowering == "custom call"
    g, w, finites = fn(scaler, grads, shared)
    assert np.asarray(finites).tolist() == [False] * 4  # pmin over the axis: every shard agrees
    with _jax_custom_call.use_custom_call(False):
        g_x, w_x, _ = jax.jit(
            shard_map(
                per_shard,
                mesh=mesh,
                in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec()),
                out_specs=(PartitionSpec("data"), PartitionSpec(), PartitionSpec("data")),
            )
        )(scaler, grads, shared)
    np.testing.assert_array_equal(_bits(g), _bits(g_x))
    np.testing.assert_array_equal(_bits(w), _bits(w_x))

    sharding = NamedSharding(mesh, PartitionSpec("data"))
    sharded = jax.device_put(grads, sharding)
    plain = ampscale.create_scaler(backend="jax", init_scale=4.0)
    step = jax.jit(lambda s, g: s.unscale(g))
    assert TARGET not in step.lower(plain, sharded).compile().as_text()
    assert "automatic sharding over 4 devices" in jax_backend.custom_call_status().last_lowering
    out, finite = step(plain, sharded)
    assert not bool(finite)
    assert out.sharding.is_equivalent_to(sharding, out.ndim)
    np.testing.assert_array_equal(_bits(out), _bits(g_x))


def test_pmap_runs_it_per_device() -> None:
    devices = _four_devices()
    scaler = ampscale.create_scaler(backend="jax", axis_name="i", init_scale=2.0)
    grads = jnp.ones((4, 10)).at[3, 9].set(jnp.nan)
    out, finite = jax.pmap(lambda g: scaler.unscale([g], axis_name="i"), axis_name="i", devices=devices)(grads)
    assert np.asarray(finite).tolist() == [False] * 4
    np.testing.assert_array_equal(np.asarray(out[0])[:3], np.full((3, 10), 0.5, np.float32))


def test_jax_export_is_portable_by_default_and_can_keep_the_call() -> None:
    from jax import export

    grads = [jnp.arange(4.0), jnp.ones(3, jnp.float16)]
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0)

    def fn():  # a new function each time: jit caches lowerings, and the setting is not in the key
        return jax.jit(lambda g: scaler.unscale(g))

    portable = export.export(fn())(grads)
    assert TARGET not in portable.mlir_module()
    assert "jax.export" in jax_backend.custom_call_status().last_lowering
    with pytest.raises(ValueError, match="custom call"), _jax_custom_call.use_custom_call(in_exports=True):
        export.export(fn())(grads)  # jax refuses custom calls without compatibility guarantees
    with _jax_custom_call.use_custom_call(in_exports=True):
        kept = export.export(fn(), disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET)])(grads)
    assert TARGET in kept.mlir_module()
    _assert_same(kept.call(grads), portable.call(grads))
    pytest.importorskip("flatbuffers")
    script = textwrap.dedent(
        """
        import sys, jax, jax.numpy as jnp
        from jax import export
        exported = export.deserialize(bytes.fromhex(sys.stdin.read()))
        grads = [jnp.arange(4.0), jnp.ones(3, jnp.float16)]
        try:
            exported.call(grads)
            print("ran unregistered")
        except Exception as exc:
            print("unregistered:", type(exc).__name__)
        import ampscale.backends.jax as backend
        assert backend.register_custom_call().available
        out, finite = exported.call(grads)
        print("registered:", [x.tolist() for x in out], bool(finite))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        input=kept.serialize().hex(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "XLA_FLAGS": ""},
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("unregistered:"), run.stdout
    assert lines[1] == "registered: [[0.0, 0.5, 1.0, 1.5], [0.5, 0.5, 0.5]] True"


def test_lazy_build_into_a_fresh_cache(tmp_path, monkeypatch) -> None:
    """What a user who installed jax after ampscale gets: a compile into the cache, then reuse
    (the damaged, planted and shared cases are in tests/test_caches.py)."""
    headers = _ffi_build.jaxlib_headers()
    compiler = _ffi_build.find_compiler()
    if headers is None or compiler is None:
        pytest.skip("needs jaxlib's headers and a C++ compiler")
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    key = _ffi_build.build_key(headers[1])
    path = _ffi_build.cached_library(key, compiler)
    assert path.startswith(str(tmp_path))
    with _ffi_build.cached_handler(key, headers[0], compiler) as entry:
        assert entry.path == path
        library, why = _jax_custom_call._open(entry, key)
    assert library is not None, why
    with _ffi_build.cached_handler(key, headers[0], compiler) as entry:  # reused, not compiled again
        stale, why = _jax_custom_call._open(entry, key + "-other")
    assert stale is None
    assert "other sources or for another jaxlib" in why
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "cpu").mkdir()
    (broken / "cpu" / "kernels.h").write_text("#error broken\n")
    (broken / "cpu" / "jax_ffi.cc").write_text('#include "kernels.h"\n')
    with pytest.raises(RuntimeError, match="broken"):
        _ffi_build.compile_library(str(tmp_path / "x.so"), headers[0], key, compiler, str(broken))
    assert not (tmp_path / "x.so").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_bad_setting_is_named(monkeypatch) -> None:
    monkeypatch.setenv("AMPSCALE_JAX_CUSTOM_CALL", "maybe")
    with pytest.raises(ValueError, match="AMPSCALE_JAX_CUSTOM_CALL must be 1/on/true or 0/off/false; got 'maybe'"):
        jax_backend.custom_call_status()
    monkeypatch.setenv("AMPSCALE_JAX_CUSTOM_CALL", "off")
    assert not jax_backend.custom_call_status().enabled
    assert _jax_custom_call.check_and_unscale([jnp.ones(2)], jnp.float32(1)) is None


def test_info_and_doctor_show_it(capsys) -> None:
    from ampscale.__main__ import info

    assert info() == 0
    assert "\n  custom call: on (" in capsys.readouterr().out  # under the jax line
    assert ampscale.info(["jax"])["backends"]["jax"]["details"]["custom call"].startswith("on (")
    scaler = ampscale.create_scaler(backend="jax").update(True)
    assert ampscale.doctor(scaler).evidence["jax custom call"].startswith("on (")
    with _jax_custom_call.use_custom_call(False):
        assert ampscale.doctor(scaler).evidence["jax custom call"].startswith("off (pure-XLA path)")
    assert "jax custom call" not in ampscale.doctor(ampscale.create_scaler(backend="numpy").update(True)).evidence


# ------------------------------------------------------------------------------ where the results go


def _lowering(fn, *args) -> tuple[bool, str]:
    text = jax.jit(fn).lower(*args).as_text()
    return TARGET in text, str(jax_backend.custom_call_status().last_lowering)


def _sgd(p, g, s):
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), s


def test_the_custom_call_only_where_nothing_computes_with_its_results() -> None:
    """The custom call where the unscaled gradients are returned, carried by a loop, reduced
    across devices or passed to another call; the pure-XLA path (which XLA fuses into the
    arithmetic, as in a program without ampscale) where any of them feeds more arithmetic in
    the same computation, whatever the transformations between the two."""
    scaler = ampscale.create_scaler(backend="jax", init_scale=4.0)
    grads = {"a": jnp.ones(5), "b": jnp.ones((2, 3))}
    double = functools.partial(jax.tree_util.tree_map, lambda x: x * 2)

    def carried(s, g):
        def body(carry, _):
            s, g = carry
            g, finite = s.unscale(g)
            return (s.update(finite), g), finite

        return jax.lax.scan(body, (s, g), None, length=3)

    def doubled_in_the_loop(s, g):
        def body(carry, _):
            s, g = carry
            g, finite = s.unscale(g)
            return (s.update(finite), double(g)), finite

        return jax.lax.scan(body, (s, g), None, length=3)

    def while_loop(s, g, n):
        return jax.lax.fori_loop(0, n, lambda i, c: (c[0].update(c[0].unscale(c[1])[1]), c[1]), (s, g))

    uses_nothing = {
        "returned": lambda s, g: s.unscale(g),
        "picked by a where, then returned": lambda s, g: (
            lambda out, finite: jax.tree_util.tree_map(lambda x, y: jnp.where(finite, x, y), out, g)
        )(*s.unscale(g)),
        "carried by a scan": carried,
        "returned from a nested jit": lambda s, g: jax.jit(lambda s, g: s.unscale(g))(s, g),
        "passed through a cond": lambda s, g: jax.lax.cond(True, lambda g: g, lambda g: g, s.unscale(g)[0]),
        "under remat": lambda s, g: jax.checkpoint(lambda g: s.unscale(g)[0])(g),
    }
    for name, fn in uses_nothing.items():
        used, why = _lowering(fn, scaler, grads)
        assert used, name
        assert why == "custom call", name
    used, why = _lowering(while_loop, scaler, grads, 3)
    assert used
    assert why == "custom call"

    computes = {
        "doubled": (lambda s, g: double(s.unscale(g)[0]), "mul"),
        "an SGD step through Scaler.step": (lambda s, g: s.step(_sgd, g, g, ())[0], "mul"),
        "doubled inside the loop that carries it": (doubled_in_the_loop, "mul"),
        "added to after a nested jit": (
            lambda s, g: jax.tree_util.tree_map(lambda x: x + 1, jax.jit(lambda s, g: s.unscale(g)[0])(s, g)),
            "add",
        ),
        "added to inside a cond": (
            lambda s, g: jax.lax.cond(True, lambda g: double(g), lambda g: g, s.unscale(g)[0]),
            "mul",
        ),
    }
    for name, (fn, primitive) in computes.items():
        used, why = _lowering(fn, scaler, grads)
        assert not used, name
        assert why.startswith("XLA path: its results feed further XLA arithmetic"), name
        assert f"({primitive})" in why, name
    # one leaf that feeds arithmetic is enough: its call takes the pure-XLA path
    used, why = _lowering(lambda s, g: (lambda out: (out["a"] * 2, out["b"]))(s.unscale(g)[0]), scaler, grads)
    assert not used
    # and the bits are the same either way
    for fn in (uses_nothing["returned"], computes["doubled"][0]):
        with _jax_custom_call.use_custom_call(False):
            off = jax.jit(fn)(scaler, grads)
        np.testing.assert_array_equal(
            np.concatenate([_bits(x).ravel() for x in jax.tree_util.tree_leaves(jax.jit(fn)(scaler, grads))]),
            np.concatenate([_bits(x).ravel() for x in jax.tree_util.tree_leaves(off)]),
        )


def test_a_lowering_that_cannot_be_inspected_takes_the_exact_path(monkeypatch) -> None:
    """Where the uses cannot be read (a JAX whose lowering is built otherwise), the pure-XLA
    path, which is exact, with one ``PerformanceWarning`` that says why."""
    monkeypatch.setattr(_jax_custom_call, "_enclosing_jaxprs", lambda: None)
    monkeypatch.setattr(_jax_custom_call, "_warned_frames", False)
    scaler = ampscale.create_scaler(backend="jax", init_scale=4.0)
    with pytest.warns(ampscale.PerformanceWarning, match="cannot be inspected"):
        used, why = _lowering(lambda s, g: s.unscale(g), scaler, [jnp.ones(3)])
    assert not used
    assert "unknown" in why
