"""Saturating FP8 casts in each framework's own operations.

``quantize`` is ``clip(x * scale, -fp8_max, fp8_max).astype(fp8)`` in float32, written with the
framework's ``clip`` / ``clamp`` and its own float8 dtype, so XLA's FP8 GEMM rewrite and
``torch._scaled_mm`` still see the pattern they match; ``dequantize`` is ``q.astype(float32) *
scale_inv``. The clip comes first because the raw casts do not saturate: ml_dtypes and
``jnp`` send 500 to nan in E4M3FN and 1e6 to inf in E5M2, torch saturates E4M3FN but not E5M2.
nan stays nan. Presets that store the inverse scale (flax, Keras) divide by it instead
(``x / scale_inv``), as their anchors do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampscale._config import shown
from ampscale.fp8._config import FORMATS
from ampscale.fp8._ops import framework_of

__all__ = ["dequantize", "fp8_dtype", "quantize", "quantize_dequantize", "tensor_amax"]


def fp8_dtype(fmt: str, framework: str) -> Any:
    """The float8 dtype of ``fmt`` (``"e4m3fn"``, ``"e5m2"``, ``"e4m3fnuz"``, ``"e5m2fnuz"``)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}; got {shown(fmt)}")
    name = f"float8_{fmt}"
    if framework == "torch":
        import torch

        return getattr(torch, name)
    if framework == "jax":
        import jax.numpy as jnp

        return getattr(jnp, name)
    import ml_dtypes

    return getattr(ml_dtypes, name)


def _float32(x: Any, framework: str) -> Any:
    if framework == "torch":
        import torch

        return x.to(torch.float32)
    return x.astype(np.float32) if framework != "jax" else x.astype("float32")


def _clip(x: Any, bound: float, framework: str) -> Any:
    if framework == "torch":
        return x.clamp(min=-bound, max=bound)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.clip(x, -bound, bound)
    xp = np if framework == "numpy" else __import__("cupy")
    return xp.clip(x, np.float32(-bound), np.float32(bound))


def quantize(x: Any, scale: Any, fmt: str, divide: bool = False) -> Any:
    """``saturate(x * scale)`` as ``fmt``, in the framework of ``x`` (``divide``: ``x / scale``).

    Args:
        x: an array (NumPy, JAX, torch or CuPy) of any float dtype.
        scale: the quantization scale (a 0-d array or a number; the dequantization scale
            with ``divide``), broadcast against ``x``.
        fmt: the FP8 format.
        divide: divide by ``scale`` instead of multiplying (flax and Keras).
    """
    framework = framework_of(x)
    bound = FORMATS.get(fmt)
    if bound is None:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}; got {shown(fmt)}")
    wide = _float32(x, framework)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scaled = wide / scale if divide else wide * scale
        clipped = _clip(scaled, bound, framework)
    dtype = fp8_dtype(fmt, framework)
    return clipped.to(dtype) if framework == "torch" else clipped.astype(dtype)


def dequantize(q: Any, scale_inv: Any, dtype: Any = None) -> Any:
    """``q.astype(float32) * scale_inv``, then cast to ``dtype`` (float32 when ``None``)."""
    framework = framework_of(q)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _float32(q, framework) * scale_inv
    if dtype is None:
        return out
    return out.to(dtype) if framework == "torch" else out.astype(dtype)


def quantize_dequantize(x: Any, scale: Any, scale_inv: Any, fmt: str, divide: bool = False) -> Any:
    """Fake quantization: ``dequantize(quantize(x, scale), scale_inv)`` in ``x``'s dtype."""
    q = quantize(x, scale_inv if divide else scale, fmt, divide=divide)
    return dequantize(q, scale_inv, x.dtype)


def tensor_amax(x: Any) -> Any:
    """``max(|x|)`` as a 0-d float32 array on ``x``'s device; nan if any element is nan.

    Every framework's ``max`` propagates nan here (NumPy, ``jnp.max``, ``torch.amax``); an
    empty tensor has amax 0.
    """
    framework = framework_of(x)
    if framework == "torch":
        import torch

        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return torch.amax(torch.abs(x)).to(torch.float32)
    if framework == "jax":
        import jax.numpy as jnp

        if x.size == 0:
            return jnp.zeros((), jnp.float32)
        return jnp.max(jnp.abs(x)).astype(jnp.float32)
    xp = np if framework == "numpy" else __import__("cupy")
    if x.size == 0:
        return xp.zeros((), xp.float32)
    return xp.max(xp.abs(x)).astype(xp.float32)
