"""The JAX custom call on a CUDA GPU: bit for bit the pure-XLA path there, wherever it runs.

Run by ``scripts/gpu-check.sh`` with JAX on the GPU. Every comparison is of raw bits (NaN
payloads, signed zeros and denormals included) between the CUDA handler (ampscale's kernel,
launched by XLA through ``jax_ffi_cuda.cc``) and the pure-XLA path compiled by XLA:GPU, on
every dtype, with inf/nan at the first and last elements, at chunk boundaries and in the last
buffer of a launch, under jit, scan, vmap, shard_map, with and without donation, and across
more buffers than one call and one launch take. On a GPU machine the kernels must load: a
missing driver or NVRTC fails here rather than skipping.

Each test also runs as ``cpu-stand-in`` where JAX has no GPU: the same test against the CPU
custom call (the same lowering rule, target and grouping; the native CPU kernels behind it),
so that the tests themselves are known to be right before the GPU run. Where a test is one of
``tests/test_jax_ffi.py``'s, run there on the CPU already, or needs the GPU itself (launches
counted by torch's CUDA profiler), the stand-in skips it and says so. The CUDA handler's own host
logic, with its kernels built for the host, is ``tests/test_jax_cuda.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("ml_dtypes")

import ampscale  # noqa: E402
from ampscale._native.cuda import _jax  # noqa: E402
from ampscale.backends import _jax_custom_call  # noqa: E402
from ampscale.backends import jax as jax_backend  # noqa: E402
from tests.test_jax_ffi import (  # noqa: E402
    DTYPES,
    _assert_same,
    _bits,
    _fused_jit,
    _np_dtype,
    _scaled_step,
    _xla_jit,
    check_against_the_xla_path,
)
from tests.test_jax_ffi import (  # noqa: E402
    test_every_float16_and_bfloat16_value_and_float_payloads as every_16_bit_value_and_float_payloads,
)
from tests.test_jax_ffi import test_scan_vmap_grad_and_transfer_guard as scan_vmap_grad_and_transfer_guard  # noqa: E402

TARGET = _jax_custom_call.TARGET


def _jax_on_a_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:  # pragma: no cover
        return False


ON_GPU = _jax_on_a_gpu()


@pytest.fixture(
    scope="module",
    autouse=True,
    params=[pytest.param("gpu", marks=pytest.mark.gpu), "cpu-stand-in"],
)
def platform(request: pytest.FixtureRequest) -> str:
    """``gpu``: JAX on a GPU, the CUDA handler; ``cpu-stand-in``: JAX on the CPU, its handler."""
    status = jax_backend.custom_call_status()
    if request.param == "gpu":
        if not ON_GPU:
            pytest.skip("JAX has no GPU here")
        assert status.available, status.reason
        assert status.cuda_available, status.cuda_reason  # a GPU machine must run the fast path
        assert "CUDA: on (NVRTC " in str(status)
    else:
        if ON_GPU:
            pytest.skip("JAX runs on the GPU here: the gpu variant runs instead")
        if not status.available:
            pytest.skip(f"the CPU custom call is not available: {status.reason}")
    return str(request.param)


def _same_on_the_cpu(platform: str, where: str) -> None:
    """Skip the stand-in of a test that is ``tests/test_jax_ffi.py``'s own, run there on the CPU."""
    if platform == "cpu-stand-in":
        pytest.skip(f"on the CPU this is tests/test_jax_ffi.py::{where}")


def _lowering(platform: str) -> str:
    return "custom call (CUDA)" if platform == "gpu" else "custom call"


def test_the_custom_call_is_lowered_for_cuda(platform: str) -> None:
    leaves = [jnp.ones(5), jnp.ones(3, jnp.bfloat16)]
    assert f"custom_call @{TARGET}(" in _fused_jit().lower(leaves, jnp.float32(1)).as_text()
    assert jax_backend.custom_call_status().last_lowering == _lowering(platform)


CHUNK = _jax.CHUNK
SIZES = (0, 1, 7, 15, 16, 17, 33, 127, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(2))
def test_bit_for_bit_the_xla_path_on_every_dtype(platform: str, dtype: str, seed: int) -> None:
    """Specials at the first, the last and random elements of leaves around the chunk sizes."""
    check_against_the_xla_path(dtype, seed, SIZES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_16_bit_value_and_float_payloads(platform: str, dtype: str) -> None:
    """``tests/test_jax_ffi.py``'s, with JAX on the GPU: every float16/bfloat16 pattern (every NaN
    payload) and float32/64 NaN payloads, as XLA:GPU rounds and stores them (bfloat16 by the
    device's cvt, NaNs as its multiply makes them)."""
    _same_on_the_cpu(platform, "test_every_float16_and_bfloat16_value_and_float_payloads")
    every_16_bit_value_and_float_payloads(dtype)


@pytest.mark.parametrize("group", [_jax_custom_call.GROUP, 3 * _jax.LEAVES + 7])
def test_more_buffers_than_a_call_and_a_launch_take(platform: str, monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    """With the default group, 400 mixed-dtype leaves make 4 calls; with a group of 391, one call
    makes 4 launches of at most 128 buffers. An inf anywhere (first, a launch's last, the very
    last) clears the one flag; values stay bit for bit XLA's."""
    monkeypatch.setattr(_jax_custom_call, "GROUP", group)
    rng = np.random.default_rng(1)
    leaves = []
    for i in range(400):
        name = ("float16", "bfloat16", "float32")[i % 3]
        leaves.append(jnp.asarray((rng.standard_normal(int(rng.integers(0, 300))) * 50).astype(_np_dtype(name))))
    fused = _fused_jit()
    text = fused.lower(leaves, jnp.float32(1)).as_text()
    assert text.count(f"@{TARGET}(") == -(-400 // group)
    _assert_same(fused(leaves, jnp.float32(0.25)), _xla_jit(leaves, jnp.float32(0.25)))
    sized = [i for i, x in enumerate(leaves) if x.size]
    for poisoned in (sized[0], sized[_jax.LEAVES - 1], sized[_jax.LEAVES], sized[-1]):
        bad = list(leaves)
        bad[poisoned] = bad[poisoned].at[-1].set(jnp.inf)
        out = fused(bad, jnp.float32(0.25))
        assert not bool(out[1]), poisoned
        _assert_same(out, _xla_jit(bad, jnp.float32(0.25)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_bad_value_in_any_block(platform: str, dtype: str) -> None:
    """Four chunks (blocks) in one buffer: an inf or nan at each block's edges is seen."""
    size = 4 * CHUNK + 3
    base = jnp.asarray(np.linspace(-8, 8, size).astype(_np_dtype(dtype)))
    fused = _fused_jit()
    assert bool(fused([base], jnp.float32(0.5))[1])
    for position in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 1, 3 * CHUNK, size - 1):
        for bad in (jnp.inf, -jnp.inf, jnp.nan):
            leaves = [base.at[position].set(bad)]
            out = fused(leaves, jnp.float32(0.5))
            assert not bool(out[1]), (position, bad)
            _assert_same(out, _xla_jit(leaves, jnp.float32(0.5)))


def test_donated_buffers_are_unscaled_in_place_and_others_copied(platform: str) -> None:
    grads = [jnp.ones(1000) * 8, jnp.ones(70, jnp.float16) * 8, jnp.ones(3 * CHUNK, jnp.bfloat16) * 8]
    pointers = [g.unsafe_buffer_pointer() for g in grads]
    out, finite = _fused_jit(donate=True)(grads, jnp.float32(0.125))
    assert bool(finite)
    assert [o.unsafe_buffer_pointer() for o in out] == pointers
    assert all(bool(jnp.all(o == 1)) for o in out)
    kept = [jnp.full((10,), 4.0), jnp.full((5,), 4.0, jnp.bfloat16)]
    out, finite = _fused_jit()(kept, jnp.float32(0.5))
    assert bool(finite)
    assert all(bool(jnp.all(k == 4)) for k in kept)  # not donated: the inputs are untouched
    assert all(bool(jnp.all(o == 2)) for o in out)


def test_scan_vmap_grad_and_transfer_guard(platform: str) -> None:
    """``tests/test_jax_ffi.py``'s, with JAX on the GPU: the scanned step lowers to the CUDA call
    (its text is checked there), runs under ``transfer_guard("disallow")``, and agrees with the
    pure-XLA path; ``vmap`` and ``grad`` take the pure-XLA path."""
    _same_on_the_cpu(platform, "test_scan_vmap_grad_and_transfer_guard")
    scan_vmap_grad_and_transfer_guard()


def test_shard_map_runs_it_on_each_gpu(platform: str) -> None:
    from jax import shard_map
    from jax.sharding import Mesh, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    n = len(devices)
    scaler = ampscale.create_scaler(backend="jax", axis_name="data", init_scale=4.0)
    grads = jnp.ones((n, 16)).at[n - 1, 5].set(jnp.inf)  # the last shard overflows

    def per_shard(scaler, g):
        (g,), finite = scaler.unscale([g])
        return g, finite[None]

    fn = jax.jit(
        shard_map(
            per_shard, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("data")), out_specs=PartitionSpec("data")
        )
    )
    assert TARGET in fn.lower(scaler, grads).as_text()
    assert jax_backend.custom_call_status().last_lowering == _lowering(platform)
    g, finites = fn(scaler, grads)
    assert np.asarray(finites).tolist() == [False] * n
    np.testing.assert_array_equal(np.asarray(g)[0, :5], np.full(5, 0.25, np.float32))


def test_the_step_matches_the_xla_step_over_a_training_run(platform: str) -> None:
    """Whole jitted steps (unscale + update) with overflows: states and gradients as the XLA path's."""
    rng = np.random.default_rng(4)
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**12, growth_interval=3)
    step = jax.jit(_scaled_step)
    step_x = jax.jit(lambda s, g: _scaled_step(s, g))  # another function: traced (below) with the XLA path
    ours, theirs = scaler, scaler
    for i in range(12):
        grads = {
            "w": jnp.asarray(rng.standard_normal((300, 70)).astype(np.float32) * 2.0**12),
            "b": jnp.asarray((rng.standard_normal(70) * 2.0**12).astype(_np_dtype("bfloat16"))),
        }
        if i % 4 == 2:
            grads["w"] = grads["w"].at[299, 69].set(jnp.nan)
        g, finite, ours = step(ours, grads)
        with _jax_custom_call.use_custom_call(False):
            g_x, finite_x, theirs = step_x(theirs, grads)
        assert bool(finite) == bool(finite_x) == (i % 4 != 2)
        for key in grads:
            np.testing.assert_array_equal(_bits(g[key]), _bits(g_x[key]))
        assert ours.state_dict() == theirs.state_dict()


def test_two_kernel_launches_per_call(platform: str) -> None:
    """One call: the flag's launch and one launch over up to 128 buffers; no copy when donated."""
    if platform == "cpu-stand-in":
        pytest.skip("launches are the GPU's (counted by torch's CUDA profiler); the CPU call launches nothing")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch's profiler counts the launches: no torch CUDA here")
    from torch.profiler import ProfilerActivity, profile

    grads = [jnp.ones(n) for n in (1024, 70_000, 3)]
    inv = jax.device_put(jnp.float32(1))  # on the device before counting (a new scalar is a copy)
    fused = _fused_jit(donate=True)
    grads, _ = fused(grads, inv)  # compile
    jax.block_until_ready(grads)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            grads, _ = fused(grads, inv)
        jax.block_until_ready(grads)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum(name == "ampscale_jax_begin" for name in names) == 5, names
    assert sum(name == "ampscale_jax_unscale" for name in names) == 5, names
    assert not [name for name in names if "memcpy" in name.lower()], names
