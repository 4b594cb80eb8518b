"""Saturating FP8 casts in each framework's own operations, and the E8M0 scale encoding.

``quantize`` is ``clip(x * scale, -fp8_max, fp8_max).astype(fp8)`` in float32, written with the
framework's ``clip`` / ``clamp`` and its own float8 dtype, so XLA's FP8 GEMM rewrite and
``torch._scaled_mm`` still see the pattern they match; ``dequantize`` is ``q.astype(float32) *
scale_inv``. The clip comes first because the raw casts do not saturate: ml_dtypes and
``jnp`` send 500 to nan in E4M3FN and 1e6 to inf in E5M2, torch saturates E4M3FN but not E5M2.
nan stays nan.

Each preset casts as its anchor does (the ``cast`` setting, :func:`quantize_as` and
:func:`dequantize_as`): TE multiplies in float32 and dequantizes ``f32(q) * scale_inv``; torchao
dequantizes ``q / scale``; flax and Keras divide by the inverse scale in the compute dtype
(``x / S``, bfloat16 when the model computes in bfloat16), and dequantize ``q * S`` in the
input's dtype (flax) or the compute dtype (Keras). An operation in bfloat16 or float16 is
computed in float32 and rounded once, as NumPy's ml_dtypes, torch and XLA all do.

E8M0 (:func:`e8m0_encode`, :func:`e8m0_decode`) is the MX scale: a biased power of two, one
byte, ``0xFF`` nan, no zero, no sign.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampscale._config import shown
from ampscale.fp8._config import FORMATS
from ampscale.fp8._ops import framework_of

__all__ = [
    "CASTS",
    "E8M0_ROUNDINGS",
    "dequantize",
    "dequantize_as",
    "e8m0_decode",
    "e8m0_encode",
    "fp8_dtype",
    "quantize",
    "quantize_as",
    "quantize_dequantize",
    "tensor_amax",
]

#: the ``cast`` setting's values (see :mod:`ampscale.fp8._config`)
CASTS = ("multiply", "multiply_divide", "multiply_divide_f32", "divide", "divide_compute")
#: :func:`e8m0_encode`'s roundings
E8M0_ROUNDINGS = ("up", "down", "nearest")


def _check_fmt(fmt: Any) -> float:
    bound = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if bound is None:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}; got {shown(fmt)}")
    return bound


def fp8_dtype(fmt: str, framework: str) -> Any:
    """The float8 dtype of ``fmt`` (``"e4m3fn"``, ``"e5m2"``, ``"e4m3fnuz"``, ``"e5m2fnuz"``)."""
    _check_fmt(fmt)
    name = f"float8_{fmt}"
    if framework == "torch":
        import torch

        return getattr(torch, name)
    if framework == "jax":
        import jax.numpy as jnp

        return getattr(jnp, name)
    import ml_dtypes

    return getattr(ml_dtypes, name)


def _namespace(framework: str) -> Any:
    if framework == "torch":
        import torch

        return torch
    if framework == "jax":
        import jax.numpy as jnp

        return jnp
    if framework == "cupy":
        import cupy

        return cupy
    return np


def _astype(x: Any, dtype: Any, framework: str) -> Any:
    if framework == "torch":
        return x.to(dtype)
    return x.astype(dtype)


def _float32(x: Any, framework: str) -> Any:
    return _astype(x, _namespace(framework).float32, framework)


def _dtype_of(dtype: Any, framework: str) -> Any:
    """``dtype`` (a dtype, a type or a name such as ``"bfloat16"``) as ``framework``'s dtype."""
    if framework == "torch":
        import torch

        if isinstance(dtype, torch.dtype):
            return dtype
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        return getattr(torch, name)
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _promote(a: Any, b: Any, framework: str) -> Any:
    if framework == "torch":
        import torch

        return torch.promote_types(a, b)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.promote_types(a, b)
    return np.promote_types(a, b)


def _round_to(x32: Any, dtype: Any, framework: str) -> Any:
    """A float32 result rounded once to ``dtype``: how every framework computes in bfloat16 and
    float16 (ml_dtypes, torch's CPU kernels and XLA all compute in float32 and round)."""
    return _astype(x32, dtype, framework)


def _divide(a: Any, b: Any, framework: str) -> Any:
    """``a / b``, one correctly rounded division per element.

    XLA's algebraic simplifier turns ``a / broadcast(b)`` into ``a * broadcast(1 / b)`` (two
    roundings: torchao's ``q / scale`` differs from it for 92 of the 254 finite E4M3 values
    when ``scale = 448 / 60``); a broadcast behind an optimization barrier is not a pattern it
    matches, so JAX divides as NumPy and torch do, eagerly and under ``jit``.
    """
    if framework != "jax":
        return a / b
    import jax
    import jax.numpy as jnp

    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    return jnp.broadcast_to(a, shape) / jax.lax.optimization_barrier(jnp.broadcast_to(b, shape))


def _clip(x: Any, bound: float, framework: str) -> Any:
    if framework == "torch":
        return x.clamp(min=-bound, max=bound)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.clip(x, -bound, bound)
    xp = _namespace(framework)
    return xp.clip(x, np.asarray(-bound, x.dtype), np.asarray(bound, x.dtype))


def quantize(x: Any, scale: Any, fmt: str, divide: bool = False, compute_dtype: Any = None) -> Any:
    """``saturate(x * scale)`` as ``fmt``, in the framework of ``x`` (``divide``: ``x / scale``).

    Args:
        x: an array (NumPy, JAX, torch or CuPy) of any float dtype.
        scale: the quantization scale (a 0-d array or a number; the dequantization scale
            with ``divide``), broadcast against ``x``.
        fmt: the FP8 format.
        divide: divide by ``scale`` instead of multiplying (flax and Keras).
        compute_dtype: with ``divide``, the dtype the scale is cast to before the division,
            which runs in the promotion of ``x``'s dtype and it (flax's and Keras's
            ``compute_dtype``; ``None``: ``x``'s dtype). A multiplication is always float32.
    """
    framework = framework_of(x)
    bound = _check_fmt(fmt)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if divide:
            compute = x.dtype if compute_dtype is None else _dtype_of(compute_dtype, framework)
            where = _promote(x.dtype, compute, framework)
            scale_c = _astype(_namespace(framework).asarray(scale), compute, framework)
            quotient = _divide(_float32(x, framework), _float32(scale_c, framework), framework)
            scaled = _round_to(quotient, where, framework)
        else:
            scaled = _float32(x, framework) * scale
        clipped = _clip(scaled, bound, framework)
    return _astype(clipped, fp8_dtype(fmt, framework), framework)


def dequantize(q: Any, scale_inv: Any, dtype: Any = None) -> Any:
    """``q.astype(float32) * scale_inv``, then cast to ``dtype`` (float32 when ``None``)."""
    framework = framework_of(q)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _float32(q, framework) * scale_inv
    if dtype is None:
        return out
    return _round_to(out, _dtype_of(dtype, framework), framework)


def quantize_as(x: Any, scale: Any, scale_inv: Any, fmt: str, cast: str, compute_dtype: Any = None) -> Any:
    """``x`` quantized as the ``cast`` setting says (see :mod:`ampscale.fp8._config`)."""
    if cast in ("divide", "divide_compute"):
        return quantize(x, scale_inv, fmt, divide=True, compute_dtype=compute_dtype)
    return quantize(x, scale, fmt)


def dequantize_as(q: Any, scale: Any, scale_inv: Any, cast: str, dtype: Any = None, compute_dtype: Any = None) -> Any:
    """``q`` dequantized as the ``cast`` setting says, into ``dtype`` (``None``: float32; Keras's
    ``"divide_compute"`` uses ``compute_dtype`` when it is given)."""
    framework = framework_of(q)
    target = _namespace(framework).float32 if dtype is None else _dtype_of(dtype, framework)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if cast == "multiply":
            return dequantize(q, scale_inv, dtype)
        if cast in ("multiply_divide", "multiply_divide_f32"):
            # torchao: q.to(orig_dtype) / scale; a 0-d float32 scale leaves the division in
            # float32 and rounds once to orig_dtype; a [rows, 1] scale promotes to float32
            out = _divide(_float32(q, framework), scale, framework)
            return out if cast == "multiply_divide_f32" else _round_to(out, target, framework)
        if cast == "divide_compute" and compute_dtype is not None:
            target = _dtype_of(compute_dtype, framework)
        # flax / Keras: q.astype(d) * scale.astype(d), the product rounded once to d
        scale_d = _float32(_astype(_namespace(framework).asarray(scale_inv), target, framework), framework)
        return _round_to(_float32(q, framework) * scale_d, target, framework)


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
    xp = _namespace(framework)
    if x.size == 0:
        return xp.zeros((), xp.float32)
    return xp.max(xp.abs(x)).astype(xp.float32)


# ------------------------------------------------------------------------------ E8M0


def _bits32(x: Any, framework: str) -> Any:
    if framework == "jax":
        import jax

        return jax.lax.bitcast_convert_type(x, _namespace(framework).int32)
    return x.view(_namespace(framework).int32)


def _uint8(values: Any, framework: str) -> Any:
    return _astype(values, _namespace(framework).uint8, framework)


def e8m0_encode(x: Any, rounding: str = "up") -> Any:
    """float32 ``x`` as E8M0 bytes (uint8), in ``x``'s framework.

    Args:
        x: a float32 array (a scale, ``amax / fp8_max``, ...).
        rounding: ``"up"``: the power of two at or above ``|x|``, saturating at ``2**127``
            (``0xFE``), 0 as ``0x00``, inf ``0xFE``, nan ``0xFF``: CUDA's
            ``cvt.rp.satfinite.ue8m0`` as Transformer Engine computes it off Blackwell
            (``ptx_arch_spec.cuh: float_to_e8m0``, which reads ``|x|``); ``"down"``: the power
            of two at or below ``|x|`` (its exponent bits; 0 and subnormals ``0x00``, inf
            ``0xFE``, nan ``0xFF``); ``"nearest"``: ml_dtypes' ``astype(float8_e8m0fnu)`` (ties
            to the larger power; 0, negatives, nan and values past ``2**127`` are ``0xFF``).

    Raises:
        ValueError: an unknown ``rounding``.
    """
    if rounding not in E8M0_ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(E8M0_ROUNDINGS)}; got {shown(rounding)}")
    framework = framework_of(x)
    xp = _namespace(framework)
    bits = _bits32(_float32(x, framework), framework)
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    nan = magnitude > 0x7F800000
    inf = magnitude == 0x7F800000
    if rounding == "up":
        # float_to_e8m0: round the exponent up unless the mantissa is 0, the exponent is 254
        # (satfinite), or a subnormal is at most 2**-127 (0x400000)
        bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
        out = exponent + _astype(bump, xp.int32, framework)
        out = xp.where(inf, 0xFE, out)
    elif rounding == "down":
        out = xp.where(inf, 0xFE, exponent)
    else:
        # nearest, ties up: a mantissa at or past 1.5 goes to the next power; a subnormal
        # rounds to 2**-127 (0x00) or 2**-126 (0x01) at its midpoint 1.5 * 2**-127
        normal = exponent + _astype(mantissa >= 0x400000, xp.int32, framework)
        subnormal = _astype(magnitude >= 0x600000, xp.int32, framework)
        out = xp.where(exponent == 0, subnormal, normal)
        bad = (magnitude == 0) | (bits < 0) | inf | (out > 0xFE)
        out = xp.where(bad, 0xFF, out)
    return _uint8(xp.where(nan, 0xFF, out), framework)


def e8m0_decode(e: Any) -> Any:
    """E8M0 bytes (uint8) as float32: ``2**(e - 127)``, ``0x00`` the subnormal ``2**-127`` and
    ``0xFF`` nan (as ml_dtypes' and torch's ``float8_e8m0fnu`` read them)."""
    framework = framework_of(e)
    xp = _namespace(framework)
    biased = _astype(e, xp.int32, framework)
    bits = xp.where(biased == 0, 0x00400000, biased << 23)
    bits = xp.where(biased == 0xFF, 0x7FC00000, bits)
    if framework == "jax":
        import jax

        return jax.lax.bitcast_convert_type(bits.astype(xp.int32), xp.float32)
    return _astype(bits, xp.int32, framework).view(xp.float32)
