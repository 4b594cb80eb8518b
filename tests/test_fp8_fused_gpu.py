"""The fused FP8 pass on a GPU (marked ``gpu``: run by ``scripts/gpu-check.sh``).

torch CUDA tensors and CuPy arrays through ``ampscale_fp8_pass``: one launch, no host sync, the
amaxes bit for bit the exact ``max(|x|)`` (the bit arithmetic in torch's own operations), the
payloads bit for bit torch's own saturating cast on the device (``ampscale.fp8.quantize``), the
clipped counts, on every dtype, with inf and NaN in the head, the words and the tail, views at
odd offsets, empty tensors, and many tensors across many blocks. The same tests run on the CPU's
stand-ins in ``tests/test_fp8_fused_cuda.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

import ampscale.fp8 as fp8
from ampscale.fp8 import _fused
from ampscale.fp8._pass import DIVIDE_IN

pytestmark = pytest.mark.gpu

FORMATS = sorted(fp8.FORMATS)


def _torch_cuda() -> Any:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _leaves(torch: Any, dtype: Any) -> list[Any]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(300_000, generator=generator, device="cuda").mul_(100).to(dtype)
    leaves = [base[k : k + n] for k, n in [(0, 150_000), (1, 70_001), (3, 5), (0, 0), (7, 65_536 * 2 + 3)]]
    leaves[1][0] = float("nan")
    leaves[4][65_536] = float("-inf")
    leaves[4][-1] = float("nan")
    leaves.append(torch.randn(64, 48, device="cuda").to(dtype).t())  # not contiguous
    return leaves


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_torch_cuda_amax_and_cast_are_the_references_in_one_launch(name: str) -> None:
    torch = _torch_cuda()
    from torch.profiler import ProfilerActivity, profile

    from ampscale.fp8 import _fused_torch

    leaves = _leaves(torch, getattr(torch, name))
    expected = torch.stack([_fused_torch.eager_amax(t) for t in leaves])
    fp8.amax(leaves)  # compile and load the kernels, build the table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            amaxes, finite = fp8.amax(leaves, with_finite=True)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("ampscale_fp8_pass" in k for k in kernels) == 1
    assert torch.equal(amaxes.view(torch.int32), expected.view(torch.int32))
    assert not bool(finite)
    scales = torch.tensor([0.25, 3.0, 1e4, 1.0, 7.0, 0.5], device="cuda")
    for fmt in FORMATS:
        for divide in (False, True):
            payloads, cast_amaxes, clipped = fp8.amax_and_cast(leaves, scales, fmt, divide=divide)
            assert torch.equal(cast_amaxes.view(torch.int32), expected.view(torch.int32))
            for k, t in enumerate(leaves):
                reference = fp8.quantize(t, scales[k], fmt, divide=divide, compute_dtype=DIVIDE_IN)
                assert torch.equal(payloads[k].view(torch.uint8), reference.view(torch.uint8)), (fmt, divide, k)
                wide = t.float()
                product = wide / scales[k] if divide else wide * scales[k]
                assert clipped[k].item() == int((product.abs() > fp8.FORMATS[fmt]).sum())


def test_torch_cuda_many_tensors_and_the_scratch_across_calls() -> None:
    torch = _torch_cuda()
    leaves = [torch.randn(int(n), device="cuda") for n in np.random.default_rng(1).integers(0, 70_000, 300)]
    for step in range(3):
        if step == 1:
            leaves[123][0] = float("inf")
        amaxes = fp8.amax(leaves).cpu().numpy()
        expected = [t.abs().max().item() if t.numel() else 0.0 for t in leaves]
        assert amaxes.tolist() == np.float32(expected).tolist()


def test_cupy_amax_and_cast_are_the_references() -> None:
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("no CuPy")
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(2)
    sizes = [(200_003, "float32"), (999, "float16"), (0, "float64")]
    host = [(rng.standard_normal(n) * 100).astype(d) for n, d in sizes]
    host[0][100_000] = np.nan
    leaves = [cupy.asarray(a) for a in host]
    amaxes, finite = fp8.amax(leaves, with_finite=True)
    expected = [_fused.bits_amax_numpy(a) for a in host]
    assert cupy.asnumpy(amaxes).view(np.uint32).tolist() == np.float32(expected).view(np.uint32).tolist()
    assert not bool(finite)
    scales = cupy.asarray(np.float32([4.0, 0.5, 1.0]))
    for fmt in FORMATS:
        payloads, _, clipped = fp8.amax_and_cast(leaves, scales, fmt)
        for k, a in enumerate(host):
            reference, count = _fused.reference_cast_numpy(a, float(scales[k]), fmt, False)
            assert (cupy.asnumpy(payloads[k]) == reference.view(np.uint8)).all()
            assert int(clipped[k]) == count


_UPDATE_SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}
# zero, inf, nan, a subnormal and float32's top end among the amaxes; skipped steps between
_UPDATE_STREAM = [
    ([2.0, 0.5, 40.0], True),
    ([np.inf, 0.25, 30.0], False),
    ([5.0, 0.75, 60.0], False),
    ([3.0, 0.0, np.nan], True),
    ([1e-40, 1.0, 3e38], True),
    ([448.0, 1e-3, 7.0], True),
]


def _cupy_device() -> Any:
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("no CuPy")
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.parametrize("backend", ["torch", "cupy"])
@pytest.mark.parametrize("preset", sorted(fp8.FP8_PRESETS))
def test_the_update_on_the_gpu_is_numpys_bit_for_bit(backend: str, preset: str) -> None:
    """``Fp8Scaler.update`` on device arrays (the one-launch CUDA update, ``fp8/_cuda.py``) gives
    NumPy's state field by field, bit for bit, with the step flag on the host and on the device.
    The presets whose rule takes a float32 ``log2`` reproduce torch's CPU ``log2``: a GPU's may
    round otherwise just below a power of two (none of these amaxes lies there)."""
    if backend == "torch":
        torch = _torch_cuda()
        f8 = fp8.create_fp8_scaler(preset, _UPDATE_SLOTS, backend="torch", device="cuda", history_len=4)

        def device(values: Any, dtype: Any) -> Any:
            return torch.tensor(values, dtype=dtype, device="cuda")

        def host(x: Any) -> np.ndarray:
            return x.cpu().numpy()

        flag_dtype, amax_dtype = torch.bool, torch.float32
    else:
        cupy = _cupy_device()
        f8 = fp8.create_fp8_scaler(preset, _UPDATE_SLOTS, backend="cupy", history_len=4)

        def device(values: Any, dtype: Any) -> Any:
            return cupy.asarray(np.asarray(values, dtype=dtype))

        host = cupy.asnumpy
        flag_dtype, amax_dtype = np.bool_, np.float32
    reference = fp8.create_fp8_scaler(preset, _UPDATE_SLOTS, history_len=4)
    for k, (amax, ok) in enumerate(_UPDATE_STREAM):
        flag = device(ok, flag_dtype) if k % 2 else ok
        f8 = f8.update(device(amax, amax_dtype), step_ok=flag)
        reference = reference.update(np.float32(amax), step_ok=ok)
        for name, got, want in zip(fp8.Fp8State._fields, f8.state, reference.state, strict=True):
            assert (got is None) == (want is None), name
            if got is None:
                continue
            got, want = host(got), np.asarray(want)
            if got.dtype.kind == "f":
                got, want = got.view(np.uint32), want.view(np.uint32)
            assert got.tolist() == want.tolist(), f"{preset} {backend} {name} at step {k}"
