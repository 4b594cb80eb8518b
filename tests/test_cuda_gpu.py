"""The one-launch CUDA step on a GPU (CuPy and torch): run by scripts/gpu-check.sh.

* the emitted transition on the device against the host transition, bit for bit, over many
  configurations and edge states;
* gradients bit for bit against ``torch.amp.GradScaler``, and bfloat16 through ampscale's kernel;
* the last-block pattern under stress: many chunks, one inf in a random block, two scalers on
  two streams;
* kernel launches per step counted by the profiler (CuPy 1, torch 2), and no host sync
  (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale
from ampscale._codegen import state_dtype
from ampscale._core import ScalerState
from ampscale._native.cuda._packed import PackedState, decode
from ampscale._ops import HostOps
from tests.test_codegen import draw_configs, edge_states

pytestmark = pytest.mark.gpu


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _cupy_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


needs_torch = pytest.mark.skipif(not _torch_cuda(), reason="no torch CUDA device")
needs_cupy = pytest.mark.skipif(not _cupy_gpu(), reason="no CuPy GPU")
FRAMEWORKS = [pytest.param("torch", marks=needs_torch), pytest.param("cupy", marks=needs_cupy)]


class Device:
    """One framework's GPU: its backend, arrays and flags."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "torch":
            import torch

            from ampscale.backends.torch import BACKEND

            self.backend, self.torch = BACKEND, torch
            self.like = torch.zeros((), device="cuda")
        else:
            import cupy

            from ampscale.backends.cupy import BACKEND

            self.backend, self.cupy = BACKEND, cupy
            self.like = cupy.zeros(())

    def flag(self, value: bool):
        if self.name == "torch":
            return self.torch.tensor(value, device="cuda")
        return self.cupy.asarray(value)

    def array(self, values: np.ndarray):
        if self.name == "torch":
            return self.torch.from_numpy(values).cuda()
        return self.cupy.asarray(values)

    def numpy(self, x) -> np.ndarray:
        return x.cpu().numpy() if self.name == "torch" else self.cupy.asnumpy(x)


def values_of(record: np.void, scale_dtype: str) -> ScalerState:
    return decode(np.frombuffer(record.tobytes(), np.uint8), scale_dtype)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_device_transition_equals_the_host_transition(framework: str, data: st.DataObject, seed: int) -> None:
    """``ampscale_update`` (the emitted C on the GPU) against ``HostOps.run``: every preset x mode,
    drawn settings, edge states, all four flag combinations; every field, the next inverse scale
    and the floor event, bit for bit."""
    device = Device(framework)
    rng = np.random.default_rng(seed)
    flags = {value: device.flag(value) for value in (False, True)}
    for config in draw_configs(data, per_case=1):
        ops = HostOps(config)
        bits = np.uint64 if config.scale_dtype == "float64" else np.uint32
        for record in edge_states(config, rng, 16):
            values = values_of(record, config.scale_dtype)
            state = device.backend.make_state(values, config, device.like)
            assert isinstance(state, PackedState), "the fast path did not load (see the PerformanceWarning)"
            for finite, loss_ok in ((True, True), (False, True), (False, False), (True, False)):
                nxt, _, event = device.backend.run_transition(config, state, flags[finite], flags[loss_ok], None)
                got = device.numpy(nxt.buffer).view(np.uint8).view(state_dtype(config.scale_dtype))[0]
                want, want_event = ops.run(values, finite and loss_ok, loss_ok)
                assert values_of(got, config.scale_dtype) == want, (config, values, finite, loss_ok)
                scale = np.asarray(want.scale, config.scale_dtype)
                assert np.asarray(got["scale"]).view(bits) == scale.view(bits)
                with np.errstate(divide="ignore", over="ignore"):
                    inverse = np.float32(1.0 / np.float64(want.scale))
                assert np.asarray(got["inv_scale"]).view(np.uint32) == inverse.view(np.uint32)
                assert bool(got["floor_event"]) is bool(want_event)
                assert bool(device.numpy(event)) is bool(want_event)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fused_steps_follow_the_host_trajectory(framework: str) -> None:
    """Whole steps (check + unscale + update in one launch) with infs in the gradients or the
    loss: the same states as the host scaler, and the gradients as NumPy unscales them."""
    device = Device(framework)
    rng = np.random.default_rng(5)
    for preset in sorted(ampscale.PRESETS):
        extra = {"on_floor": "ignore"} if preset == "deepspeed" else {}
        gpu = ampscale.create_scaler(backend=framework, preset=preset, growth_interval=3, **extra)
        host = ampscale.create_scaler(backend="numpy", preset=preset, growth_interval=3, **extra)
        for step in range(40):
            grads = [rng.standard_normal(n).astype(np.float32) * 1000 for n in (1000, 70_000, 3)]
            loss = np.float32(rng.standard_normal())
            if step % 5 == 1:
                grads[1][rng.integers(70_000)] = np.inf
            if step % 7 == 3:
                loss = np.float32(np.nan)
            mine = [device.array(g.copy()) for g in grads]
            out, finite = gpu.unscale(mine, loss=device.array(np.asarray(loss)))
            ref, ref_finite = host.unscale([g.copy() for g in grads], loss=np.asarray(loss))
            assert bool(device.numpy(finite)) is bool(ref_finite)
            if bool(ref_finite):
                for a, b in zip(out, ref, strict=True):
                    np.testing.assert_array_equal(device.numpy(a), b)
            gpu = gpu.update(finite)
            host = host.update(ref_finite)
            assert gpu.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"], (preset, step)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_step_then_update_uses_the_precomputed_state(framework: str) -> None:
    """``update`` given the very flag ``unscale`` returned adds no launch and gives the state
    the host computes; given another flag it launches the one-thread update."""
    device = Device(framework)
    scaler = ampscale.create_scaler(backend=framework, growth_interval=2, init_scale=2.0**10)
    host = ampscale.create_scaler(backend="numpy", growth_interval=2, init_scale=2.0**10)
    for bad in (False, False, True, False, False, False):
        g = np.full(300, 2.0**10, np.float32)
        if bad:
            g[7] = np.nan
        _, finite = scaler.unscale([device.array(g)])
        state = scaler._state
        nxt = scaler.update(finite)
        assert nxt._state is state.pending[2]
        other = scaler.update(device.flag(not bad))  # an equal flag, another object: one update launch
        assert other._state is not state.pending[2]
        assert other.state_dict() == nxt.state_dict()
        host = host.update(not bad)
        assert nxt.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"]
        scaler = nxt


def _float16_grad_scaler() -> type:
    import torch

    class Float16GradScaler(torch.amp.GradScaler):
        """torch's GradScaler with its own kernel allowed on float16 gradients (``unscale_`` refuses
        them, but ``_unscale_grads_`` takes ``allow_fp16``): the reference for float16 bits."""

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[no-untyped-def]
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    return Float16GradScaler


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gradients_bit_for_bit_against_grad_scaler(dtype: str) -> None:
    import torch

    import ampscale.torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    if dtype == "float16":
        model = model.half()
    twin = copy.deepcopy(model)
    view = torch.int16 if dtype == "float16" else torch.int32
    ours = ampscale.torch.GradScaler("cuda", init_scale=2.0**14, growth_interval=3)
    theirs = _float16_grad_scaler()("cuda", init_scale=2.0**14, growth_interval=3)
    opt_a = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(twin.parameters(), lr=1e-3)
    for step in range(30):
        x = torch.randn(32, 64, device="cuda", dtype=model[0].weight.dtype)
        if step % 6 == 2:
            x[0, 0] = float("inf")
        for m, opt, scaler in ((model, opt_a, ours), (twin, opt_b, theirs)):
            opt.zero_grad()
            loss = m(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(pa.grad.view(view), pb.grad.view(view))  # bit for bit, inf and nan too
        for opt, scaler in ((opt_a, ours), (opt_b, theirs)):
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale(), step


@needs_torch
def test_bfloat16_on_cuda_in_one_pass_of_ampscales_kernel() -> None:
    import torch

    rng = np.random.default_rng(2)
    values = [rng.standard_normal(n).astype(np.float32) * 512 for n in (5, 70_000, 131_073)]
    grads = [torch.from_numpy(v).to(torch.bfloat16).cuda() for v in values]
    expected = [(g.float().cpu() * np.float32(1 / 256.0)).to(torch.bfloat16) for g in grads]
    scaler = ampscale.create_scaler(backend="torch", init_scale=256.0)
    out, finite = scaler.unscale(grads)
    assert bool(finite)
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(a.cpu().view(torch.int16), e.view(torch.int16))
    grads[1][12345] = float("nan")
    assert not bool(scaler.unscale(grads)[1])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_last_block_stress(framework: str) -> None:
    """Thousands of chunks, one inf in a random block: the last block always sees it."""
    device = Device(framework)
    rng = np.random.default_rng(9)
    sizes = [65_536] * 600 + [3, 1, 70_001] * 300  # 1,500 arrays, over 1,200 chunks
    grads = [device.array(np.ones(n, np.float32)) for n in sizes]
    scaler = ampscale.create_scaler(backend=framework, init_scale=1.0, growth_interval=10**6)
    for trial in range(60):
        bad = trial % 3 != 0
        where = int(rng.integers(len(grads)))
        position = int(rng.integers(sizes[where]))
        if bad:
            grads[where][position] = float("inf")
        _, finite = scaler.unscale(grads)
        scaler = scaler.update(finite)
        assert bool(device.numpy(finite)) is not bad, (trial, where, position)
        if bad:
            grads[where][position] = 1.0
    assert scaler.get_stats()["skipped_steps"] == 40


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_two_scalers_on_two_streams(framework: str) -> None:
    device = Device(framework)
    if framework == "torch":
        streams = [device.torch.cuda.Stream(), device.torch.cuda.Stream()]
        use = device.torch.cuda.stream
        sync = device.torch.cuda.synchronize
    else:
        streams = [device.cupy.cuda.Stream(non_blocking=True), device.cupy.cuda.Stream(non_blocking=True)]

        def use(stream):
            return stream

        sync = device.cupy.cuda.Device().synchronize
    sync()
    scalers = [ampscale.create_scaler(backend=framework, growth_interval=2) for _ in streams]
    hosts = [ampscale.create_scaler(backend="numpy", growth_interval=2) for _ in streams]
    arrays = []
    for stream in streams:
        with use(stream):
            arrays.append([device.array(np.ones(n, np.float32)) for n in [65_536] * 200])
    for step in range(20):
        for k, stream in enumerate(streams):
            with use(stream):
                bad = (step + k) % 4 == 0
                if bad:
                    arrays[k][step % 200][5] = float("nan")
                _, finite = scalers[k].unscale(arrays[k])
                scalers[k] = scalers[k].update(finite)
                hosts[k] = hosts[k].update(not bad)
                if bad:
                    arrays[k][step % 200][5] = 1.0
    sync()
    for scaler, host in zip(scalers, hosts, strict=True):
        assert scaler.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"]


def _count_launches(fn) -> dict[str, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts = {"kernel": 0, "memcpy": 0, "memset": 0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name else "memset" if "memset" in name else "kernel"
        counts[kind] += 1
    return counts


@needs_torch
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_launches_per_step(framework: str) -> None:
    """CuPy: one launch per step, loss or not. torch: two (its fused kernel, then the update or
    ampscale's kernel for the loss), one for bfloat16 alone. Nothing is copied."""
    device = Device(framework)
    grads = [device.array(np.ones(n, np.float32)) for n in (1024, 70_000, 3)]
    loss = device.array(np.asarray(2.0, np.float32))
    scaler = ampscale.create_scaler(backend=framework)

    def step(with_loss: bool):
        def run(times: int = 5):
            nonlocal scaler
            for _ in range(times):
                if with_loss:  # step() hands the loss flag to the update: nothing left to launch
                    _, _, scaler = scaler.step(lambda p, g, s: (p, s), [], grads, (), loss=loss)
                else:
                    _, finite = scaler.unscale(grads)
                    scaler = scaler.update(finite)

        return run

    step(False)(2)  # warm up: compile, load, chunk tables
    step(True)(2)

    expected = 1 if framework == "cupy" else 2
    for with_loss in (False, True):
        counts = _count_launches(step(with_loss))
        assert counts == {"kernel": 5 * expected, "memcpy": 0, "memset": 0}, (with_loss, counts)
    if framework == "torch":
        import torch

        bf16 = [g.to(torch.bfloat16) for g in grads]
        scaler = scaler.update(scaler.unscale(bf16)[1])

        def run_bf16():
            nonlocal scaler
            for _ in range(5):
                scaler = scaler.update(scaler.unscale(bf16)[1])

        assert _count_launches(run_bf16) == {"kernel": 5, "memcpy": 0, "memset": 0}


@needs_torch
def test_torch_step_never_syncs() -> None:
    import torch

    grads = [torch.ones(n, device="cuda") for n in (1024, 70_000)]
    params = [torch.zeros_like(g) for g in grads]
    scaler = ampscale.create_scaler(backend="torch", growth_interval=2)
    loss = torch.full((), 3.0, device="cuda")
    true = torch.ones((), dtype=torch.bool, device="cuda")
    for _ in range(2):  # warm up: compile, load, create the state and the chunk tables
        params, _, scaler = scaler.step(lambda p, g, s: (p, s), params, grads, (), loss=loss)
        scaler = scaler.update(scaler.unscale(grads)[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            _, finite = scaler.unscale(grads, loss=loss)
            scaler = scaler.update(finite)
            params, _, scaler = scaler.step(
                lambda p, g, s: ([a - 0.1 * b for a, b in zip(p, g, strict=True)], s), params, grads, ()
            )
            scaler = scaler.update(true)  # a caller's flag: the update kernel
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert scaler.get_stats()["steps"] == 2 * 2 + 4 * 3


@needs_torch
def test_state_is_one_record_and_public_fields_are_views() -> None:
    import torch

    scaler = ampscale.create_scaler(backend="torch")
    scaler = scaler.update(scaler.unscale([torch.ones(10, device="cuda")])[1])
    state = scaler._state
    assert isinstance(state, PackedState)
    public = scaler.state
    assert isinstance(public, ScalerState)
    assert all(v.untyped_storage().data_ptr() == state.buffer.untyped_storage().data_ptr() for v in public)
    assert scaler.get_stats()["steps"] == 1
