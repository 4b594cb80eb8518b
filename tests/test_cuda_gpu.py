"""The one-launch CUDA step on a GPU (CuPy and torch), and the same tests on the CPU's stand-ins.

* the emitted transitions on the device against the host transition, bit for bit: every preset
  x mode with drawn settings, all in ONE module (one NVRTC compile), and through each backend's
  own ``ampscale_update`` over edge states;
* gradients bit for bit against ``torch.amp.GradScaler``, and bfloat16 through ampscale's kernel;
* the drop-in ``ampscale.torch.GradScaler``'s ``update()``: one in-place launch;
* the last-block pattern under stress: many chunks, one inf in a random block, two scalers on
  two streams;
* kernel launches per step counted by the profiler (CuPy 1, torch at most 2: 1 while the scale
  may be below 1), and no host sync
  (``torch.cuda.set_sync_debug_mode("error")``); a float32 subnormal unscaled exactly.

Each test runs on a real GPU (``torch``, ``cupy``: marked ``gpu``, run by
``scripts/gpu-check.sh``) and, where the logic allows, on the CPU's stand-ins (``torch-host``:
CPU tensors down the CUDA code path, ``cupy-host``: a NumPy-backed CuPy; both launch the host
build of the same kernel source, see ``tests/fake_cuda.py``), so that the GPU run finds the
tests themselves right. The host variants use smaller sizes: they check logic, not concurrency.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ampscale
from ampscale._codegen import C_PRELUDE, STATE_BYTES, c_transition, state_dtype
from ampscale._core import ScalerState
from ampscale._native.cuda import _plan, nvrtc
from ampscale._native.cuda._packed import PackedState, decode
from ampscale._ops import HostOps
from tests.fake_cuda import Launches, cupy_on_host, torch_on_host
from tests.test_codegen import draw_configs, edge_states, mismatches


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
needs_torch_module = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
GPU_TORCH = pytest.param("torch", marks=[pytest.mark.gpu, needs_torch])
GPU_CUPY = pytest.param("cupy", marks=[pytest.mark.gpu, needs_cupy])
HOST_TORCH = pytest.param("torch-host", marks=needs_torch_module)
HOST_CUPY = pytest.param("cupy-host")
ALL = [GPU_TORCH, GPU_CUPY, HOST_TORCH, HOST_CUPY]
TORCH = [GPU_TORCH, HOST_TORCH]


class Device:
    """One framework's GPU, or its CPU stand-in: backend, arrays, flags, streams, launch counts."""

    def __init__(self, name: str, stack: contextlib.ExitStack, monkeypatch: pytest.MonkeyPatch) -> None:
        self.name = name
        self.framework = name.split("-")[0]
        self.host = name.endswith("-host")
        self.monkeypatch = monkeypatch
        if self.framework == "torch":
            import torch

            from ampscale.backends.torch import BACKEND

            self.torch = torch
            self.where = "cpu" if self.host else "cuda"
            if self.host:
                self.fake = stack.enter_context(torch_on_host(monkeypatch))
            self.backend = BACKEND
        else:
            if self.host:
                self.cupy, module = stack.enter_context(cupy_on_host(monkeypatch))
            else:
                import cupy

                from ampscale.backends import cupy as module

                self.cupy = cupy
            self.backend = module.BACKEND
        self.like = self.array(np.zeros((), np.float32))

    def flag(self, value: bool) -> Any:
        if self.framework == "torch":
            return self.torch.tensor(value, device=self.where)
        return self.cupy.asarray(value)

    def array(self, values: np.ndarray) -> Any:
        if self.framework == "torch":
            if values.dtype.name == "bfloat16":
                return self.torch.from_numpy(values.view(np.int16).copy()).view(self.torch.bfloat16).to(self.where)
            return self.torch.from_numpy(np.array(values)).to(self.where)
        return self.cupy.asarray(values)

    def numpy(self, x: Any) -> np.ndarray:
        return x.cpu().numpy() if self.framework == "torch" else self.cupy.asnumpy(x)

    # -- streams --------------------------------------------------------------------------
    def streams(self, n: int) -> list[Any]:
        if self.framework == "torch":
            return list(range(1, n + 1)) if self.host else [self.torch.cuda.Stream() for _ in range(n)]
        return [self.cupy.cuda.Stream(non_blocking=True) for _ in range(n)]

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        if self.framework == "torch" and self.host:
            previous, self.fake.stream = self.fake.stream, stream
            try:
                yield
            finally:
                self.fake.stream = previous
        elif self.framework == "torch":
            with self.torch.cuda.stream(stream):
                yield
        else:
            with stream:
                yield

    def wait(self, later: Any, earlier: Any) -> None:
        """Order stream ``later`` after the work queued on ``earlier`` so far (no host wait)."""
        if self.host:
            return
        if self.framework == "torch":
            later.wait_stream(earlier)
        else:
            later.wait_event(earlier.record())

    def sync(self) -> None:
        if self.host:
            return
        if self.framework == "torch":
            self.torch.cuda.synchronize()
        else:
            self.cupy.cuda.Device().synchronize()

    # -- launches ------------------------------------------------------------------------
    def count_launches(self, fn: Callable[[], None]) -> dict[str, int]:
        """Kernels, copies and memsets ``fn`` queues: the profiler on a GPU; on the host the
        stand-ins' module launches plus torch's fused kernel calls (copies are not seen there)."""
        if not self.host:
            return _profiled_launches(fn)
        import torch

        calls = []
        original = torch._amp_foreach_non_finite_check_and_unscale_

        def counted(*args: Any) -> None:
            calls.append(1)
            original(*args)

        before = len(Launches.log)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
            fn()
        return {"kernel": len(Launches.log) - before + len(calls), "memcpy": 0, "memset": 0}


@pytest.fixture
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    with contextlib.ExitStack() as stack:
        yield Device(request.param, stack, monkeypatch)


def _profiled_launches(fn: Callable[[], None]) -> dict[str, int]:
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


def values_of(record: np.void, scale_dtype: str) -> ScalerState:
    return decode(np.frombuffer(record.tobytes(), np.uint8), scale_dtype)


def trajectory_config(preset: str) -> Any:
    """The configurations the trajectory and transition tests share (one module each)."""
    extra = {"on_floor": "ignore"} if preset == "deepspeed" else {}
    return ampscale.create_scaler(preset=preset, growth_interval=3, **extra).config


# ------------------------------------------------------------------------------ the transition


def batch_source(configs: list[Any]) -> str:
    """One CUDA module with the transition of every config (each under its own prefix) and a
    kernel that runs config ``k``'s over ``n`` states, one thread each (host: a loop)."""
    parts = [C_PRELUDE]
    cases = []
    for k, config in enumerate(configs):
        parts.append(c_transition(config, prefix=f"c{k}_"))
        cases.append(
            f"    case {k}: return c{k}_transition((const struct c{k}_State*)in, (struct c{k}_State*)out, f, loss);"
        )
    parts.append(
        "AMPSCALE_FN int batch_one(int k, const void* in, void* out, int f, int loss) {\n    switch (k) {\n"
        + "\n".join(cases)
        + "\n    }\n    return -1;\n}\n"
        "#if defined(__CUDACC__) || defined(__CUDACC_RTC__)\n"
        'extern "C" __global__ void batch_transitions(long long k, const char* in, char* out, const int* f,\n'
        "                                             const int* loss, int* events, long long n) {\n"
        "    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
        f"    const long long b = {STATE_BYTES};\n"
        "    if (i < n) events[i] = batch_one((int)k, in + b * i, out + b * i, f[i], loss[i]);\n"
        "}\n#else\n"
        'extern "C" void batch_transitions(long long k, const char* in, char* out, const int* f, const int* loss,\n'
        "                                  int* events, long long n) {\n"
        f"    const long long b = {STATE_BYTES};\n"
        "    for (long long i = 0; i < n; i++) events[i] = batch_one((int)k, in + b * i, out + b * i, f[i], loss[i]);\n"
        "}\n#endif\n"
    )
    return "\n".join(parts)


class BatchKernel:
    """``batch_transitions`` of :func:`batch_source`, loaded for the device (or built for the host)."""

    def __init__(self, device: Device, source: str) -> None:
        self.device = device
        if device.host:
            import hashlib
            import shutil
            import subprocess

            from tests.fake_cuda import build_directory, harness_for_source  # noqa: F401 (the build dir)

            cxx = shutil.which("c++") or shutil.which("g++")
            if cxx is None:
                pytest.skip("no C++ compiler")
            lib = build_directory() / f"batch-{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
            if not lib.exists():
                mine = f"{os.getpid()}"  # several test processes may build it at once
                cpp = lib.with_suffix(f".{mine}.cpp")
                cpp.write_text(source)
                partial = lib.with_suffix(f".{mine}.so")
                subprocess.run([cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-o", str(partial), str(cpp)], check=True)
                partial.replace(lib)
                cpp.unlink()
            self.so = ctypes.CDLL(str(lib))
            self.so.batch_transitions.argtypes = [ctypes.c_longlong] + [ctypes.c_void_p] * 5 + [ctypes.c_longlong]
            return
        if device.framework == "torch":
            from ampscale._native.cuda import driver

            launcher = driver.launcher()
            major, minor = launcher.compute_capability(0)
            image, kind = nvrtc.compiled(source, 10 * major + minor, _plan.COMPILE_OPTIONS, "batch.cu")
            if kind == "ptx":
                image += b"\0"
            self.module, self.context = launcher.load_module(0, image)
            self.function = launcher.get_function(self.module, self.context, "batch_transitions")
            self.launcher = launcher
        else:
            cupy = device.cupy
            arch = int(cupy.cuda.Device().compute_capability)
            image, kind = nvrtc.compiled(source, arch, _plan.COMPILE_OPTIONS, "batch.cu")
            if kind == "ptx":
                image += b"\0"
            module = cupy.cuda.function.Module()
            module.load(image)
            self.function = module.get_function("batch_transitions")

    def __call__(self, k: int, before: np.ndarray, f: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(before)
        after = np.zeros_like(before)
        events = np.zeros(n, np.int32)
        if self.device.host:
            self.so.batch_transitions(
                k, before.ctypes.data, after.ctypes.data, f.ctypes.data, loss.ctypes.data, events.ctypes.data, n
            )
            return after, events
        d = self.device
        arrays = [
            d.array(np.frombuffer(before.tobytes(), np.uint8).copy()),
            d.array(np.zeros(n * STATE_BYTES, np.uint8)),
        ]
        arrays += [d.array(f), d.array(loss), d.array(events)]
        grid = -(-n // 128)
        if d.framework == "torch":
            ptrs = [a.data_ptr() for a in arrays]
            stream = int(d.torch.cuda.current_stream().cuda_stream)
            self.launcher.launch(self.function, self.context, grid, 128, stream, k, *ptrs, n)
        else:
            self.function((grid,), (128,), (np.int64(k), *arrays, np.int64(n)))
        d.sync()
        after = d.numpy(arrays[1]).view(before.dtype)
        return after, d.numpy(arrays[4])


@pytest.mark.parametrize("device", ALL, indirect=True)
@settings(
    max_examples=1,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: each example is one compile
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_emitted_transitions_on_the_device_in_one_module(device: Device, data: st.DataObject, seed: int) -> None:
    """Every preset x mode, drawn settings and the defaults, edge states and all flag
    combinations: the transitions compiled with ampscale's options (one module, one compile)
    and run on the device, against ``HostOps.run``, on every field, the next inverse scale and
    the floor event, bit for bit (flush-to-zero or contraction would show here)."""
    configs = draw_configs(data, per_case=1)
    kernel = BatchKernel(device, batch_source(configs))
    rng = np.random.default_rng(seed)
    for k, config in enumerate(configs):
        before = edge_states(config, rng, 256)
        f = rng.integers(0, 2, len(before), dtype=np.int32)
        loss = rng.integers(0, 2, len(before), dtype=np.int32)
        after, events = kernel(k, before, f, loss)
        wrong = mismatches(config, HostOps(config), before, after, f, loss, events)
        assert not wrong, (config, wrong[:5])


@pytest.mark.parametrize("device", ALL, indirect=True)
@pytest.mark.parametrize("preset", sorted(ampscale.PRESETS))
def test_backend_update_kernel_equals_the_host_transition(device: Device, preset: str) -> None:
    """The backend's own ``ampscale_update`` launch (``run_transition`` on a packed state) from
    edge states, for the four flag combinations: every field, the inverse scale and the floor
    event, bit for bit with ``HostOps.run``."""
    config = trajectory_config(preset)
    ops = HostOps(config)
    rng = np.random.default_rng(sum(map(ord, preset)))
    flags = {value: device.flag(value) for value in (False, True)}
    bits = np.uint64 if config.scale_dtype == "float64" else np.uint32
    for record in edge_states(config, rng, 6 if device.host else 24):
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


# ------------------------------------------------------------------------------ whole steps


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_fused_steps_follow_the_host_trajectory(device: Device) -> None:
    """Whole steps (check + unscale + update in one launch) with infs in the gradients or the
    loss: the same states as the host scaler, and the gradients as NumPy unscales them."""
    rng = np.random.default_rng(5)
    backend = device.framework
    steps = 12 if device.host else 40
    for preset in sorted(ampscale.PRESETS):
        extra = {"on_floor": "ignore"} if preset == "deepspeed" else {}
        gpu = ampscale.create_scaler(backend=backend, preset=preset, growth_interval=3, **extra)
        assert gpu.config == trajectory_config(preset)
        host = ampscale.create_scaler(backend="numpy", preset=preset, growth_interval=3, **extra)
        for step in range(steps):
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


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_step_then_update_uses_the_precomputed_state(device: Device) -> None:
    """``update`` given the very flag ``unscale`` returned adds no launch and gives the state
    the host computes; given another flag it launches the one-thread update."""
    backend = device.framework
    scaler = ampscale.create_scaler(backend=backend, growth_interval=2, init_scale=2.0**10)
    host = ampscale.create_scaler(backend="numpy", growth_interval=2, init_scale=2.0**10)
    # the state is lazy (made on the device of the first arrays): one step first creates it
    warm = np.ones(300, np.float32)
    scaler = scaler.update(scaler.unscale([device.array(warm)])[1])
    host = host.update(True)
    for bad in (False, False, True, False, False, False):
        g = np.full(300, 2.0**10, np.float32)
        if bad:
            g[7] = np.nan
        _, finite = scaler.unscale([device.array(g)])
        state = scaler._state
        assert isinstance(state, PackedState)
        assert state.pending is not None
        launched = len(Launches.log)
        nxt = scaler.update(finite)
        assert nxt._state is state.pending[2]
        if device.host:
            assert len(Launches.log) == launched  # the returned flag: nothing launched
        other = scaler.update(device.flag(not bad))  # an equal flag, another object: one update launch
        assert other._state is not state.pending[2]
        if device.host:
            assert Launches.names()[launched:] == ["ampscale_update"]
        assert other.state_dict() == nxt.state_dict()
        host = host.update(not bad)
        assert nxt.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"]
        scaler = nxt


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_a_float32_subnormal_is_unscaled_exactly(device: Device) -> None:
    """No flush-to-zero anywhere: 1e-40 (a float32 subnormal) times an inverse scale of 1/2 is
    5e-41, as NumPy and torch give; and 2**-140 * 2**-5 stays a subnormal, not 0."""
    x = np.asarray([1e-40, -1e-40, 2.0**-140, 3.0], np.float32)
    arrays = [device.array(x.copy())]
    scaler = ampscale.create_scaler(backend=device.framework, init_scale=2.0)
    (out,), finite = scaler.unscale(arrays)
    assert bool(device.numpy(finite))
    want = x * np.float32(0.5)
    assert want[0] != 0
    assert want[2] != 0
    np.testing.assert_array_equal(device.numpy(out).view(np.uint32), want.view(np.uint32))
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    if device.framework == "torch":
        small = np.asarray([1e-39, 2.0**-133], np.float32).astype(bf16)
        grads = [device.array(small.copy())]
        (got,), finite = scaler.unscale(grads)
        assert bool(device.numpy(finite))
        want16 = (small.astype(np.float32) * np.float32(0.5)).astype(bf16)
        np.testing.assert_array_equal(device.numpy(got.view(device.torch.int16)), want16.view(np.int16))


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_grad_dtype_promote_on_the_one_launch_path(device: Device) -> None:
    """``grad_dtype="promote"``: float16 gradients come back as new float32 arrays, unscaled and
    checked in float32, on the fused path as on the others (a float16 value that doubles past
    65504 stays finite)."""
    scaler = ampscale.create_scaler(
        backend=device.framework, preset="jmp", init_scale=0.5, min_scale=0.25, grad_dtype="promote"
    )
    grads = {
        "g": device.array(np.asarray([60000.0, 3.0], np.float16)),
        "w": device.array(np.asarray([2.0], np.float32)),
    }
    out, finite = scaler.unscale(grads)
    assert bool(device.numpy(finite))
    assert str(device.numpy(out["g"]).dtype) == "float32"
    assert device.numpy(out["g"]).tolist() == [120000.0, 6.0]
    assert device.numpy(grads["g"]).tolist() == [60000.0, 3.0]  # the float16 gradient is untouched


def _float16_grad_scaler() -> type:
    import torch

    class Float16GradScaler(torch.amp.GradScaler):
        """torch's GradScaler with its own kernel allowed on float16 gradients (``unscale_`` refuses
        them, but ``_unscale_grads_`` takes ``allow_fp16``): the reference for float16 bits."""

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[no-untyped-def]
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    return Float16GradScaler


@pytest.mark.parametrize("device", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gradients_bit_for_bit_against_grad_scaler(device: Device, dtype: str) -> None:
    """The drop-in against torch's GradScaler: the same gradient bits, inf and nan too, and the
    same scale after every update (the drop-in's update is its one in-place kernel)."""
    import torch

    import ampscale.torch

    torch.manual_seed(0)
    where = device.where
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(where)
    if dtype == "float16":
        model = model.half()
    twin = copy.deepcopy(model)
    view = torch.int16 if dtype == "float16" else torch.int32
    ours = ampscale.torch.GradScaler(where, init_scale=2.0**14, growth_interval=3)
    theirs = _float16_grad_scaler()(where, init_scale=2.0**14, growth_interval=3)
    opt_a = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(twin.parameters(), lr=1e-3)
    for step in range(12 if device.host else 30):
        x = torch.randn(32, 64, device=where, dtype=model[0].weight.dtype)
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
        assert int(ours._growth_tracker) == int(theirs._growth_tracker), step
    assert ours._record is not None, "the drop-in's update did not take the one-launch path"


@pytest.mark.parametrize("device", TORCH, indirect=True)
def test_drop_in_update_is_one_launch(device: Device) -> None:
    """``ampscale.torch.GradScaler.update()`` on CUDA: one kernel, no copy, torch's ``_scale`` and
    ``_growth_tracker`` (the very tensors) updated in place, the stats following."""
    import torch

    import ampscale.torch

    where = device.where
    params = [torch.nn.Parameter(torch.zeros(n, device=where)) for n in (1000, 70_000)]
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = ampscale.torch.GradScaler(where, growth_interval=2)
    scale, tracker = None, None
    for step in range(7):
        for p in params:
            p.grad = torch.full_like(p, float("inf") if step == 3 else 1.0)
        loss = scaler.scale(torch.ones((), device=where, requires_grad=True))
        loss.backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        if step == 0:
            scale, tracker = scaler._scale, scaler._growth_tracker
        counts = device.count_launches(scaler.update)
        assert counts == {"kernel": 1, "memcpy": 0, "memset": 0}, (step, counts)
        assert scaler._scale is scale
        assert scaler._growth_tracker is tracker
    # 2**16: grows after steps 1 and 5 (two finite steps each), halves at the inf of step 3
    assert scaler.get_scale() == 2.0**17
    stats = scaler.scaler.get_stats()
    assert (stats["steps"], stats["skipped_steps"], stats["growths"], stats["backoffs"]) == (7, 1, 2, 1)


@pytest.mark.parametrize("device", TORCH, indirect=True)
def test_bfloat16_in_one_pass_of_ampscales_kernel(device: Device) -> None:
    import torch

    rng = np.random.default_rng(2)
    values = [rng.standard_normal(n).astype(np.float32) * 512 for n in (5, 70_000, 131_073)]
    grads = [torch.from_numpy(v).to(torch.bfloat16).to(device.where) for v in values]
    expected = [(g.float().cpu() * np.float32(1 / 256.0)).to(torch.bfloat16) for g in grads]
    scaler = ampscale.create_scaler(backend="torch", init_scale=256.0)
    counts = device.count_launches(lambda: scaler.unscale(grads))
    assert counts["kernel"] == 1  # ampscale's kernel alone: torch's has no bfloat16 on CUDA
    scaler = ampscale.create_scaler(backend="torch", init_scale=256.0)
    grads = [torch.from_numpy(v).to(torch.bfloat16).to(device.where) for v in values]
    out, finite = scaler.unscale(grads)
    assert bool(finite)
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(a.cpu().view(torch.int16), e.view(torch.int16))
    grads[1][12345] = float("nan")
    assert not bool(scaler.unscale(grads)[1])


@pytest.mark.parametrize("device", TORCH, indirect=True)
def test_empty_bfloat16_gradients_or_an_empty_loss_need_no_check_launch(device: Device) -> None:
    """Nothing for ampscale's kernel to check (only empty bfloat16 gradients, or an empty loss
    after torch's kernel unscaled the float32 ones): the update kernel runs instead of a launch
    of 0 blocks (which the driver refuses, after torch had unscaled the gradients)."""
    import torch

    scaler = ampscale.create_scaler(backend="torch", init_scale=4.0)
    empty = [torch.zeros(0, dtype=torch.bfloat16, device=device.where)]
    _, finite = scaler.unscale(empty)
    assert bool(finite)
    grads = [torch.full((10,), 8.0, device=device.where)]
    _, finite = scaler.unscale(grads, loss=torch.zeros(0, device=device.where))
    assert bool(finite)
    assert grads[0].tolist() == [2.0] * 10  # unscaled once
    if device.host:
        assert Launches.names()[-2:] == ["ampscale_update", "ampscale_update"]


# ------------------------------------------------------------------------------ concurrency


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_last_block_stress(device: Device) -> None:
    """Thousands of chunks, one inf in a random block: the last block always sees it."""
    rng = np.random.default_rng(9)
    if device.host:
        sizes, trials = [65_536] * 6 + [3, 1, 70_001] * 3, 9
    else:
        sizes, trials = [65_536] * 600 + [3, 1, 70_001] * 300, 60  # 1,500 arrays, over 1,200 chunks
    grads = [device.array(np.ones(n, np.float32)) for n in sizes]
    # a static scale of 1: the gradients keep their values from trial to trial (a dynamic scale
    # would halve at each overflow, and the unscaled ones would soon pass float32's range)
    scaler = ampscale.create_scaler(backend=device.framework, mode="static", init_scale=1.0)
    for trial in range(trials):
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
    assert scaler.get_stats()["skipped_steps"] == trials * 2 // 3


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_two_scalers_on_two_streams(device: Device) -> None:
    streams = device.streams(2)
    device.sync()
    backend = device.framework
    scalers = [ampscale.create_scaler(backend=backend, growth_interval=2) for _ in streams]
    hosts = [ampscale.create_scaler(backend="numpy", growth_interval=2) for _ in streams]
    count = 20 if device.host else 200
    arrays = []
    for stream in streams:
        with device.use(stream):
            arrays.append([device.array(np.ones(n, np.float32)) for n in [65_536] * count])
    for step in range(8 if device.host else 20):
        for k, stream in enumerate(streams):
            with device.use(stream):
                bad = (step + k) % 4 == 0
                if bad:
                    arrays[k][step % count][5] = float("nan")
                _, finite = scalers[k].unscale(arrays[k])
                scalers[k] = scalers[k].update(finite)
                hosts[k] = hosts[k].update(not bad)
                if bad:
                    arrays[k][step % count][5] = 1.0
    device.sync()
    for scaler, host in zip(scalers, hosts, strict=True):
        assert scaler.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"]


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_a_state_used_on_another_stream_is_kept_alive_there(device: Device) -> None:
    """A state made on one stream and stepped on another: the record (and a chunk table made on
    the first stream) is handed to the allocator for the second stream (torch's
    ``record_stream``; CuPy: held until an event on that stream), so dropping the old scaler
    cannot recycle memory a queued kernel still reads. The results are right either way."""
    first, second = device.streams(2)
    grads = [device.array(np.full(1000, 4.0, np.float32))]
    if device.framework == "torch":  # a bfloat16 gradient too: ampscale's kernel and its chunk table
        grads.append(device.array(np.full(1000, 4.0, np.float32)).to(device.torch.bfloat16))
    device.sync()  # the copies above ran on the default stream
    with device.use(first):
        scaler = ampscale.create_scaler(backend=device.framework, init_scale=2.0)
        scaler = scaler.update(scaler.unscale(grads)[1])  # state and table made on `first`
    device.wait(second, first)  # as a program must: the state and gradients come from `first`
    with device.use(second):
        state = scaler._state
        _, finite = scaler.unscale(grads)
        scaler = scaler.update(finite)
    device.sync()
    assert bool(device.numpy(finite))
    for g in grads:
        assert device.numpy(g.float() if device.framework == "torch" else g).tolist() == [1.0] * 1000
    if not device.host:
        return
    if device.framework == "torch":
        recorded = {ptr for ptr, _ in device.fake.recorded}
        assert state.buffer.data_ptr() in recorded
        assert len(device.fake.recorded) >= 2  # the record and the chunk table
    else:
        from ampscale.backends import cupy as cupy_backend  # the fake's module

        held = [buffer for _, buffers in cupy_backend._held for buffer in buffers]
        assert any(buffer is state.buffer for buffer in held)
        assert len(held) >= 2


@pytest.mark.parametrize("device", ALL, indirect=True)
def test_graph_capture_is_refused_before_anything_changes(device: Device) -> None:
    """Under stream capture the functional step would replay one fixed record: it raises, naming
    capture, with the gradients untouched."""
    grads = [device.array(np.full(8, 4.0, np.float32))]
    scaler = ampscale.create_scaler(backend=device.framework, init_scale=2.0)
    scaler = scaler.update(scaler.unscale(grads)[1])
    before = device.numpy(grads[0]).copy()
    flag = device.flag(True)  # made before the capture (a host-to-device copy cannot be captured)
    device.sync()
    with _capturing(device), pytest.raises(RuntimeError, match="CUDA graph capture"):
        scaler.unscale(grads)
    device.sync()
    np.testing.assert_array_equal(device.numpy(grads[0]), before)
    with _capturing(device), pytest.raises(RuntimeError, match="CUDA graph capture"):
        scaler.update(flag)


@contextlib.contextmanager
def _capturing(device: Device) -> Iterator[None]:
    if device.host and device.framework == "torch":
        device.fake.capturing = True
        try:
            yield
        finally:
            device.fake.capturing = False
    elif device.host:
        state = device.cupy._fake_state
        state.capturing = True
        try:
            yield
        finally:
            state.capturing = False
    elif device.framework == "torch":
        torch = device.torch
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graph.capture_begin()
            try:
                yield
            finally:
                graph.capture_end()
    else:
        cupy = device.cupy
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                yield
            finally:
                stream.end_capture()


# ------------------------------------------------------------------------------ launches, syncs


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("torch", marks=[pytest.mark.gpu, needs_torch]),
        pytest.param("cupy", marks=[pytest.mark.gpu, needs_cupy, needs_torch]),
        HOST_TORCH,
        pytest.param("cupy-host", marks=needs_torch_module),
    ],
    indirect=True,
)
def test_launches_per_step(device: Device) -> None:
    """CuPy: one launch per step, loss or not. torch: two while the host's bound of the scale is
    at least 1 (its fused kernel, then the update or ampscale's kernel for the loss), and one
    where the scale may be below 1 (ampscale's kernel for every gradient, since it checks what
    it writes), never a third (a check-only pass after torch's kernel), however long the run;
    one for bfloat16 alone. Nothing is copied."""
    grads = [device.array(np.ones(n, np.float32)) for n in (1024, 70_000, 3)]
    loss = device.array(np.asarray(2.0, np.float32))
    scaler = ampscale.create_scaler(backend=device.framework)

    def step(with_loss: bool, leaves: list[Any] = grads) -> Callable[..., None]:
        def run(times: int = 5) -> None:
            nonlocal scaler
            for _ in range(times):
                if with_loss:  # step() hands the loss flag to the update: nothing left to launch
                    _, _, scaler = scaler.step(lambda p, g, s: (p, s), [], leaves, (), loss=loss)
                else:
                    _, finite = scaler.unscale(leaves)
                    scaler = scaler.update(finite)

        return run

    step(False)(2)  # warm up: compile, load, chunk tables
    step(True)(2)

    expected = 1 if device.framework == "cupy" else 2
    for with_loss in (False, True):
        counts = device.count_launches(step(with_loss))
        assert counts == {"kernel": 5 * expected, "memcpy": 0, "memset": 0}, (with_loss, counts)
    # A long run that never reads the scale: the host's bound of it falls by one backoff per
    # update (from 2**16, below 1 after 17 updates), so the scale may be below 1 from then on;
    # still at most two launches per step, and one once the bound is below 1.
    counts = device.count_launches(lambda: [step(with_loss)(10) for with_loss in (False, True)])
    assert counts["kernel"] <= 20 * expected, counts
    # one copy at most: the chunk table of the float32 gradients, made when ampscale's kernel
    # takes them over (then cached: none below)
    assert counts["memcpy"] <= 1, counts
    assert counts["memset"] == 0, counts
    for with_loss in (False, True):
        counts = device.count_launches(step(with_loss))
        assert counts == {"kernel": 5, "memcpy": 0, "memset": 0}, ("bound below 1", with_loss, counts)
    # a scale below 1 from the start (the benchmark's 1/16), float32 and bfloat16 alike
    leaves = {"float32": grads}
    if device.framework == "torch":
        import torch

        leaves["bfloat16"] = [g.to(torch.bfloat16) for g in grads]
    for name, tree in leaves.items():
        scaler = ampscale.create_scaler(backend=device.framework, init_scale=1 / 16)
        step(False, tree)(1)
        for with_loss in (False, True):
            counts = device.count_launches(step(with_loss, tree))
            assert counts == {"kernel": 5, "memcpy": 0, "memset": 0}, ("scale 1/16", name, with_loss, counts)
    if device.framework == "torch":
        bf16 = leaves["bfloat16"]
        scaler = ampscale.create_scaler(backend="torch")
        scaler = scaler.update(scaler.unscale(bf16)[1])

        def run_bf16() -> None:
            nonlocal scaler
            for _ in range(5):
                scaler = scaler.update(scaler.unscale(bf16)[1])

        assert device.count_launches(run_bf16) == {"kernel": 5, "memcpy": 0, "memset": 0}


@pytest.mark.parametrize("device", TORCH, indirect=True)
def test_torch_step_never_syncs(device: Device) -> None:
    """No host read in unscale, update or step: torch's sync debug mode on a GPU; on the host,
    every tensor read raises."""
    import torch

    where = device.where
    grads = [torch.ones(n, device=where) for n in (1024, 70_000)]
    params = [torch.zeros_like(g) for g in grads]
    scaler = ampscale.create_scaler(backend="torch", growth_interval=2)
    loss = torch.full((), 3.0, device=where)
    true = torch.ones((), dtype=torch.bool, device=where)
    for _ in range(2):  # warm up: compile, load, create the state and the chunk tables
        params, _, scaler = scaler.step(lambda p, g, s: (p, s), params, grads, (), loss=loss)
        scaler = scaler.update(scaler.unscale(grads)[1])
    with _no_host_reads(device):
        for _ in range(4):
            _, finite = scaler.unscale(grads, loss=loss)
            scaler = scaler.update(finite)
            params, _, scaler = scaler.step(
                lambda p, g, s: ([a - 0.1 * b for a, b in zip(p, g, strict=True)], s), params, grads, ()
            )
            scaler = scaler.update(true)  # a caller's flag: the update kernel
    assert scaler.get_stats()["steps"] == 2 * 2 + 4 * 3


@contextlib.contextmanager
def _no_host_reads(device: Device) -> Iterator[None]:
    torch = device.torch
    if not device.host:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a host read of a device value")

    with pytest.MonkeyPatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            m.setattr(torch.Tensor, name, forbidden)
        yield


@pytest.mark.parametrize("device", TORCH, indirect=True)
def test_state_is_one_record_and_public_fields_are_views(device: Device) -> None:
    import torch

    scaler = ampscale.create_scaler(backend="torch")
    scaler = scaler.update(scaler.unscale([torch.ones(10, device=device.where)])[1])
    state = scaler._state
    assert isinstance(state, PackedState)
    public = scaler.state
    assert isinstance(public, ScalerState)
    assert all(v.untyped_storage().data_ptr() == state.buffer.untyped_storage().data_ptr() for v in public)
    assert scaler.get_stats()["steps"] == 1
