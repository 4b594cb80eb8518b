"""The fused FP8 pass on torch tensors (see :mod:`ampscale.fp8._fused`).

CPU tensors go through the native kernels, read through torch's DLPack C exchange API as the
loss scaler's gradients are (``ampscale.backends.torch``): no copy, no Python object per tensor.
Non-contiguous tensors and tensors that require grad are detached and made contiguous first. CUDA
tensors go through ampscale's one-launch kernel (:mod:`ampscale.fp8._fused_cuda`). Wherever
neither can run (no native build, no CUDA driver or NVRTC, a torch function or dispatch mode, a
functorch transform, compilation, CUDA graph capture, tensor subclasses, meta tensors), the same
bit arithmetic runs as torch operations, which every such mode sees and traces.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampscale.backends import _torch_cpu as torch_cpu
from ampscale.fp8._cast import fp8_dtype, quantize
from ampscale.fp8._config import FORMATS
from ampscale.fp8._pass import DIVIDE_IN, FORMAT_CODES, check_scales, nan_byte

__all__ = ["amax", "amax_cast", "eager_amax"]

#: dtype -> (the integer type of its size, the mask that clears its sign bit)
_BITS = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.float64: (torch.int64, (1 << 63) - 1),
}


def _device(leaves: list[torch.Tensor]) -> torch.device:
    first = leaves[0].device
    for index, leaf in enumerate(leaves):
        if leaf.device != first:
            raise ValueError(
                f"tree leaves must be on one device: leaf [0] is on {first}, leaf [{index}] on {leaf.device}"
            )
    return first


def _kernel_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the CUDA kernel (tests send CPU tensors down it)."""
    return bool(device.type == "cuda")


def _as_readable(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached, contiguous tensors (a copy of the non-contiguous ones), as the kernels read them."""
    return [t.detach().contiguous() for t in leaves]


def amax(leaves: list[torch.Tensor], kinds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amaxes, finite)`` of torch ``leaves``."""
    device = _device(leaves)
    if _kernel_path(device):
        from ampscale.fp8 import _fused_cuda

        done = _fused_cuda.torch_amax(leaves, kinds, device)
        if done is not None:
            return done
    elif device.type == "cpu" and torch_cpu._native_ready():
        out = np.empty(len(leaves), np.float32)
        native = torch_cpu._native
        finite = native.fp8_amax_tensors(
            leaves, torch_cpu._PLAIN_TUPLE, torch_cpu._EXCHANGE_API, out, torch_cpu._native_threads()
        )
        if finite is None:
            finite = native.fp8_amax_tensors(
                _as_readable(leaves),
                torch_cpu._PLAIN_TUPLE,
                torch_cpu._EXCHANGE_API,
                out,
                torch_cpu._native_threads(),
            )
        if finite is not None:
            return torch.from_numpy(out), torch.tensor(bool(finite))
    amaxes = torch.stack([eager_amax(t) for t in leaves])
    return amaxes, torch.isfinite(amaxes).all()


def eager_amax(t: torch.Tensor) -> torch.Tensor:
    """The amax of one tensor by the kernels' arithmetic, in torch operations: the largest
    magnitude bit pattern, converted to float32 (float64 rounded to nearest even), NaN canonical."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    unsigned, mask = _BITS[t.dtype]
    top = (t.detach().reshape(-1).view(unsigned) & mask).amax()
    if t.dtype == torch.bfloat16:
        value = (top.to(torch.int32) << 16).view(torch.float32)
    else:
        value = top.view(t.dtype).to(torch.float32)
    return torch.where(value.isnan(), torch.full_like(value, float("nan")), value)


def amax_cast(
    leaves: list[torch.Tensor], kinds: list[int], scales: Any, fmt: str, divide: bool
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(payloads, amaxes, clipped)`` of torch ``leaves``."""
    check_scales(scales, len(leaves), "torch")
    device = _device(leaves)
    if scales.device != device:
        raise ValueError(f"scales must be on the leaves' device {device}; got {scales.device}")
    dtype = fp8_dtype(fmt, "torch")
    if _kernel_path(device):
        from ampscale.fp8 import _fused_cuda

        done = _fused_cuda.torch_amax_cast(leaves, kinds, scales, fmt, divide, device)
        if done is not None:
            return done
    elif device.type == "cpu" and torch_cpu._native_ready():
        readable = _as_readable(leaves)
        outs = [torch.empty(t.shape, dtype=torch.uint8) for t in readable]
        amaxes = np.empty(len(leaves), np.float32)
        clipped = np.empty(len(leaves), np.int64)
        finite = torch_cpu._native.fp8_amax_cast_tensors(
            readable,
            outs,
            torch_cpu._PLAIN_TUPLE,
            torch_cpu._EXCHANGE_API,
            scales.detach().contiguous().numpy(),
            FORMAT_CODES[fmt],
            divide,
            nan_byte(fmt, "torch"),
            amaxes,
            clipped,
            torch_cpu._native_threads(),
        )
        if finite is not None:
            return [o.view(dtype) for o in outs], torch.from_numpy(amaxes), torch.from_numpy(clipped)
    bound = FORMATS[fmt]
    payloads, counts = [], []
    for k, t in enumerate(leaves):
        scale = scales[k]
        payloads.append(quantize(t.detach(), scale, fmt, divide=divide, compute_dtype=DIVIDE_IN))
        wide = t.detach().to(torch.float32)
        product = wide / scale if divide else wide * scale
        counts.append((product.abs() > bound).sum())
    amaxes = torch.stack([eager_amax(t) for t in leaves])
    return payloads, amaxes, torch.stack(counts).to(torch.int64)
