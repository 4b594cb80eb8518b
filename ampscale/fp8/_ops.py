"""The operations the FP8 transition needs, vectorised over the slots of one array framework.

:func:`ampscale.fp8._transition.slot_transition` is written once against these operations.
:class:`Fp8ArrayOps` runs it on ``[N]`` arrays (and the ``[N, L]`` history) of NumPy, JAX,
torch or CuPy, on the device that holds them, with no host transfer: every operation is an
elementwise array operation or a reduction over the history axis. The same operations are
traced into Python and C by :mod:`ampscale.fp8._codegen`, which must give the same bits.

Exactness: every float32 division and product is the framework's own float32 operation
(correctly rounded, IEEE); the one float64 rule (torchao's ``amax_to_scale``) is computed in
float32 arithmetic that gives the float64 result rounded once (see :meth:`div_wide`), so it
needs no float64 (JAX without x64). Bit operations (``pow2``) go through a bitcast to int32.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import numpy as np

from ampscale._config import FLOAT32_TINY, INT32_MAX

__all__ = ["Fp8ArrayOps", "floor_log2_thresholds", "framework_of"]

#: 0xFF800000 as an int32: sign and exponent bits of a float32
_MASK = -8388608
#: every normal float32 power of two, 2**-126 to 2**127, then inf (the power past 2**127)
_NORMAL_POWERS = [math.ldexp(1.0, e) for e in range(-126, 128)] + [math.inf]


@functools.lru_cache(maxsize=1)
def floor_log2_thresholds() -> tuple[int, ...]:
    """For each biased float32 exponent ``E``, the smallest mantissa whose float32 ``log2``
    rounds up to the next integer (``2**23`` when none does).

    ``exp2(floor(log2(s)))`` in float32 (torchao's ``_round_scale_down_to_power_of_2``) is
    ``2**(E - 127)`` for most ``s``, but just below a power of two the float32 ``log2`` rounds
    up to the integer and the result is the next power: ``1023.99994 -> 1024``. The rounding is
    that of a correctly rounded ``log2f`` (torch's CPU kernel agrees on every float32 value
    near a power of two, ``tests/test_fp8_presets.py``). Found by bisection on ``math.log2``.
    """
    table = []
    for biased in range(256):
        if not 1 <= biased <= 254:
            table.append(1 << 23)
            continue
        target = biased - 126

        def rounds_up(mantissa: int, target: int = target, biased: int = biased) -> bool:
            value = struct.unpack("<f", struct.pack("<I", (biased << 23) | mantissa))[0]
            return float(np.float32(math.log2(value))) >= target

        low, high = 0, 1 << 23  # rounds_up(high) is taken as true: the answer is in [low, high]
        while low < high:
            middle = (low + high) // 2
            if rounds_up(middle):
                high = middle
            else:
                low = middle + 1
        table.append(low)
    return tuple(table)


def framework_of(array: Any) -> str:
    """``"numpy"``, ``"jax"``, ``"torch"``, ``"cupy"``, from the array's type, or ``"array_api"``
    for an array of any other namespace of the Python array API standard (``array_api_strict``)."""
    module = type(array).__module__.split(".")[0]
    if module in ("jaxlib", "jax"):
        return "jax"
    if module == "torch":
        return "torch"
    if module == "cupy":
        return "cupy"
    if isinstance(array, (np.ndarray, np.generic)):
        return "numpy"
    if hasattr(array, "__array_namespace__"):
        return "array_api"
    raise TypeError(
        "FP8 state arrays must be NumPy, JAX, torch or CuPy arrays, or arrays of an array-API "
        f"namespace; got {type(array).__name__}"
    )


def namespace_of(array: Any) -> Any:
    """The array-API namespace of an ``"array_api"`` array (``None`` for the four frameworks)."""
    if framework_of(array) != "array_api":
        return None
    return array.__array_namespace__()


class Fp8ArrayOps:
    """The FP8 transition's operations on ``[N]`` arrays of one framework and device.

    Args:
        framework: ``"numpy"``, ``"jax"``, ``"torch"``, ``"cupy"`` or ``"array_api"``.
        device: where constants are placed (a torch device; ignored elsewhere).
        slot_max: the largest finite value of each slot's format (for :meth:`div_wide`).
        xp: the namespace of an ``"array_api"`` framework (``array_api_strict``, ...): only the
            standard's functions are used on it, so the bit rules (``pow2``) are computed
            from a table of powers of two instead of a bitcast, which the standard lacks.
    """

    def __init__(self, framework: str, device: Any = None, slot_max: tuple[float, ...] = (), xp: Any = None) -> None:
        self.framework = framework
        self.device = device
        self.slot_max = slot_max
        if framework == "array_api":
            if xp is None:
                raise ValueError("framework 'array_api' needs its namespace: pass xp=")
            self.xp: Any = xp
        elif framework == "jax":
            import jax
            import jax.numpy as jnp

            self.xp = jnp
            self._lax = jax.lax
        elif framework == "torch":
            import torch

            self.xp = torch
        elif framework == "cupy":
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self._float = self.xp.float32
        self._int = self.xp.int32
        # JAX traces: a constant made inside one trace must not outlive it
        self._constants: dict[Any, Any] | None = None if framework == "jax" else {}

    # ------------------------------------------------------------------ constants and casts

    def new_array(self, values: Any, dtype: str) -> Any:
        """A new array of ``values`` (a number or nested lists) as float32 or int32."""
        xp = self.xp
        kind = self._float if dtype == "float32" else self._int
        if self.framework == "torch":
            if isinstance(values, list):
                return xp.tensor(values, dtype=kind, device=self.device)
            return xp.full((), values, dtype=kind, device=self.device)  # a fill, not a copy
        return xp.asarray(values, dtype=kind)

    def array(self, values: Any, dtype: str) -> Any:
        """A constant array of ``values`` (a number or a flat list), made once per ops object on
        eager frameworks (never modified: no host-to-device copy per step)."""
        if self._constants is None:
            return self.new_array(values, dtype)
        key = (dtype, tuple(values) if isinstance(values, list) else values)
        cached = self._constants.get(key)
        if cached is None:
            cached = self.new_array(values, dtype)
            if not (isinstance(values, float) and values != values):
                self._constants[key] = cached
        return cached

    def f32(self, value: float) -> Any:
        return self.array(value, "float32")

    def true(self) -> Any:
        return True

    def int32(self, value: int) -> Any:
        return self.array(value, "int32")

    def _to_int(self, flags: Any) -> Any:
        if self.framework == "torch":
            return flags.to(self._int)
        if self.framework == "array_api":
            return self.xp.astype(flags, self._int)
        return flags.astype(self._int)

    def _bits(self, x: Any) -> Any:
        if self.framework == "jax":
            return self._lax.bitcast_convert_type(x, self.xp.int32)
        return x.view(self._int)

    def _from_bits(self, bits: Any) -> Any:
        if self.framework == "jax":
            return self._lax.bitcast_convert_type(bits, self.xp.float32)
        return bits.view(self._float)

    # ------------------------------------------------------------------ logic

    def as_bool(self, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        xp = self.xp
        if self.framework == "torch":
            return xp.as_tensor(value, device=self.device).to(xp.bool)
        if self.framework == "array_api":
            return xp.astype(xp.asarray(value), xp.bool)
        return xp.asarray(value).astype(bool)

    def logical_not(self, a: Any) -> Any:
        if isinstance(a, bool):
            return not a
        return self.xp.logical_not(a)

    def logical_and(self, a: Any, b: Any) -> Any:
        if a is True:
            return b
        if b is True:
            return a
        return self.xp.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return self.xp.logical_or(a, b)

    def where(self, condition: Any, a: Any, b: Any) -> Any:
        if condition is True:
            return a
        if condition is False:  # a skipped step's Python flag (the array API wants arrays)
            return b
        xp = self.xp
        if self.framework == "torch":
            # a 0-d flag with [N] values: torch.where broadcasts, but wants tensors of one dtype
            return xp.where(xp.as_tensor(condition, device=self.device), a, b)
        return xp.where(condition, a, b)

    def saturating_add(self, value: Any, flag: Any) -> Any:
        room = value < INT32_MAX
        step = room if flag is True else self.xp.logical_and(flag, room)
        return value + self._to_int(step)

    # ------------------------------------------------------------------ float32 arithmetic

    def isfinite(self, x: Any) -> Any:
        return self.xp.isfinite(x)

    def isinf(self, x: Any) -> Any:
        return self.xp.isinf(x)

    def isnan(self, x: Any) -> Any:
        return self.xp.isnan(x)

    def div(self, a: Any, b: Any) -> Any:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
            return a / b

    def mul(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return a * b

    def flush(self, x: Any) -> Any:
        """0 where ``|x|`` is subnormal (XLA's CPU flush-to-zero), else ``x``."""
        xp = self.xp
        return self.where(xp.abs(x) < self.f32(FLOAT32_TINY), self.f32(0.0), x)

    def div_wide(self, numerator: Any, denominator: Any, eps: float) -> Any:
        """``float32(float64(numerator) / max(float64(denominator), eps))``, nan kept.

        With float32 operands, the float64 quotient rounded to float32 is the correctly
        rounded float32 quotient (53 >= 2*24 + 2), so a float32 division gives it; only the
        floor ``eps`` (a float64 value) needs its own constant, ``float32(fp8_max / eps)``.
        """
        xp = self.xp
        floor32 = self.f32(float32_ceiling(eps))
        at_floor = self.array([_narrow(m / eps) for m in self.slot_max], "float32")
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            quotient = numerator / denominator
        below = denominator < floor32
        return xp.where(below, at_floor, quotient)

    def pow2_mask(self, x: Any) -> Any:
        """TE's power-of-two scale: the float32's mantissa bits cleared."""
        if self.framework == "array_api":
            return self._standard_pow2(x, floor_log2=False)
        return self._from_bits(self._bits(x) & self.array(_MASK, "int32"))

    def pow2_floor_log2(self, x: Any) -> Any:
        """torchao's ``exp2(floor(log2(x)))`` in float32 (see :func:`floor_log2_thresholds`)."""
        if self.framework == "array_api":
            return self._standard_pow2(x, floor_log2=True)
        xp = self.xp
        bits = self._bits(x)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        table = self.array(list(floor_log2_thresholds()), "int32")
        if self.framework == "torch":
            threshold = table[biased.long()]
        else:
            threshold = xp.take(table, biased)
        up = self._to_int(mantissa >= threshold)
        rounded = (biased + up) << 23
        normal = xp.logical_and(biased >= 1, biased <= 254)
        out = xp.where(normal, rounded, xp.where(biased == 0, self.int32(0), bits))
        return self._from_bits(out)

    def _standard_pow2(self, x: Any, floor_log2: bool) -> Any:
        """:meth:`pow2_mask` / :meth:`pow2_floor_log2` with the standard's functions only.

        The array API has no bitcast, so the exponent field is found by ``searchsorted`` in
        the table of the 254 normal powers of two (exact: comparisons only), and the mantissa
        bits as ``(|x| / 2**e - 1) * 2**23``, exact for a normal ``x`` (a division by a power of
        two, then Sterbenz). Zero and subnormals give +-0 (mask) or +0 (floor_log2, which also
        drops the sign, as its bit arithmetic does); inf and nan give inf with the sign (mask:
        the exponent kept, the mantissa cleared) or themselves (floor_log2).
        """
        xp = self.xp
        powers = self.array(_NORMAL_POWERS, "float32")  # 2**-126 .. 2**127, and inf last
        magnitude = xp.abs(x)
        flat = xp.reshape(magnitude, (-1,))
        below = xp.searchsorted(powers[:-1], flat, side="right") - 1  # -1: zero or subnormal
        index = xp.clip(below, 0, len(_NORMAL_POWERS) - 2)
        power = xp.reshape(xp.take(powers, index), x.shape)
        normal = xp.reshape(below >= 0, x.shape)
        special = xp.logical_not(xp.isfinite(x))
        zero = self.f32(0.0)
        if not floor_log2:
            out = xp.where(normal, power, zero)
            out = xp.where(special, self.f32(math.inf), out)
            return xp.copysign(out, x)
        with np.errstate(invalid="ignore"):  # inf / inf and nan lanes, replaced below
            mantissa = (magnitude / power - self.f32(1.0)) * self.f32(2.0**23)
        thresholds = self.array([float(t) for t in floor_log2_thresholds()[1:255]], "float32")
        up = mantissa >= xp.reshape(xp.take(thresholds, index), x.shape)
        bumped = xp.reshape(xp.take(powers, xp.reshape(index, (-1,)) + 1), x.shape)
        out = xp.where(up, bumped, power)
        out = xp.where(normal, out, zero)
        return xp.where(special, x, out)

    # ------------------------------------------------------------------ the history

    def push(self, history: Any, value: Any, write: Any) -> Any:
        """``history[:, 1:] + value`` where ``write``, else ``history`` (oldest first)."""
        xp = self.xp
        if self.framework == "torch":
            shifted = xp.cat([history[..., 1:], value[..., None]], dim=-1)
        elif self.framework == "array_api":
            shifted = xp.concat([history[..., 1:], xp.expand_dims(value, axis=-1)], axis=-1)
            if write is True:
                return shifted
            condition = xp.expand_dims(write, axis=-1) if getattr(write, "ndim", 0) else write
            return self.where(condition, shifted, history)
        else:
            shifted = xp.concatenate([history[..., 1:], value[..., None]], axis=-1)
        if write is True:
            return shifted
        condition = write[..., None] if getattr(write, "ndim", 0) else write
        return self.where(condition, shifted, history)

    def window_max(self, history: Any, nan_rule: str) -> Any:
        """The largest amax of each window: nan dropped (``fmaxf``) or propagated."""
        xp = self.xp
        nan = xp.isnan(history)
        clean = xp.where(nan, self.f32(0.0), history)
        if self.framework == "torch":
            top = xp.amax(clean, dim=-1)
            any_nan = xp.any(nan, dim=-1)
        else:
            top = xp.max(clean, axis=-1)
            any_nan = xp.any(nan, axis=-1)
        if nan_rule == "drop":
            return top
        return xp.where(any_nan, self.f32(math.nan), top)


def float32_ceiling(value: float) -> float:
    """The smallest float32 value >= ``value``: for a float32 ``d``, ``d < value`` exactly when
    ``d < float32_ceiling(value)``."""
    rounded = np.float32(value)
    if float(rounded) < value:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def _narrow(value: float) -> float:
    """A float64 value rounded to float32 (inf past its range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))
