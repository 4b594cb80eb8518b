"""The few operations the state machine needs, for host scalars and for array namespaces.

Host operations and checkpoints layer: above the code generator, whose transition ``HostOps``
runs.

:func:`ampscale._core.transition` is written once against this small interface. ``HostOps``
runs it on Python scalars, for backends whose state lives in host memory (NumPy, PyTorch on
CPU): a handful of Python operations instead of dozens of tiny array kernels. ``ArrayOps``
runs it with any array-API namespace (JAX, CuPy, PyTorch on a GPU, array-api-strict), so the
state never leaves the device.

Both compute ``scale * factor`` the same way: in float64 (exactly what torch's kernels do with
their ``double`` factors), rounded once to the scale's dtype. With float32 factors the float64
product of two float32 values is exact and the division is rounded innocuously (53 >= 2*24 + 2
bits), so the result equals a float32 multiply or divide bit for bit. The exact rules::

    grow(s)   = c = round(s * growth)                  # round: to the scale dtype, nearest even
                skip:  c if c is finite and c <= max_value else s
                clamp: min(c, max_value)
    shrink(s) = max(round(s * backoff), min_value)     # "divide": round(s / growth)

``min_value``/``max_value`` are ``min_scale``/``max_scale`` rounded to the scale dtype, or that
dtype's smallest normal / largest finite value when unset, so the scale is never 0, inf or nan.
A floor that is a normal number also keeps backends that flush subnormals to zero (XLA on
CPU, GPUs) in agreement with the host.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ampscale._codegen import python_transition
from ampscale._config import FLOAT32_MAX, FLOAT32_TINY, INT32_MAX, INT32_MIN, _round_to
from ampscale._errors import AmpscaleWarning

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale._config import ScalerConfig

__all__ = ["ArrayOps", "HostOps", "PlainNamespace", "host_ops"]


class HostOps:
    """State-machine operations on host scalars: Python or NumPy ``bool``/``int``/``float``.

    Args:
        config: the scaler's settings.
        scale_type: the type scales are stored as (``float``, ``numpy.float32``, ...).
        int_type: the type counters are stored as (``int``, ``numpy.int32``).

    Values that do not change keep their object, so a step creates only the few scalars that
    move; float32 rounding of candidate scales is memoised (scales take few distinct values).
    :attr:`run` is the transition traced and emitted as one Python function that uses these
    operations' ``grow`` and ``shrink`` (:mod:`ampscale._codegen`); the scaler calls it
    instead of interpreting the transition.
    """

    def __init__(self, config: ScalerConfig, scale_type: Any = float, int_type: Any = int) -> None:
        self.config = config
        self.scale_type = scale_type
        self.int_type = int_type
        self._ints: dict[int, Any] = {}
        self._rounded: dict[float, float] = {}
        self._grown: dict[Any, Any] = {}
        self._shrunk: dict[Any, Any] = {}
        #: ``run(values, finite, loss_finite) -> (next_values, floor_event)``: the transition
        #: with these operations, compiled into one function (same results, several times faster)
        self.run = python_transition(config, self.grow, self.shrink)
        #: ``run_split(scale, growth_tracker, rest, finite, loss_finite) -> (scale,
        #: growth_tracker, rest, floor_event)``: :attr:`run` with the scale and the tracker apart
        #: (``rest``: the other fields, a tuple), for callers that keep those two elsewhere
        self.run_split: Any = self.run.split  # type: ignore[attr-defined]
        #: ``run_split_ok(scale, growth_tracker, rest)``: ``run_split(scale, growth_tracker,
        #: rest, True, True)`` (gradients and loss finite, the usual step) in fewer operations
        self.run_split_ok: Any = self.run.split_ok  # type: ignore[attr-defined]

    @staticmethod
    def as_bool(value: Any) -> bool:
        return bool(value)

    @staticmethod
    def logical_not(a: bool) -> bool:
        return not a

    @staticmethod
    def logical_and(a: bool, b: bool) -> bool:
        return a and b

    @staticmethod
    def logical_or(a: bool, b: bool) -> bool:
        return a or b

    @staticmethod
    def where(condition: bool, a: Any, b: Any) -> Any:
        return a if condition else b

    def int32(self, value: int) -> Any:
        constant = self._ints.get(value)
        if constant is None:
            constant = self._ints[value] = self.int_type(value)
        return constant

    @staticmethod
    def false() -> bool:
        return False

    @staticmethod
    def saturating_increment(value: Any) -> Any:
        return value + 1 if value < INT32_MAX else value

    @staticmethod
    def saturating_decrement(value: Any) -> Any:
        return value - 1 if value > INT32_MIN else value

    @staticmethod
    def saturating_add(value: Any, flag: bool) -> Any:
        return value + 1 if flag and value < INT32_MAX else value

    def scale_constant(self, value: float) -> float:
        return value

    def _round(self, value: float) -> float:
        rounded = self._rounded.get(value)
        if rounded is None:
            if len(self._rounded) > 4096:
                self._rounded.clear()
            rounded = self._rounded[value] = _round_to(value, self.config.scale_dtype)
        return rounded

    def grow(self, scale: Any) -> Any:
        # The transition asks for both candidates every step; the scale rarely moves.
        grown = self._grown.get(scale)
        if grown is None:
            if len(self._grown) > 1024:
                self._grown.clear()
            grown = self._grown[scale] = self._grow(scale)
        return grown

    def shrink(self, scale: Any) -> Any:
        shrunk = self._shrunk.get(scale)
        if shrunk is None:
            if len(self._shrunk) > 1024:
                self._shrunk.clear()
            shrunk = self._shrunk[scale] = self._shrink(scale)
        return shrunk

    def _grow(self, scale: Any) -> Any:
        c = self.config
        candidate = self._round(float(scale) * c.growth_value)
        if c.ceiling == "skip":
            if not math.isfinite(candidate) or candidate > c.max_value:
                return scale
        elif candidate > c.max_value:  # inf included: the ceiling is finite
            candidate = c.max_value
        return self.scale_type(candidate)

    def _shrink(self, scale: Any) -> Any:
        c = self.config
        wide = float(scale)
        candidate = self._round(wide / c.backoff_value if c.backoff_rule == "divide" else wide * c.backoff_value)
        if candidate < c.min_value:  # 0 included: the floor is positive
            candidate = c.min_value
        return self.scale_type(candidate)


def host_ops(config: ScalerConfig) -> HostOps:
    """The :class:`HostOps` of ``config``, made once and kept on it (compiling the transition
    costs far more than a step; every host backend and the drop-ins share one)."""
    ops = config._cache.get("host")
    if ops is None:
        ops = config._cache["host"] = HostOps(config)
    return ops  # type: ignore[no-any-return]


class ArrayOps:
    """State-machine operations with an array-API namespace, on 0-d arrays of one device.

    Args:
        config: the scaler's settings.
        xp: the array namespace.
        device: where new constants are placed (``None`` lets the namespace decide).
        has_float64: whether the namespace and device support float64 arithmetic.
        cache_constants: keep each constant (``0``, ``False``, the floor, ...) as one array,
            made once, instead of a new array per transition. For eager device backends
            (torch, CuPy), where making an array from a host value is a host-to-device copy
            that waits for the device; never for tracing backends (JAX), where a cached
            constant would be a tracer of a finished trace. Constants are never modified.
    """

    def __init__(
        self, config: ScalerConfig, xp: Any, device: Any, has_float64: bool, cache_constants: bool = False
    ) -> None:
        self.config = config
        self.xp = xp
        self.device = device
        self._constants: dict[tuple[Any, ...], Any] | None = {} if cache_constants else None
        if config.scale_dtype == "float64" and not has_float64:
            # float32 stands in where it gives the same trajectory (see float32_stands_in)
            config = float32_stand_in(config)
            self.config = config
        self.storage = xp.float64 if config.scale_dtype == "float64" else xp.float32
        self.arithmetic = xp.float64 if has_float64 else xp.float32
        if not has_float64 and config.factor_precision == "float64":
            inexact = [
                name
                for name, value in (("growth_factor", config.growth_value), ("backoff", config.backoff_value))
                if _round_to(value, "float32") != value
            ]
            if inexact and config.dynamic:
                warnings.warn(
                    f"{', '.join(inexact)} of preset {config.preset!r} is not exactly representable "
                    "in float32 and this backend has no float64: scale updates are computed in "
                    "float32 and may differ from the reference system in the last bit",
                    AmpscaleWarning,
                    stacklevel=4,
                )
        self.growth = self._const(config.growth_value, self.arithmetic)
        self.backoff = self._const(config.backoff_value, self.arithmetic)
        self.min_value = self.scale_constant(config.min_value)
        self.max_value = self.scale_constant(config.max_value)

    def _const(self, value: Any, dtype: Any) -> Any:
        constants = self._constants
        if constants is None:
            return self.xp.asarray(value, dtype=dtype, device=self.device)
        key = (type(value), value, dtype)
        constant = constants.get(key)
        if constant is None:
            constant = constants[key] = self.xp.asarray(value, dtype=dtype, device=self.device)
        return constant

    def as_bool(self, value: Any) -> Any:
        xp = self.xp
        if isinstance(value, bool):
            return self._const(value, xp.bool)
        if value.dtype != xp.bool:
            return xp.astype(value, xp.bool)
        return value

    def logical_not(self, a: Any) -> Any:
        return self.xp.logical_not(a)

    def logical_and(self, a: Any, b: Any) -> Any:
        return self.xp.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return self.xp.logical_or(a, b)

    def where(self, condition: Any, a: Any, b: Any) -> Any:
        return self.xp.where(condition, a, b)

    def int32(self, value: int) -> Any:
        return self._const(value, self.xp.int32)

    def false(self) -> Any:
        return self._const(False, self.xp.bool)

    def saturating_increment(self, value: Any) -> Any:
        xp = self.xp
        return value + xp.astype(value < INT32_MAX, xp.int32)

    def saturating_decrement(self, value: Any) -> Any:
        xp = self.xp
        return value - xp.astype(value > INT32_MIN, xp.int32)

    def saturating_add(self, value: Any, flag: Any) -> Any:
        xp = self.xp
        return value + xp.astype(xp.logical_and(flag, value < INT32_MAX), xp.int32)

    def scale_constant(self, value: float) -> Any:
        return self._const(value, self.storage)

    def grow(self, scale: Any) -> Any:
        xp, c = self.xp, self.config
        with np.errstate(over="ignore"):  # NumPy-backed namespaces warn on the intended inf
            candidate = xp.astype(xp.astype(scale, self.arithmetic) * self.growth, self.storage)
        if c.ceiling == "skip":
            fits = xp.logical_and(xp.isfinite(candidate), candidate <= self.max_value)
            return xp.where(fits, candidate, scale)
        return xp.minimum(candidate, self.max_value)

    def shrink(self, scale: Any) -> Any:
        xp, c = self.xp, self.config
        wide = xp.astype(scale, self.arithmetic)
        product = wide / self.backoff if c.backoff_rule == "divide" else wide * self.backoff
        candidate = xp.astype(product, self.storage)
        return xp.maximum(candidate, self.min_value)


def _is_power_of_two(value: float) -> bool:
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


def float32_stand_in(config: ScalerConfig) -> ScalerConfig:
    """``config`` with ``scale_dtype="float32"``, for a float64 preset on a backend without float64.

    Allowed where the trajectory is provably the same: power-of-two factors and every bound
    and initial scale exactly a normal float32. Products of normal powers of two stay exact in
    float32 while they stay in its range, and rounding is then exact in both dtypes. What can
    still differ is only where the float64 scale would leave float32's normal range (past
    2**127 with no ``max_scale``, or below 2**-126 with no ``min_scale``), where the float32
    scale stops at float32's largest finite or smallest normal value instead; there every
    scaled loss or every unscaled gradient is already non-finite in float32 arithmetic.

    Raises:
        ValueError: the float32 trajectory could differ; names the values that prevent it.
    """
    reasons = []
    for name, value in (("growth_factor", config.growth_value), ("backoff_factor", config.backoff_value)):
        if not _is_power_of_two(value):
            reasons.append(f"{name}={value!r} is not a power of two")
    bounds: tuple[tuple[str, float | None], ...] = (
        ("init_scale", config.init_scale),
        ("min_scale", config.min_scale),
        ("max_scale", config.max_scale),
    )
    for name, bound in bounds:
        if bound is None:
            continue
        if _round_to(float(bound), "float32") != float(bound) or not FLOAT32_TINY <= float(bound) <= FLOAT32_MAX:
            reasons.append(f"{name}={bound!r} is not exactly a normal float32")
    if reasons:
        raise ValueError(
            f"scale_dtype='float64' (preset {config.preset!r}) needs float64, which this backend lacks "
            "(for JAX: jax.config.update('jax_enable_x64', True)), and float32 would not give the same "
            f"trajectory: {'; '.join(reasons)}. Enable float64, or pass scale_dtype='float32'"
        )
    cached = config._cache.get("float32-stand-in")
    if cached is None:
        cached = config._cache["float32-stand-in"] = config.replace(scale_dtype="float32")
    return cached  # type: ignore[no-any-return]


class PlainNamespace:
    """The few array-API functions :class:`ArrayOps` uses, bound to a framework's own calls.

    array_api_compat's wrappers may add a copy or a dtype conversion per call (for promotion
    rules the transition never relies on: its operands already share dtypes); on a GPU each is
    a kernel launch, so the eager device backends (torch, CuPy) run the transition on these.

    Args:
        module: the framework's top-level module (``torch``, ``cupy``): its dtypes and its
            ``where``, ``logical_*``, ``isfinite``, ``minimum`` and ``maximum``.
        bool_dtype: the module's boolean dtype.
        convert: ``convert(x, dtype)``, a conversion (called only when the dtype differs).
        full: ``full(value, dtype, device)``, a new 0-d array; a fill kernel rather than a
            host-to-device copy, which would wait for the device.
    """

    def __init__(
        self,
        module: Any,
        bool_dtype: Any,
        convert: Callable[[Any, Any], Any],
        full: Callable[[Any, Any, Any], Any],
    ) -> None:
        self.bool = bool_dtype
        self.int32, self.float32, self.float64 = module.int32, module.float32, module.float64
        self.where, self.isfinite = module.where, module.isfinite
        self.logical_and, self.logical_or, self.logical_not = module.logical_and, module.logical_or, module.logical_not
        self.minimum, self.maximum = module.minimum, module.maximum
        self._convert = convert
        self._full = full

    def astype(self, x: Any, dtype: Any) -> Any:
        return x if x.dtype == dtype else self._convert(x, dtype)

    def asarray(self, value: Any, dtype: Any, device: Any = None) -> Any:
        return self._full(value, dtype, device)
