"""The operations the FP8 transition needs, vectorised over the slots of one array framework.

:func:`ampscale.fp8._transition.slot_transition` is written once against these operations.
:class:`Fp8ArrayOps` runs it on ``[N]`` arrays (and the ``[N, L]`` ring-buffer history) of
NumPy, JAX, torch or CuPy, on the device that holds them, with no host transfer: every
operation is an elementwise array operation, a one-element write per row of the history, or a
reduction over the history axis. The same operations are traced into Python and C by
:mod:`ampscale.fp8._codegen`, which must give the same bits.

Exactness: every float32 division and product is correctly rounded (IEEE), subnormals kept:
the framework's own operation on NumPy, torch and CuPy; on JAX, whose CPU code flushes
subnormal operands and results, integer arithmetic on the bits (:mod:`ampscale.fp8._exact`),
and comparisons that a subnormal could fool (``== 0``, ``> 0``, ``<``) by the bits too. The one
float64 rule (torchao's ``amax_to_scale``) is computed in float32 arithmetic that gives the
float64 result rounded once (see :meth:`div_wide`), so it needs no float64 (JAX without x64).
Bit operations (``pow2``, ``floor_log2``) go through a bitcast to int32; an array-API namespace,
which has no bitcast, gets the same bits from the standard's functions (:class:`_StandardOps`).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import numpy as np

from ampscale._config import FLOAT32_TINY, INT32_MAX
from ampscale.fp8 import _exact
from ampscale.fp8._config import FORMATS

__all__ = [
    "Fp8ArrayOps",
    "ceil_log2_thresholds",
    "floor_log2_thresholds",
    "framework_of",
    "make_ops",
    "namespace_of",
    "subnormal_floor_log2_thresholds",
]

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


@functools.lru_cache(maxsize=1)
def subnormal_floor_log2_thresholds() -> tuple[int, ...]:
    """For a subnormal float32 ``f * 2**-149`` whose fraction ``f`` has its leading bit at ``j``
    (0 to 22), the smallest ``f`` whose float32 ``log2`` rounds up to ``j - 148``; ``2**(j+1)``
    when none does. ``floor(log2(x))`` of a subnormal is ``j - 149``, plus one from there."""
    table = []
    for j in range(23):
        target = j - 148

        def rounds_up(fraction: int, target: int = target) -> bool:
            return float(np.float32(math.log2(fraction * 2.0**-149))) >= target

        low, high = 1 << j, 1 << (j + 1)
        while low < high:
            middle = (low + high) // 2
            if rounds_up(middle):
                high = middle
            else:
                low = middle + 1
        table.append(low)
    return tuple(table)


@functools.lru_cache(maxsize=1)
def ceil_log2_thresholds() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``ceil(log2(x))`` with a float32 ``log2`` (torchao's MX ``RCEIL`` on the CPU): for each
    biased exponent ``E`` of a normal ``x``, the smallest nonzero mantissa whose float32 ``log2``
    lies above ``E - 127`` (just above a power of two it rounds down onto the integer, and the
    ceiling stays there); then the same for subnormals, by the leading bit ``j`` of the fraction
    (base ``j - 149``). ``2**23`` (resp. ``2**(j+1)``) when none does."""

    def first_above(low: int, high: int, value_of: Any, target: float) -> int:
        while low < high:
            middle = (low + high) // 2
            if float(np.float32(math.log2(value_of(middle)))) > target:
                high = middle
            else:
                low = middle + 1
        return low

    normal = []
    for biased in range(256):
        if not 1 <= biased <= 254:
            normal.append(1 << 23)
            continue
        base = 2.0 ** (biased - 127)
        normal.append(first_above(1, 1 << 23, lambda m, base=base: base * (1 + m / 2**23), biased - 127))
    subnormal = [first_above((1 << j) + 1, 1 << (j + 1), lambda f: f * 2.0**-149, j - 149) for j in range(23)]
    return tuple(normal), tuple(subnormal)


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
        framework: ``"numpy"``, ``"jax"``, ``"torch"``, ``"cupy"`` or ``"array_api"`` (then
            use :func:`make_ops`, which gives the standard's operations).
        device: where constants are placed (a torch device; ignored elsewhere).
        slot_max: the largest finite value of each slot's format (for :meth:`div_wide`).
        donate: write the history in place (NumPy, torch, CuPy; JAX writes in place when the
            caller's ``jit`` donates the state).
        xp: the namespace of an ``"array_api"`` framework (``array_api_strict``, ...).
    """

    def __init__(
        self,
        framework: str,
        device: Any = None,
        slot_max: tuple[float, ...] = (),
        donate: bool = False,
        xp: Any = None,
    ) -> None:
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
        #: NumPy, torch, CuPy: the history is written in place (the caller gave up the old state;
        #: an array-API namespace may have immutable arrays, and JAX donates through its jit)
        self.donate = donate and framework not in ("jax", "array_api")
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

    def enter(self, x: Any) -> Any:
        """A float32 array as this object's float values (itself; JAX: its bit patterns)."""
        return x

    def leave(self, x: Any) -> Any:
        """This object's float values as a float32 array (:meth:`enter` undone)."""
        return x

    def true(self) -> Any:
        return True

    def int32(self, value: int) -> Any:
        return self.array(value, "int32")

    def _to_int(self, flags: Any) -> Any:
        if self.framework == "torch":
            return flags.to(self._int)
        return flags.astype(self._int)

    def _to_float(self, values: Any) -> Any:
        if self.framework == "torch":
            return values.to(self._float)
        return values.astype(self._float)

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
        """A step flag: ``True`` as it is (folded away), anything else as a bool array (a Python
        ``False`` too: torch's operations and the array API take no Python bool for an array)."""
        if value is True:
            return value
        xp = self.xp
        if self.framework == "torch":
            return xp.as_tensor(value, device=self.device).to(xp.bool)
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

    def is_zero(self, x: Any) -> Any:
        """``x == 0`` (either sign); a subnormal is not 0."""
        return x == self.f32(0.0)

    def positive(self, x: Any) -> Any:
        """``x > 0``; a positive subnormal is positive."""
        return x > self.f32(0.0)

    def less(self, a: Any, b: Any) -> Any:
        """``a < b`` for float32 values (nan compares false)."""
        return a < b

    def div(self, a: Any, b: Any) -> Any:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
            return a / b

    def mul(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return a * b

    def sub(self, a: Any, b: Any) -> Any:
        """``a - b`` for values that are integers, inf or nan (exact on every backend)."""
        return a - b

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
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            quotient = numerator / denominator
        below = denominator < floor32
        return xp.where(below, self._at_floor(numerator, eps), quotient)

    def _at_floor(self, numerator: Any, eps: float) -> Any:
        """``float32(fp8_max / eps)`` for each ``numerator``, one of the formats' maxima."""
        out = self.f32(math.nan)
        for bound in sorted(set(FORMATS.values())):
            out = self.where(numerator == self.f32(bound), self.f32(_narrow(bound / eps)), out)
        return out

    def pow2_mask(self, x: Any) -> Any:
        """TE's power-of-two scale: the float32's mantissa bits cleared."""
        return self._from_bits(self._bits(x) & self.array(_MASK, "int32"))

    def pow2_floor_log2(self, x: Any) -> Any:
        """torchao's ``exp2(floor(log2(x)))`` in float32 (see :func:`floor_log2_thresholds`)."""
        xp = self.xp
        bits = self._bits(x)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        threshold = self._take(list(floor_log2_thresholds()), biased)
        up = self._to_int(mantissa >= threshold)
        rounded = (biased + up) << 23
        normal = xp.logical_and(biased >= 1, biased <= 254)
        out = xp.where(normal, rounded, xp.where(biased == 0, self.int32(0), bits))
        return self._from_bits(out)

    def _take(self, table: list[int], index: Any) -> Any:
        """``table[index]`` elementwise, the table a cached int32 constant."""
        constant = self.array(table, "int32")
        if self.framework == "torch":
            return constant[index.long()]
        return self.xp.take(constant, index)

    def floor_log2(self, x: Any) -> Any:
        """``floor(log2(x))`` as float32, with torch's float32 ``log2`` (which rounds up just below
        a power of two): an integer, ``-inf`` for 0, inf for inf, nan for nan and negatives."""
        xp = self.xp
        bits = self._bits(x)
        magnitude = bits & 0x7FFFFFFF
        biased = magnitude >> 23
        mantissa = bits & 0x7FFFFF
        normal_up = self._to_int(mantissa >= self._take(list(floor_log2_thresholds()), biased))
        normal = biased - 127 + normal_up
        # a subnormal: the leading bit of its fraction, then the same rounding near each power
        lead = xp.zeros_like(mantissa)
        for j in range(1, 23):
            lead = lead + self._to_int(mantissa >= (1 << j))
        subnormal_up = self._to_int(mantissa >= self._take(list(subnormal_floor_log2_thresholds()), lead))
        subnormal = lead - 149 + subnormal_up
        value = self._to_float(xp.where(biased == 0, subnormal, normal))
        value = xp.where(magnitude == 0, self.f32(-math.inf), value)
        value = xp.where(magnitude == 0x7F800000, self.f32(math.inf), value)
        bad = (magnitude > 0x7F800000) | ((bits < 0) & (magnitude != 0))
        return xp.where(bad, self.f32(math.nan), value)

    def ceil_log2(self, x: Any) -> Any:
        """``ceil(log2(x))`` as int32 with torch's float32 ``log2``, for finite ``x > 0`` (others:
        0; the caller handles them)."""
        xp = self.xp
        bits = self._bits(x)
        magnitude = bits & 0x7FFFFFFF
        biased = magnitude >> 23
        mantissa = bits & 0x7FFFFF
        normal_table, subnormal_table = ceil_log2_thresholds()
        up = self._to_int((mantissa > 0) & (mantissa >= self._take(list(normal_table), biased)))
        lead = xp.zeros_like(mantissa)
        for j in range(1, 23):
            lead = lead + self._to_int(mantissa >= (1 << j))
        subnormal_up = self._to_int(mantissa >= self._take(list(subnormal_table), lead))
        return xp.where(biased == 0, lead - 149 + subnormal_up, biased - 127 + up)

    def exp2_abs(self, e: Any) -> Any:
        """``round(pow(2, |e|))`` in float32 for integral ``e`` (MS-AMP): inf past 2**127, nan kept."""
        xp = self.xp
        magnitude = xp.abs(e)
        small = magnitude < self.f32(128.0)
        whole = xp.where(small, magnitude, self.f32(0.0))
        k = whole.to(self._int) if self.framework == "torch" else whole.astype(self._int)  # exact: integral
        power = self._from_bits((k + 127) << 23)
        out = xp.where(small, power, self.f32(math.inf))
        return xp.where(xp.isnan(e), self.f32(math.nan), out)

    # ------------------------------------------------------------------ the history

    def _rows(self, n: int) -> Any:
        if self.framework == "torch":
            return self.xp.arange(n, device=self.device)
        return self.array(list(range(n)), "int32") if self.framework != "jax" else self.xp.arange(n)

    def push(self, history: Any, head: Any, value: Any, write: Any, twice: Any = False) -> Any:
        """The ring after writing ``value`` at ``head`` where ``write`` (and also at ``head - 1``
        where ``twice``): one element per row, nothing rolled.

        The old ``history`` is left as it was unless this ops object donates it (NumPy, torch
        and CuPy then write into it: see :func:`ampscale.fp8.update_state`).
        """
        xp = self.xp
        n, length = history.shape[0], history.shape[-1]
        rows = self._rows(n)
        if self.framework == "torch":
            index = head.long()
            previous = (index + (length - 1)) % length
        else:
            index = head
            previous = (head + (length - 1)) % length
        old = history[rows, index]
        new = value if write is True else xp.where(write, value, old)
        if self.framework == "jax":
            out = history.at[rows, index].set(new)
            if twice is not False:
                out = out.at[rows, previous].set(xp.where(twice, value, out[rows, previous]))
            return out
        out = history if self.donate else (history.clone() if self.framework == "torch" else history.copy())
        out[rows, index] = new
        if twice is not False:
            out[rows, previous] = xp.where(twice, value, out[rows, previous])
        return out

    def ring_next(self, head: Any, length: int) -> Any:
        """``(head + 1) % length``."""
        following = head + 1
        return self.xp.where(following == length, self.int32(0), following)

    def window_max(self, history: Any, nan_rule: str) -> Any:
        """The largest amax of each window (from 0, as ``fmaxf`` from 0 is): nan dropped
        (``fmaxf``) or propagated. Compared by the bits, so subnormals count on every backend."""
        xp = self.xp
        bits = self._bits(history)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        # nonnegative float32 values order as their bit patterns; nan, -0 and negatives count as 0
        clean = xp.where(nan | (bits < 0), self.int32(0), bits)
        if self.framework == "torch":
            top = xp.amax(clean, dim=-1)
            any_nan = xp.any(nan, dim=-1)
        else:
            top = xp.max(clean, axis=-1)
            any_nan = xp.any(nan, axis=-1)
        top = self._from_bits(top)
        if nan_rule == "drop":
            return top
        return xp.where(any_nan, self.f32(math.nan), top)


class _JaxBitsOps(Fp8ArrayOps):
    """:class:`Fp8ArrayOps` for JAX, whose float32 values are carried as their int32 bit patterns.

    XLA's CPU code flushes subnormals (denormals-are-zero and flush-to-zero), and LLVM turns
    some integer tests on a float's bits into float comparisons when the float is at hand, so
    that even a bit test can read a subnormal as 0. Here no float32 value exists between
    :meth:`enter` and :meth:`leave`: comparisons, selections, the history and the arithmetic
    (:mod:`ampscale.fp8._exact`) all run on int32 bits, which no floating-point mode touches.
    The only float operations left act on integral exponents (MS-AMP's rule), never subnormal.
    """

    def enter(self, x: Any) -> Any:
        return self._lax.bitcast_convert_type(self.xp.asarray(x, self.xp.float32), self.xp.int32)

    def leave(self, x: Any) -> Any:
        return self._lax.bitcast_convert_type(x, self.xp.float32)

    def f32(self, value: float) -> Any:
        return self.xp.asarray(_bits_of(value), self.xp.int32)

    def _bits(self, x: Any) -> Any:
        return x

    def _from_bits(self, bits: Any) -> Any:
        return bits

    def _to_float(self, values: Any) -> Any:
        return self.enter(values.astype(self.xp.float32))

    def isfinite(self, x: Any) -> Any:
        return (x & 0x7FFFFFFF) < 0x7F800000

    def isinf(self, x: Any) -> Any:
        return (x & 0x7FFFFFFF) == 0x7F800000

    def isnan(self, x: Any) -> Any:
        return (x & 0x7FFFFFFF) > 0x7F800000

    def is_zero(self, x: Any) -> Any:
        return _exact.is_zero(x, self.xp)

    def window_max(self, history: Any, nan_rule: str) -> Any:
        """The bit rule's window max (:meth:`Fp8ArrayOps.window_max`), with XLA's float ``max``
        first: an integer max over ``[N, L]`` is not vectorised on XLA's CPU (about 10x slower
        than the float one over 1024 x 2000 values).

        The float max is exact wherever the row's result is a positive normal number, inf or
        NaN: a normal maximum outranks every subnormal whether or not they are flushed, and XLA's
        ``max`` propagates NaN. Only where some row's result is 0, negative or subnormal (an
        unused slot, a history of zeros, an amax below 2**-126) does the bit rule run instead,
        for every row (one ``lax.cond``; both run under ``vmap``)."""
        xp = self.xp
        values = self.leave(history)
        if nan_rule == "drop":
            values = xp.where(xp.isnan(values), xp.float32(0.0), values)
        top = self.enter(xp.max(values, axis=-1))
        nan = self.isnan(top)
        # a positive normal or inf (bits 0x00800000..0x7F800000), or a nan of either sign
        sure = xp.all(((top >= 0x00800000) & (top <= 0x7F800000)) | nan)
        fast = xp.where(nan, self.f32(math.nan), top)
        return self._lax.cond(sure, lambda: fast, lambda: super(_JaxBitsOps, self).window_max(history, nan_rule))

    def positive(self, x: Any) -> Any:
        return (x > 0) & (x <= 0x7F800000)

    def less(self, a: Any, b: Any) -> Any:
        numbers = self.logical_not(self.isnan(a)) & self.logical_not(self.isnan(b))
        return numbers & (_exact.float_key(a, self.xp) < _exact.float_key(b, self.xp))

    def div(self, a: Any, b: Any) -> Any:
        return _exact.exact_div_bits(a, b, self._lax, self.xp)

    def mul(self, a: Any, b: Any) -> Any:
        return _exact.exact_mul_bits(a, b, self._lax, self.xp)

    def sub(self, a: Any, b: Any) -> Any:
        # integral exponents only (MS-AMP's rule): exact, and never subnormal
        return self.enter(self.leave(a) - self.leave(b))

    def flush(self, x: Any) -> Any:
        return self.xp.where((x & 0x7F800000) == 0, 0, x)

    def div_wide(self, numerator: Any, denominator: Any, eps: float) -> Any:
        floor32 = self.f32(float32_ceiling(eps))
        at_floor = self._at_floor(numerator, eps)
        return self.xp.where(self.less(denominator, floor32), at_floor, self.div(numerator, denominator))

    def exp2_abs(self, e: Any) -> Any:
        xp = self.xp
        magnitude = xp.abs(self.leave(e))  # an integral exponent, inf or nan: never subnormal
        small = magnitude < 128.0
        k = xp.where(small, magnitude, 0.0).astype(xp.int32)
        power = xp.where(small, (k + 127) << 23, 0x7F800000)
        return xp.where(self.isnan(e), _bits_of(math.nan), power)


def _bits_of(value: float) -> int:
    return int(np.asarray(value, np.float32).view(np.int32))


class _StandardOps(Fp8ArrayOps):
    """:class:`Fp8ArrayOps` for an array-API namespace (``array_api_strict``, ...): the standard's
    functions only.

    The standard has no bitcast, so the rules written on a float32's bits find its exponent by
    ``searchsorted`` in the table of the 254 normal powers of two (exact: comparisons only), and
    its mantissa bits as ``(|x| / 2**e - 1) * 2**23``, exact for a normal ``x`` (a division by a
    power of two, then Sterbenz); a subnormal's fraction is ``|x| * 2**126 * 2**23``, exact. It
    has no scatter either: the ring's one write per row is a ``where`` over the row's positions.
    The results equal the bit rules' bit for bit (``tests/test_fp8_array_api.py``).
    """

    def _to_int(self, flags: Any) -> Any:
        return self.xp.astype(flags, self._int)

    def _to_float(self, values: Any) -> Any:
        return self.xp.astype(values, self._float)

    def as_bool(self, value: Any) -> Any:
        if value is True:
            return value
        xp = self.xp
        return xp.astype(xp.asarray(value), xp.bool)

    def _exponent(self, x: Any) -> tuple[Any, Any, Any]:
        """``(index, normal, mantissa)`` of ``|x|``: ``2**(index - 126)`` is the largest normal
        power of two not above it (index clipped to 0..253), ``normal`` whether ``|x|`` is a
        finite normal number, and ``mantissa`` its 23 mantissa bits as an exact float32 integer
        (meaningful where ``normal``)."""
        xp = self.xp
        powers = self.array(_NORMAL_POWERS, "float32")  # 2**-126 .. 2**127, and inf last
        magnitude = xp.abs(x)
        flat = xp.reshape(magnitude, (-1,))
        below = xp.searchsorted(powers[:-1], flat, side="right") - 1  # -1: zero or subnormal
        index = xp.reshape(xp.clip(below, 0, len(_NORMAL_POWERS) - 2), x.shape)
        power = xp.reshape(xp.take(powers, xp.reshape(index, (-1,))), x.shape)
        normal = xp.logical_and(xp.reshape(below >= 0, x.shape), xp.isfinite(x))
        with np.errstate(invalid="ignore"):  # inf / inf and nan lanes, replaced by the callers
            mantissa = (magnitude / power - self.f32(1.0)) * self.f32(2.0**23)
        return index, normal, mantissa

    def _table(self, table: Any, index: Any) -> Any:
        """``table[index]`` elementwise, the table (integers below 2**24) a float32 constant."""
        xp = self.xp
        constant = self.array([float(t) for t in table], "float32")
        return xp.reshape(xp.take(constant, xp.reshape(index, (-1,))), index.shape)

    def pow2_mask(self, x: Any) -> Any:
        """TE's rule: zero and subnormals give +-0, inf and nan inf with the sign (the exponent
        kept, the mantissa cleared)."""
        xp = self.xp
        index, normal, _mantissa = self._exponent(x)
        power = self._table(_NORMAL_POWERS, index)
        out = xp.where(normal, power, self.f32(0.0))
        out = xp.where(xp.logical_not(xp.isfinite(x)), self.f32(math.inf), out)
        return xp.copysign(out, x)

    def pow2_floor_log2(self, x: Any) -> Any:
        """torchao's rule: zero and subnormals give +0 (the sign dropped, as the bit rule's
        arithmetic drops it), inf and nan themselves."""
        xp = self.xp
        index, normal, mantissa = self._exponent(x)
        up = mantissa >= self._table(floor_log2_thresholds()[1:255], index)
        out = xp.where(up, self._table(_NORMAL_POWERS, index + 1), self._table(_NORMAL_POWERS, index))
        out = xp.where(normal, out, self.f32(0.0))
        return xp.where(xp.isfinite(x), out, x)

    def floor_log2(self, x: Any) -> Any:
        xp = self.xp
        index, normal, mantissa = self._exponent(x)
        normal_value = index - 126 + self._to_int(mantissa >= self._table(floor_log2_thresholds()[1:255], index))
        with np.errstate(over="ignore", invalid="ignore"):
            fraction = xp.abs(x) * self.f32(2.0**126) * self.f32(2.0**23)  # a subnormal's, exact
        lead = xp.zeros(x.shape, dtype=self._int)
        for j in range(1, 23):
            lead = lead + self._to_int(fraction >= self.f32(float(1 << j)))
        subnormal_up = self._to_int(fraction >= self._table(subnormal_floor_log2_thresholds(), lead))
        value = self._to_float(xp.where(normal, normal_value, lead - 149 + subnormal_up))
        value = xp.where(x == self.f32(0.0), self.f32(-math.inf), value)
        value = xp.where(xp.isinf(x), self.f32(math.inf), value)
        bad = xp.logical_or(xp.isnan(x), x < self.f32(0.0))  # -0 is not below 0: -inf, as above
        return xp.where(bad, self.f32(math.nan), value)

    def ceil_log2(self, x: Any) -> Any:
        raise TypeError("block and MX scaling run on NumPy, JAX, torch and CuPy arrays, not an array-API namespace")

    def exp2_abs(self, e: Any) -> Any:
        xp = self.xp
        magnitude = xp.abs(e)
        small = magnitude < self.f32(128.0)
        k = xp.astype(xp.where(small, magnitude, self.f32(0.0)), self._int)  # exact: integral
        out = xp.where(small, self._table(_NORMAL_POWERS, k + 126), self.f32(math.inf))
        return xp.where(xp.isnan(e), self.f32(math.nan), out)

    def push(self, history: Any, head: Any, value: Any, write: Any, twice: Any = False) -> Any:
        xp = self.xp
        length = history.shape[-1]
        positions = xp.expand_dims(self.array(list(range(length)), "int32"), axis=0)

        def at(index: Any, flag: Any) -> Any:
            hit = positions == xp.expand_dims(index, axis=-1)
            if flag is True:
                return hit
            return xp.logical_and(hit, xp.expand_dims(xp.asarray(flag), axis=-1))

        column = xp.expand_dims(value, axis=-1)
        out = history if write is False else xp.where(at(head, write), column, history)
        if twice is not False:
            previous = (head + (length - 1)) % length
            out = xp.where(at(previous, twice), column, out)
        return out

    def window_max(self, history: Any, nan_rule: str) -> Any:
        xp = self.xp
        nan = xp.isnan(history)
        # from +0, as fmaxf from 0 is: nan, -0 and negatives count as +0 (the bit rule's order)
        clean = xp.where(xp.logical_or(nan, history <= self.f32(0.0)), self.f32(0.0), history)
        top = xp.max(clean, axis=-1)
        if nan_rule == "drop":
            return top
        return xp.where(xp.any(nan, axis=-1), self.f32(math.nan), top)


def make_ops(
    framework: str,
    device: Any = None,
    slot_max: tuple[float, ...] = (),
    donate: bool = False,
    xp: Any = None,
) -> Fp8ArrayOps:
    """The FP8 operations of ``framework`` (JAX's carry float32 values as bits; an array-API
    namespace ``xp`` gets the standard's functions only)."""
    kinds = {"jax": _JaxBitsOps, "array_api": _StandardOps}
    kind = kinds.get(framework, Fp8ArrayOps)
    return kind(framework, device=device, slot_max=slot_max, donate=donate, xp=xp)


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
