"""Float32 arithmetic that keeps subnormals where the backend flushes them (XLA on the CPU).

XLA's CPU code runs with flush-to-zero and denormals-are-zero: a subnormal operand reads as 0
(``1e-40 == 0`` is true) and a subnormal result becomes 0 (``1 / 3e38`` gives 0). NumPy, torch,
the emitted Python and the emitted C keep them, and so do the anchors on their own devices (TE's
``reciprocal(3e38) * 448`` is ``1.4933e-36``, from the subnormal ``3.3e-39``). So that JAX gives
the same bits, the FP8 transition's float32 operations run on JAX as integer arithmetic on the
bit patterns: IEEE 754 binary32 multiplication and division, rounded to nearest even once,
subnormal operands and results included, inf and nan as IEEE says. Integer operations are
exact on every XLA backend, so the results do not depend on the device's floating-point mode.

Each function takes and returns float32 arrays of one framework (``xp`` is its namespace and
``lax`` JAX's ``lax``, used for ``clz``, bitcasts and the division loop). They are written for
JAX, where only the ``[N]`` values of the FP8 state (and block scales) go through them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["exact_div", "exact_div_bits", "exact_mul", "exact_mul_bits", "float_key", "from_bits", "is_zero", "to_bits"]

_INT32_MIN = -(2**31)
_MAG = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000


def to_bits(x: Any, lax: Any, xp: Any) -> Any:
    """The int32 bit pattern of float32 ``x`` (a bitcast: subnormal bits kept)."""
    return lax.bitcast_convert_type(x, xp.int32)


def from_bits(bits: Any, lax: Any, xp: Any) -> Any:
    """The float32 of int32 ``bits``."""
    return lax.bitcast_convert_type(bits, xp.float32)


def is_zero(bits: Any, xp: Any) -> Any:
    """Whether float32 ``bits`` are ``+0`` or ``-0`` (a subnormal is not zero).

    Written as two signed comparisons on purpose: LLVM rewrites the obvious ``(bits &
    0x7fffffff) == 0`` into a float comparison with 0 when the float is at hand, and XLA's CPU
    runs that comparison with denormals-are-zero, which reads a subnormal as 0.
    """
    return ~((bits > 0) | ((bits ^ _INT32_MIN) > 0))


def float_key(bits: Any, xp: Any) -> Any:
    """An int32 that orders float32 values as ``<`` does (``-0`` and ``+0`` equal); nan excluded."""
    return xp.where(bits >= 0, bits, -(bits & _MAG))


def _unpack(bits: Any, lax: Any, xp: Any) -> tuple[Any, Any, Any]:
    """``(sign, exponent, significand)`` of finite nonzero values: ``|x| = M * 2**(E - 23)`` with
    ``M`` in ``[2**23, 2**24)``; a subnormal is normalised (its leading bit moved up)."""
    sign = bits < 0
    magnitude = bits & _MAG
    biased = magnitude >> 23
    fraction = magnitude & 0x7FFFFF
    subnormal = biased == 0
    # clz of a 23-bit fraction is 9 to 31; a zero fraction (a zero, handled by the caller) gives 24
    shift = xp.where(subnormal, lax.clz(fraction) - 8, 0)
    significand = xp.where(subnormal, fraction << shift, fraction | 0x800000)
    exponent = xp.where(subnormal, -126 - shift, biased - 127)
    return sign, exponent, significand


def _pack(sign: Any, exponent: Any, significand: Any, sticky: Any, xp: Any) -> Any:
    """Round ``significand * 2**(exponent - 25)`` (26 bits, leading bit 25; ``sticky``: nonzero
    bits below them) to float32, to nearest even, with subnormals and overflow to inf."""
    # a normal result keeps 24 bits (drops 2); a subnormal one keeps the bits above 2**-149
    drop = xp.clip(2 + xp.maximum(-126 - exponent, 0), 2, 27)
    kept = significand >> drop
    guard = (significand >> (drop - 1)) & 1
    below = (significand & ((1 << (drop - 1)) - 1)) != 0
    round_up = (guard == 1) & (below | sticky | ((kept & 1) == 1))
    kept = kept + round_up.astype(xp.int32)
    normal = exponent >= -126
    # a carry out of the significand moves into the exponent field by itself
    bits = xp.where(normal, ((exponent + 127) << 23) + (kept - 0x800000), kept)
    bits = xp.where(normal & ((exponent > 127) | (bits >= _INF_BITS)), _INF_BITS, bits)
    return xp.where(sign, bits | _INT32_MIN, bits)


def _special(a_bits: Any, b_bits: Any, xp: Any) -> tuple[Any, ...]:
    a_mag, b_mag = a_bits & _MAG, b_bits & _MAG
    return (
        (a_bits < 0) != (b_bits < 0),
        a_mag > _INF_BITS,
        b_mag > _INF_BITS,
        a_mag == _INF_BITS,
        b_mag == _INF_BITS,
        is_zero(a_bits, xp),
        is_zero(b_bits, xp),
    )


def _signed(sign: Any, bits: int, xp: Any) -> Any:
    return xp.where(sign, bits | _INT32_MIN, bits)


def exact_mul(a: Any, b: Any, lax: Any, xp: Any) -> Any:
    """``a * b`` in float32, correctly rounded, subnormals kept."""
    return from_bits(exact_mul_bits(to_bits(a, lax, xp), to_bits(b, lax, xp), lax, xp), lax, xp)


def exact_div(a: Any, b: Any, lax: Any, xp: Any) -> Any:
    """``a / b`` in float32, correctly rounded, subnormals kept."""
    return from_bits(exact_div_bits(to_bits(a, lax, xp), to_bits(b, lax, xp), lax, xp), lax, xp)


def exact_mul_bits(a_bits: Any, b_bits: Any, lax: Any, xp: Any) -> Any:
    """:func:`exact_mul` on int32 bit patterns, returning bits."""
    a_bits, b_bits = xp.broadcast_arrays(a_bits, b_bits)
    sign, a_nan, b_nan, a_inf, b_inf, a_zero, b_zero = _special(a_bits, b_bits, xp)
    _, a_exp, a_sig = _unpack(a_bits, lax, xp)
    _, b_exp, b_sig = _unpack(b_bits, lax, xp)
    # the 48-bit product of two 24-bit significands, from 12-bit limbs (every partial fits int32)
    a_high, a_low = a_sig >> 12, a_sig & 0xFFF
    b_high, b_low = b_sig >> 12, b_sig & 0xFFF
    cross = a_high * b_low + a_low * b_high
    low = a_low * b_low + ((cross & 0xFFF) << 12)
    high = a_high * b_high + (cross >> 12) + (low >> 24)
    low = low & 0xFFFFFF
    top = high >= 0x800000  # product in [2**47, 2**48)
    significand = xp.where(top, (high << 2) | (low >> 22), (high << 3) | (low >> 21))
    sticky = xp.where(top, low & 0x3FFFFF, low & 0x1FFFFF) != 0
    exponent = a_exp + b_exp + top.astype(xp.int32)
    bits = _pack(sign, exponent, significand, sticky, xp)
    bits = xp.where(a_zero | b_zero, _signed(sign, 0, xp), bits)
    bits = xp.where(a_inf | b_inf, _signed(sign, _INF_BITS, xp), bits)
    return xp.where(a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf), _NAN_BITS, bits)


def exact_div_bits(a_bits: Any, b_bits: Any, lax: Any, xp: Any) -> Any:
    """:func:`exact_div` on int32 bit patterns, returning bits."""
    a_bits, b_bits = xp.broadcast_arrays(a_bits, b_bits)
    sign, a_nan, b_nan, a_inf, b_inf, a_zero, b_zero = _special(a_bits, b_bits, xp)
    _, a_exp, a_sig = _unpack(a_bits, lax, xp)
    _, b_exp, b_sig = _unpack(b_bits, lax, xp)
    b_sig = xp.where(b_zero, 0x800000, b_sig)  # no division by 0 in the loop (the result is special)
    at_least = a_sig >= b_sig
    remainder = xp.where(at_least, a_sig, a_sig << 1)  # remainder / b_sig in [1, 2), < 2**25
    exponent = a_exp - b_exp - (~at_least).astype(xp.int32)

    def one_bit(_: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        quotient, remainder = carry
        bit = remainder >= b_sig
        remainder = xp.where(bit, remainder - b_sig, remainder) << 1
        return (quotient << 1) | bit.astype(xp.int32), remainder

    # 26 quotient bits (leading bit 25) by restoring division; the remainder is the sticky bit
    quotient, remainder = lax.fori_loop(0, 26, one_bit, (xp.zeros_like(remainder), remainder), unroll=True)
    bits = _pack(sign, exponent, quotient, remainder != 0, xp)
    bits = xp.where(a_zero | b_inf, _signed(sign, 0, xp), bits)
    bits = xp.where(a_inf | b_zero, _signed(sign, _INF_BITS, xp), bits)
    return xp.where(a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf), _NAN_BITS, bits)
