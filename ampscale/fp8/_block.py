"""Block and MX scaling: one scale per block of a tensor, from that block's own amax, per call.

Stateless (there is no history to keep), in each framework's own operations (NumPy, torch, JAX):

* :func:`quantize_block` / :func:`dequantize_block`: Transformer Engine's ``Float8BlockScaling``,
  1x128 blocks along the last axis or 128x128 tiles of the tensor flattened to 2-D, a float32
  scale per block from ``compute_scale_from_types`` (the rule of the ``te_block`` preset:
  ``fp8_max / amax``, amax 0 / inf / nan gives 1, an inf scale becomes the *input* dtype's
  largest value, power of two by default), the block's amax taken as TE's ``fmaxf`` takes it
  (nan elements dropped), the data ``sat(f32(x) * scale)`` and ``scale_inv = 1 / scale``
  (``quantize_transpose_vector_blockwise.cu``, ``quantize_transpose_square_blockwise.cu``).
* :func:`quantize_mx` / :func:`dequantize_mx`: one E8M0 byte per ``block`` (32) consecutive
  values along the last axis, by ``rule``:

  ==================== =======================================================================
  rule                 anchor
  ==================== =======================================================================
  ``"floor"``          OCP MX v1.0's ``2**(floor(log2(amax)) - emax_elem)`` from amax's exponent
                       bits, as torchao's ``to_mx`` (``ScaleCalculationMode.FLOOR``, its default)
  ``"ceil"``           torchao ``CEIL``: one more when amax's mantissa is nonzero
  ``"even"``           torchao ``EVEN``: amax rounded at the element's mantissa first
  ``"rceil"``          torchao ``RCEIL`` as it runs on the CPU: ``ceil(log2(amax / fp8_max))`` with
                       float32 ``log2``, the data multiplied by ``2**(127 - e)`` (1 when ``e`` is 0)
  ``"te_mxfp8"``       TE ``MXFP8BlockScaling``: ``cvt.rp.satfinite.ue8m0(amax * rcp(fp8_max))``
                       with TE's rounded float32 reciprocal, nan elements dropped from the amax,
                       the data ``sat(x * exp2f_rcp(e))`` (``quantize_mxfp8.cuh``, ``ptx.cuh``)
  ``"microxcaling"``   microsoft/microxcaling ``_quantize_mx`` (the OCP reference emulator):
                       ``floor(log2(amax))`` with float32 ``log2``, elements rounded half away
                       from zero by its ``_quantize_elemwise_core``, a nan or inf block all nan
  ==================== =======================================================================

  The scale bytes (uint8) read ``2**(e - 127)``; ``0xFF`` is nan (:func:`ampscale.fp8.e8m0_decode`).

The scales come from the amax's bits on every backend, so they are exact on JAX too; the data
casts are the framework's float operations (XLA's CPU flushes subnormal elements to 0).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ampscale._config import shown
from ampscale.fp8._cast import (
    _astype,
    _bits32,
    _check_fmt,
    _clip,
    _divide,
    _float32,
    _namespace,
    _round_to,
    _uint8,
    e8m0_encode,
    fp8_dtype,
)
from ampscale.fp8._config import make_fp8_config
from ampscale.fp8._ops import framework_of
from ampscale.fp8._transition import _scale_rule
from ampscale.fp8._update import ops_for

__all__ = ["BLOCK_SHAPES", "MX_RULES", "dequantize_block", "dequantize_mx", "quantize_block", "quantize_mx"]

#: :func:`quantize_block`'s block shapes (TE's ``Float8BlockScaling``: 1D and 2D)
BLOCK_SHAPES = ((1, 128), (128, 128))
#: :func:`quantize_mx`'s rules
MX_RULES = ("floor", "ceil", "even", "rceil", "te_mxfp8", "microxcaling")
#: the element formats' exponent of their largest power of two (torchao ``F8E4M3_MAX_POW2``,
#: ``F8E5M2_MAX_POW2``; microxcaling's ``emax``) and mantissa bits
_ELEMENT = {"e4m3fn": (8, 3), "e5m2": (15, 2)}
_INPUT_MAX = {"float32": "flt_max", "bfloat16": "bf16_max", "float16": "fp16_max"}


def _dtype_name(x: Any) -> str:
    return str(x.dtype).split(".")[-1]


def _from_bits(bits: Any, framework: str) -> Any:
    xp = _namespace(framework)
    if framework == "jax":
        import jax

        return jax.lax.bitcast_convert_type(bits.astype(xp.int32), xp.float32)
    return _astype(bits, xp.int32, framework).view(xp.float32)


def _max_last(x: Any, framework: str) -> Any:
    if framework == "torch":
        return x.amax(dim=-1)
    return x.max(axis=-1)


def _amax_dropping_nan(blocks: Any, framework: str) -> Any:
    """The largest ``|x|`` of each block (last axis) as TE's ``fmaxf`` from 0 takes it: nan
    elements dropped. Compared by the bits (nonnegative float32 values order as their bit
    patterns), so a block of subnormals keeps its amax on JAX too."""
    xp = _namespace(framework)
    magnitude = _bits32(_float32(blocks, framework), framework) & 0x7FFFFFFF
    clean = xp.where(magnitude > 0x7F800000, 0, magnitude)
    return _from_bits(_max_last(clean, framework), framework)


def _amax_keeping_nan(blocks: Any, framework: str) -> Any:
    """``amax(|x|)`` of each block with nan propagated (``torch.amax``, ``torch.max(dim=)``)."""
    xp = _namespace(framework)
    magnitude = _bits32(_float32(blocks, framework), framework) & 0x7FFFFFFF
    nan = magnitude > 0x7F800000
    top = _max_last(xp.where(nan, 0, magnitude), framework)
    any_nan = _max_last(_astype(nan, xp.int32, framework), framework) > 0
    return _from_bits(xp.where(any_nan, 0x7FC00000, top), framework)


def _check_x(x: Any, what: str) -> tuple[str, str]:
    framework = framework_of(x)
    name = _dtype_name(x)
    if name not in _INPUT_MAX:
        raise TypeError(f"{what}: x must be float32, bfloat16 or float16; got dtype {name}")
    return framework, name


# ------------------------------------------------------------------------------ TE block scaling


def _tiles(x: Any, block: tuple[int, int], framework: str) -> tuple[Any, tuple[int, ...]]:
    """``x`` flattened to 2-D (rows = every axis but the last, as TE does), padded with zeros to
    whole blocks, as ``[row blocks, block rows, column blocks, block columns]``."""
    xp = _namespace(framework)
    columns = x.shape[-1] if x.ndim else 1
    rows = math.prod(x.shape[:-1]) if x.ndim else 1
    flat = x.reshape(rows, columns)
    block_rows, block_columns = block
    row_blocks, column_blocks = -(-rows // block_rows), -(-columns // block_columns)
    pad_rows, pad_columns = row_blocks * block_rows - rows, column_blocks * block_columns - columns
    if pad_rows or pad_columns:
        if framework == "torch":
            import torch

            flat = torch.nn.functional.pad(flat, (0, pad_columns, 0, pad_rows))
        else:
            flat = xp.pad(flat, ((0, pad_rows), (0, pad_columns)))
    tiled = flat.reshape(row_blocks, block_rows, column_blocks, block_columns)
    return tiled, (rows, columns)


def _block_scale(
    amax: Any, fmt: str, pow2: bool, eps: float, input_dtype: str, framework: str, device: Any
) -> tuple[Any, Any]:
    """The ``te_block`` preset's rule over an array of block amaxes (the transition's own code)."""
    config = make_fp8_config(
        "te_block",
        1,
        formats="e4m3fn" if fmt == "e4m3fn" else "e5m2",
        pow2="mask" if pow2 else "none",
        eps=float(eps),
        inf_scale=_INPUT_MAX[input_dtype],
    )
    ops = ops_for(config, framework, device)
    one = ops.f32(1.0)
    scale = _scale_rule(config, ops.enter(amax), one, ops.f32(config.slot_max[0]), ops)
    # TE writes scale_inv = 1.0 / scale in double, rounded to float: the float32 quotient
    return ops.leave(scale), ops.leave(ops.div(one, scale))


def quantize_block(
    x: Any, fmt: str = "e4m3fn", block: tuple[int, int] = (1, 128), pow2: bool = True, eps: float = 0.0
) -> tuple[Any, Any]:
    """``(q, scale_inv)``: ``x`` in FP8 with one float32 scale per block, as TE's
    ``Float8BlockScaling`` quantizes it (rowwise).

    Args:
        x: a float32, bfloat16 or float16 array (NumPy, torch, JAX); every axis but the last is
            flattened into rows, as TE does.
        fmt: ``"e4m3fn"`` (TE's default) or ``"e5m2"``.
        block: ``(1, 128)`` (activations and gradients) or ``(128, 128)`` (weights).
        pow2: power-of-two scales (TE's default; ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` is
            ``False``).
        eps: TE's ``amax_epsilon`` (a floor on each block's amax).

    Returns:
        ``q`` of ``x``'s shape in ``fmt``, and ``scale_inv`` (float32) of shape
        ``(*x.shape[:-1], ceil(K / 128))`` for 1x128 blocks or ``(ceil(rows / 128), ceil(K /
        128))`` for 128x128 tiles: TE's logical layout (its GEMM layout is the transpose,
        padded to 4).

    Raises:
        ValueError: an unknown ``fmt`` or ``block``; TypeError: ``x`` of another dtype.
    """
    framework, input_dtype = _check_x(x, "quantize_block")
    bound = _check_fmt(fmt)
    if fmt not in ("e4m3fn", "e5m2"):
        raise ValueError(f"fmt must be 'e4m3fn' or 'e5m2' for TE's block scaling; got {shown(fmt)}")
    block = tuple(block)  # type: ignore[assignment]
    if block not in BLOCK_SHAPES:
        raise ValueError(f"block must be one of {list(BLOCK_SHAPES)}; got {shown(block)}")
    tiled, (rows, columns) = _tiles(x, block, framework)
    xp = _namespace(framework)
    if framework == "torch":
        per_block = tiled.permute(0, 2, 1, 3).reshape(tiled.shape[0], tiled.shape[2], -1)
    else:
        per_block = xp.swapaxes(tiled, 1, 2).reshape(tiled.shape[0], tiled.shape[2], -1)
    amax = _amax_dropping_nan(per_block, framework)
    device = x.device if framework == "torch" else None
    scale, scale_inv = _block_scale(amax, fmt, pow2, eps, input_dtype, framework, device)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = _float32(tiled, framework) * scale[:, None, :, None]
        q = _astype(_clip(scaled, bound, framework), fp8_dtype(fmt, framework), framework)
    q = q.reshape(tiled.shape[0] * tiled.shape[1], -1)[:rows, :columns].reshape(x.shape)
    if block == (1, 128):
        scale_inv = scale_inv.reshape(*x.shape[:-1], -1)
    return q, scale_inv


def dequantize_block(q: Any, scale_inv: Any, block: tuple[int, int] = (1, 128), dtype: Any = None) -> Any:
    """``f32(q) * scale_inv`` per block, rounded once to ``dtype`` (float32 when ``None``), as
    TE's ``Float8BlockwiseQTensor.dequantize``; ``scale_inv`` as :func:`quantize_block` returns it."""
    framework = framework_of(q)
    block = tuple(block)  # type: ignore[assignment]
    if block not in BLOCK_SHAPES:
        raise ValueError(f"block must be one of {list(BLOCK_SHAPES)}; got {shown(block)}")
    tiled, (rows, columns) = _tiles(q, block, framework)
    scales = scale_inv.reshape(tiled.shape[0], tiled.shape[2])
    with np.errstate(over="ignore", invalid="ignore"):
        values = _float32(tiled, framework) * scales[:, None, :, None]
    values = values.reshape(tiled.shape[0] * tiled.shape[1], -1)[:rows, :columns].reshape(q.shape)
    if dtype is None:
        return values
    from ampscale.fp8._cast import _dtype_of

    return _round_to(values, _dtype_of(dtype, framework), framework)


# ------------------------------------------------------------------------------ MX


def _mx_blocks(x: Any, block: int, framework: str, what: str) -> Any:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{what}: block must be a positive integer (MX uses 32); got {shown(block)}")
    columns = x.shape[-1] if x.ndim else 1
    if columns % block:
        raise ValueError(
            f"{what}: the last axis ({columns}) must be a multiple of block ({block}), as torchao requires"
        )
    return x.reshape(*x.shape[:-1], columns // block, block)


def _exponent_field(values: Any, framework: str) -> Any:
    """The biased exponent bits of float32 ``values`` (0 for zeros and subnormals)."""
    return (_bits32(values, framework) >> 23) & 0xFF


def _int_to_float(values: Any, framework: str) -> Any:
    return _astype(values, _namespace(framework).float32, framework)


def quantize_mx(x: Any, fmt: str = "e4m3fn", block: int = 32, rule: str = "floor") -> tuple[Any, Any]:
    """``(q, scales)``: ``x`` in FP8 with one E8M0 scale byte per ``block`` values of the last axis.

    Args:
        x: a float32 or bfloat16 array (NumPy, torch, JAX) whose last axis is a multiple of
            ``block``.
        fmt: the element format, ``"e4m3fn"`` or ``"e5m2"``.
        block: values per scale (OCP MX: 32).
        rule: how the scale is chosen (see this module's table).

    Returns:
        ``q`` of ``x``'s shape in ``fmt``, and ``scales`` (uint8 E8M0 bytes) of shape
        ``(*x.shape[:-1], x.shape[-1] // block)``.

    Raises:
        ValueError: an unknown ``fmt``, ``rule`` or ``block``, or a last axis that ``block``
            does not divide; TypeError: ``x`` of another dtype.
    """
    framework, _input = _check_x(x, "quantize_mx")
    if fmt not in _ELEMENT:
        raise ValueError(f"quantize_mx: fmt must be one of {sorted(_ELEMENT)}; got {shown(fmt)}")
    if rule not in MX_RULES:
        raise ValueError(f"quantize_mx: rule must be one of {list(MX_RULES)}; got {shown(rule)}")
    blocks = _float32(_mx_blocks(x, block, framework, "quantize_mx"), framework)
    bound = _check_fmt(fmt)
    target_pow2, mantissa_bits = _ELEMENT[fmt]
    ops = ops_for(make_fp8_config("ampscale", 1), framework, x.device if framework == "torch" else None)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if rule == "te_mxfp8":
            q, biased = _te_mxfp8(blocks, bound, framework)
        elif rule == "microxcaling":
            q, biased = _microxcaling(blocks, bound, target_pow2, mantissa_bits, fmt, framework, ops)
        elif rule == "rceil":
            q, biased = _torchao_rceil(blocks, bound, framework, ops)
        else:
            q, biased = _torchao_bits(blocks, bound, target_pow2, mantissa_bits, rule, framework)
        payload = _astype(_clip(q, bound, framework), fp8_dtype(fmt, framework), framework)
    return payload.reshape(x.shape), _uint8(biased, framework)


def _torchao_bits(blocks: Any, bound: float, target_pow2: int, mantissa_bits: int, rule: str, framework: str) -> Any:
    """torchao ``to_mx`` with ``FLOOR``, ``CEIL`` or ``EVEN``."""
    xp = _namespace(framework)
    amax = _amax_keeping_nan(blocks, framework)
    bits = _bits32(amax, framework)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if rule == "even":
        bits = (bits + (1 << (23 - mantissa_bits - 1))) & -8388608  # sign and exponent: 0xFF800000
    unbiased = ((bits >> 23) & 0xFF) - 127
    if rule == "ceil":
        unbiased = unbiased + _astype((bits & 0x7FFFFF) > 0, xp.int32, framework)
    unbiased = xp.clip(unbiased - target_pow2, -127, 128)
    biased = xp.where(nan, 255, unbiased + 127)
    # scale = 2**(biased - 127) as float32 bits, floored at the smallest normal (torchao keeps
    # 2**-127 out, as Triton flushes it); 255 reads as inf, and x / inf is 0 (nan for nan)
    scale = _from_bits(xp.where(biased == 0, 1 << 23, biased << 23), framework)
    return _divide(blocks, scale[..., None], framework), biased


def _torchao_rceil(blocks: Any, bound: float, framework: str, ops: Any) -> Any:
    """torchao ``to_mx`` with ``RCEIL`` in eager mode (``_to_mx_rceil``'s fallback)."""
    xp = _namespace(framework)
    amax = _amax_keeping_nan(blocks, framework)
    descale = ops.leave(ops.div(ops.enter(amax), ops.f32(bound)))
    bits = _bits32(descale, framework)
    magnitude = bits & 0x7FFFFFFF
    nan, inf = magnitude > 0x7F800000, magnitude == 0x7F800000
    exponent = xp.where(magnitude == 0, -127, xp.clip(ops.ceil_log2(ops.enter(descale)), -127, 127))
    biased = xp.where(nan, 255, xp.where(inf, 254, exponent + 127))
    # rcp: exp2(127 - e), 1.0 for e == 0, 2**-127 for an inf amax (254), descale (nan) for 255
    power = xp.where(biased == 0, 0, 127 - biased)
    return _times_power_of_two(blocks, power[..., None], biased[..., None] == 255, framework), biased


def _te_mxfp8(blocks: Any, bound: float, framework: str) -> Any:
    """TE's MXFP8: ``float_to_e8m0(amax * max_norm_rcp)``, data times ``exp2f_rcp(e)``."""
    xp = _namespace(framework)
    amax = _amax_dropping_nan(blocks, framework)
    rcp = np.float32(1.0 / bound)  # Quantized_Limits::max_norm_rcp: 1.0 / max_norm as a float
    biased = _astype(e8m0_encode(_exact_product(amax, rcp, framework), "up"), xp.int32, framework)
    # exp2f_rcp: 2**(127 - e) (254 gives 2**-127), nan for 255
    return _times_power_of_two(blocks, (127 - biased)[..., None], biased[..., None] == 255, framework), biased


def _times_power_of_two(values: Any, exponent: Any, nan: Any, framework: str) -> Any:
    """``values * 2**exponent`` (``exponent`` an int array in [-127, 128]; nan where ``nan``),
    as two products by normal powers of two: the same rounding as one product by ``2**exponent``
    (every intermediate is exact), and no subnormal factor, which XLA's CPU would read as 0
    (``inf * 2**-127`` would give nan there, where TE and torchao give inf)."""
    xp = _namespace(framework)
    first = exponent // 2
    second = exponent - first
    dtype = values.dtype
    out = values * _astype(_from_bits((first + 127) << 23, framework), dtype, framework)
    out = out * _astype(_from_bits((second + 127) << 23, framework), dtype, framework)
    return xp.where(nan, _astype(_from_bits(xp.full_like(exponent, 0x7FC00000), framework), dtype, framework), out)


def _exact_product(amax: Any, factor: np.float32, framework: str) -> Any:
    """``amax * factor`` in float32, a subnormal product kept on JAX too."""
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        from ampscale.fp8._exact import exact_mul

        return exact_mul(amax, jnp.float32(factor), jax.lax, jnp)
    return amax * factor


def _microxcaling(
    blocks: Any, bound: float, emax: int, mantissa_bits: int, fmt: str, framework: str, ops: Any
) -> tuple[Any, Any]:
    """microxcaling ``_quantize_mx`` (mx/mx_ops.py) with ``_shared_exponents(method="max")`` and
    ``_quantize_elemwise_core(round="nearest", saturate_normals=True, allow_denorm=True)``
    (mx/elemwise_ops.py), the same float32 operations in the same order."""
    xp = _namespace(framework)
    shared = ops.enter(_amax_keeping_nan(blocks, framework))
    # floor(log2(shared + FP32_MIN_NORMAL * (shared == 0))): a zero block reads 2**-126 (the
    # zero test by the bits, so that a block of subnormals is not read as zero on JAX)
    shared = ops.where(ops.is_zero(shared), ops.f32(2.0**-126), shared)
    exponent = ops.leave(ops.floor_log2(shared)) - np.float32(emax)  # integral: exact
    exponent = xp.where(exponent > 127, np.float32(math.nan), exponent)
    exponent = xp.where(exponent < -127, np.float32(-127.0), exponent)
    nan = xp.isnan(exponent)
    whole = _astype(xp.where(nan, 0, exponent), xp.int32, framework)
    # A / 2**shared_exp, as a product by 2**-shared_exp (the same value: both exact, one rounding)
    scaled = _times_power_of_two(blocks, -whole[..., None], nan[..., None], framework)
    # _quantize_elemwise_core: bits = mbits (sign and implicit bit included)
    shift = np.float32(2 ** (mantissa_bits + 2 - 2))
    min_exponent = np.float32(-(2 ** (_element_ebits(fmt) - 1)) + 2)
    private = ops.leave(ops.floor_log2(ops.enter(xp.where(scaled == 0, np.float32(1.0), xp.abs(scaled)))))
    private = xp.where(private < min_exponent, min_exponent, private)  # .clip(min=...): nan stays nan
    step = _power_of_two(private, framework)
    out = scaled / step * shift
    # nearest, ties away from zero; torch.sign(-0.0) is +0.0 (jnp.sign keeps the sign of a zero)
    sign = xp.where(
        out > 0, np.float32(1.0), xp.where(out < 0, np.float32(-1.0), xp.where(out == out, np.float32(0.0), out))
    )
    out = sign * xp.floor(xp.abs(out) + np.float32(0.5))
    out = _clip(out / shift * step, bound, framework)
    return out, xp.where(nan, 255, whole + 127)


def _element_ebits(fmt: str) -> int:
    return {"e4m3fn": 4, "e5m2": 5}[fmt]


def _power_of_two(exponent: Any, framework: str) -> Any:
    """``2 ** exponent`` for float32 integral exponents in [-127, 127] (nan kept), built from bits:
    ``torch.pow(2, e)`` is exact there, ``2**-127`` included."""
    xp = _namespace(framework)
    nan = xp.isnan(exponent)
    k = _astype(xp.where(nan, 0, exponent), xp.int32, framework)
    bits = xp.where(k >= -126, (k + 127) << 23, 1 << xp.clip(k + 149, 0, 22))
    return xp.where(nan, np.float32(math.nan), _from_bits(bits, framework))


def dequantize_mx(q: Any, scales: Any, block: int = 32, dtype: Any = None, rule: str = "floor") -> Any:
    """``q`` times ``2**(scale - 127)`` per block, into ``dtype`` (float32 when ``None``), as the
    anchor of ``rule`` does it: torchao ``to_dtype`` multiplies in ``dtype`` (the scale cast to
    it), TE ``f32(q) * exp2f(e)`` rounded to ``dtype``, microxcaling in float32."""
    framework = framework_of(q)
    if rule not in MX_RULES:
        raise ValueError(f"dequantize_mx: rule must be one of {list(MX_RULES)}; got {shown(rule)}")
    from ampscale.fp8._cast import _dtype_of

    target = _namespace(framework).float32 if dtype is None else _dtype_of(dtype, framework)
    blocks = _mx_blocks(q, block, framework, "dequantize_mx")
    xp = _namespace(framework)
    biased = _astype(scales, xp.int32, framework)[..., None]
    exponent, nan = biased - 127, biased == 255
    with np.errstate(over="ignore", invalid="ignore"):
        if rule in ("te_mxfp8", "microxcaling"):
            values = _times_power_of_two(_float32(blocks, framework), exponent, nan, framework)
            values = values if rule == "microxcaling" else _round_to(values, target, framework)
        else:  # torchao multiplies in the target dtype, the scale cast to it
            values = _times_power_of_two(_astype(blocks, target, framework), exponent, nan, framework)
    return values.reshape(q.shape)
