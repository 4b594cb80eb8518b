"""Scaler settings: the presets, the frozen :class:`ScalerConfig`, and its validation.

Foundation layer: it imports nothing of ampscale but the errors.

Every system ampscale reproduces is described by the same handful of orthogonal settings; a
preset is only a row of defaults (see ``docs/presets.md`` for the table and the sources).

=================== =====================================================================
setting             meaning
=================== =====================================================================
counter_rule        ``"equal"``: grow when the good-step counter reaches the interval
                    exactly (a counter already past it stalls); ``"modulo"``: the counter
                    wraps at the interval (jmp, MindSpore); ``"at_least"``: grow on any
                    count at or past the interval (tf.keras 2).
interval_offset     steps added to ``growth_interval`` (flax grows on the N+1-th step).
first_growth_delay  extra steps before the first growth after an overflow or at the start
                    (DeepSpeed's ``stable_interval`` rule: first growth after N+1 steps).
hysteresis_mode     how the overflow budget refills: ``"cumulative"`` only when the scale
                    grows (Megatron, DeepSpeed), ``"consecutive"`` on every finite step (apex
                    kernel, DeepSpeed ``consecutive_hysteresis``), ``"every_n"`` on every
                    finite step and after each backoff (Paddle ``decr_every_n_nan_or_inf``).
backoff_rule        ``"multiply"`` by ``backoff_factor``, or ``"divide"`` by
                    ``growth_factor`` (the single-factor systems: jmp, DeepSpeed, apex).
ceiling             ``"skip"``: a growth that would leave the finite range of the scale's
                    dtype or pass ``max_scale`` is skipped (torch, jmp); ``"clamp"``: the
                    grown scale is clamped to ``max_scale`` (flax: float32 max, apex: 2**24),
                    or to the largest finite value of the scale's dtype when there is none
                    (Keras and Megatron would reach inf there).
scale_dtype         the dtype the scale is stored in: float32, or float64 for systems that
                    keep it in a Python float (DeepSpeed, apex).
factor_precision    the precision of the factors in ``scale * factor``: float64 where the
                    system multiplies by a double (torch's kernels, DeepSpeed, apex), float32
                    where it multiplies two float32 values (jmp, flax, Megatron, Keras).
grad_dtype          ``"keep"``: each gradient is unscaled in its own dtype (every preset);
                    ``"promote"``: float16 and bfloat16 gradients are unscaled into float32
                    copies, as jmp's ``unscale`` returns them (its scale is a float32 array).
=================== =====================================================================

The scale never leaves ``[smallest normal, largest finite]`` of its dtype (float32: about
1.2e-38 to 3.4e38): with no ``min_scale`` a backoff stops at the smallest normal value (torch's
own scale would go on through the subnormals to 0, and then divide by it), and with no
``max_scale`` a ``"clamp"`` growth stops at the largest finite value (Keras's would reach inf).
So the scale is never 0, inf or nan, and ``on_floor`` sees a run that reaches the bottom.
Every value is validated as it will be used, after rounding to the scale's dtype and the
factors' precision.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import struct
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, Literal, TypeAlias

from ampscale._errors import AmpscaleWarning

__all__ = [
    "PRESETS",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "FloorEvent",
    "OnFloor",
    "Preset",
    "ScalerConfig",
    "make_config",
    "torch_growth_interval",
]

FLOAT32_MAX: Final = float.fromhex("0x1.fffffep+127")
FLOAT32_TINY: Final = float.fromhex("0x1p-126")
FLOAT64_MAX: Final = float.fromhex("0x1.fffffffffffffp+1023")
FLOAT64_TINY: Final = float.fromhex("0x1p-1022")
#: the range a scale of each dtype stays in, whatever the preset: [smallest normal, largest finite]
SCALE_RANGE: Final = {"float32": (FLOAT32_TINY, FLOAT32_MAX), "float64": (FLOAT64_TINY, FLOAT64_MAX)}
INT32_MAX: Final = 2**31 - 1
INT32_MIN: Final = -(2**31)

Mode: TypeAlias = Literal["dynamic", "static", "guard"]
CounterRule: TypeAlias = Literal["equal", "modulo", "at_least"]
HysteresisMode: TypeAlias = Literal["cumulative", "consecutive", "every_n"]
BackoffRule: TypeAlias = Literal["multiply", "divide"]
Ceiling: TypeAlias = Literal["skip", "clamp"]
Precision: TypeAlias = Literal["float32", "float64"]


@dataclasses.dataclass(frozen=True)
class FloorEvent:
    """What an ``on_floor`` callback receives when the scale is stuck at its floor.

    Attributes:
        scale: the scale at the floor (a Python float).
        consecutive: overflowing steps in a row at the floor, this one included.
        step: the number of ``update`` calls made before this one.
        reason: ``"loss"`` when the scaled loss itself was not finite, else ``"gradients"``.
    """

    scale: float
    consecutive: int
    step: int
    reason: str


OnFloor: TypeAlias = "Literal['ignore', 'warn', 'raise'] | Callable[[FloorEvent], None]"

_CHOICES: Final[dict[str, tuple[str, ...]]] = {
    "mode": ("dynamic", "static", "guard"),
    "counter_rule": ("equal", "modulo", "at_least"),
    "hysteresis_mode": ("cumulative", "consecutive", "every_n"),
    "backoff_rule": ("multiply", "divide"),
    "ceiling": ("skip", "clamp"),
    "scale_dtype": ("float32", "float64"),
    "factor_precision": ("float32", "float64"),
    "grad_dtype": ("keep", "promote"),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """One system's scaling policy, as defaults for every setting.

    Attributes:
        name: the preset's name, as passed to ``create_scaler(preset=...)``.
        system: the system whose trajectory the preset reproduces.
        source: where its rule lives (repository and path).
        defaults: the value of every setting the preset fixes.
        single_factor: the system has one factor: backoff divides by ``growth_factor``, and a
            ``backoff_factor`` other than ``1 / growth_factor`` cannot be expressed.
    """

    name: str
    system: str
    source: str
    defaults: Mapping[str, Any]
    single_factor: bool = False


def _preset(name: str, system: str, source: str, single_factor: bool = False, **defaults: Any) -> Preset:
    base: dict[str, Any] = {
        "mode": "dynamic",
        "hysteresis": 1,
        "hysteresis_mode": "cumulative",
        "min_scale": None,
        "max_scale": None,
        "counter_rule": "equal",
        "interval_offset": 0,
        "first_growth_delay": 0,
        "backoff_rule": "multiply",
        "ceiling": "clamp",
        "scale_dtype": "float32",
        "factor_precision": "float32",
        "on_floor": "ignore",
        "floor_patience": 1,
        "axis_name": None,
        "grad_dtype": "keep",
    }
    base.update(defaults)
    if single_factor:
        base["backoff_rule"] = "divide"
        base.setdefault("backoff_factor", 1.0 / base["growth_factor"])
    return Preset(name, system, source, base, single_factor)


PRESETS: Final[dict[str, Preset]] = {
    p.name: p
    for p in [
        _preset(
            "torch",
            "torch.amp.GradScaler",
            "pytorch/pytorch:torch/amp/grad_scaler.py, aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            ceiling="skip",
            factor_precision="float64",
        ),
        _preset(
            "jmp",
            "jmp.DynamicLossScale",
            "google-deepmind/jmp:jmp/_src/loss_scale.py",
            single_factor=True,
            init_scale=2.0**15,
            growth_factor=2.0,
            growth_interval=2000,
            min_scale=1.0,
            counter_rule="modulo",
            ceiling="skip",
        ),
        _preset(
            "flax",
            "flax.training.dynamic_scale.DynamicScale",
            "google/flax:flax/training/dynamic_scale.py",
            init_scale=65536.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            interval_offset=1,
            min_scale=FLOAT32_TINY,
            max_scale=FLOAT32_MAX,
        ),
        _preset(
            "keras",
            "keras.optimizers.LossScaleOptimizer (Keras 3)",
            "keras-team/keras:keras/src/optimizers/loss_scale_optimizer.py",
            init_scale=2.0**15,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
        ),
        _preset(
            "megatron",
            "megatron.core.optimizer.grad_scaler.DynamicGradScaler",
            "NVIDIA/Megatron-LM:megatron/core/optimizer/grad_scaler.py",
            init_scale=2.0**32,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=2,
            min_scale=1.0,
        ),
        _preset(
            "deepspeed",
            "DeepSpeed ZeRO DynamicLossScaler",
            "deepspeedai/DeepSpeed:deepspeed/runtime/fp16/loss_scaler.py",
            single_factor=True,
            init_scale=2.0**16,
            growth_factor=2.0,
            growth_interval=1000,
            hysteresis=2,
            min_scale=1.0,
            first_growth_delay=1,
            scale_dtype="float64",
            factor_precision="float64",
            on_floor="raise",
        ),
        _preset(
            "apex",
            "apex.amp LossScaler (dynamic)",
            "NVIDIA/apex:apex/amp/scaler.py (cb65b8ed^)",
            single_factor=True,
            init_scale=2.0**16,
            growth_factor=2.0,
            growth_interval=2000,
            hysteresis_mode="consecutive",
            max_scale=2.0**24,
            scale_dtype="float64",
            factor_precision="float64",
        ),
        _preset(
            "paddle",
            "paddle.amp.GradScaler (dygraph)",
            "PaddlePaddle/Paddle:python/paddle/amp/grad_scaler.py",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis_mode="every_n",
        ),
        _preset(
            "mindspore",
            "mindspore.amp.DynamicLossScaler",
            "mindspore-ai/mindspore:mindspore/python/mindspore/amp.py",
            single_factor=True,
            init_scale=2.0**24,
            growth_factor=2.0,
            growth_interval=2000,
            min_scale=1.0,
            counter_rule="modulo",
            ceiling="skip",
        ),
        _preset(
            "tf_keras",
            "tf.keras.mixed_precision.LossScaleOptimizer (Keras 2)",
            "keras-team/tf-keras:tf_keras/mixed_precision/loss_scale_optimizer.py",
            single_factor=True,
            init_scale=2.0**15,
            growth_factor=2.0,
            growth_interval=2000,
            min_scale=1.0,
            counter_rule="at_least",
            ceiling="skip",
        ),
    ]
}

_SETTINGS: Final = (
    "mode",
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "on_floor",
    "floor_patience",
    "hysteresis_mode",
    "counter_rule",
    "interval_offset",
    "first_growth_delay",
    "backoff_rule",
    "ceiling",
    "scale_dtype",
    "factor_precision",
    "axis_name",
    "grad_dtype",
)


def _round_to(value: float, dtype: str) -> float:
    """Round a Python float to float32 (nearest even; inf when out of range) or keep float64."""
    if dtype == "float64" or not math.isfinite(value):
        return value
    try:
        rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
    return rounded


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: the settings a torch (or apex) state dict holds, in numbers of its own
TORCH_SETTINGS: Final = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
#: the settings of the reaction to a scale stuck at its floor: they do not shape the trajectory
FLOOR_SETTINGS: Final = ("on_floor", "floor_patience")
#: the settings that shape the scale's trajectory beside :data:`TORCH_SETTINGS` (the agreement
#: across devices and the gradients' dtype shape no trajectory either)
RULE_SETTINGS: Final = tuple(
    name for name in _SETTINGS if name not in (*TORCH_SETTINGS, *FLOOR_SETTINGS, "axis_name", "grad_dtype")
)
#: settings that are real numbers (``None`` allowed where the setting says so), and integers
REAL_SETTINGS: Final = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")
INT_SETTINGS: Final = ("growth_interval", "hysteresis", "floor_patience", "interval_offset", "first_growth_delay")
_DIGITS_SHOWN: Final = 24
_CHARACTERS_SHOWN: Final = 200
_LONG_NUMBER: Final = re.compile(rf"\d{{{_DIGITS_SHOWN + 1},}}")


def shown(value: Any) -> str:
    """``repr(value)`` for an error or warning message, abbreviated where it would be huge.

    Every message that quotes a value the user gave (an argument, a loaded checkpoint's entry)
    formats it through here: a JSON checkpoint may hold an integer of any length, whose plain
    ``repr`` is thousands of digits, or raises ``ValueError`` beyond Python's 4300-digit limit
    for converting integers to text; that ``ValueError`` would replace the error being raised.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            text = str(int(value))
        except ValueError:  # more digits than Python converts to text (sys.set_int_max_str_digits)
            sign = "a negative " if value < 0 else "an "
            return f"{sign}integer of about {abs(int(value)).bit_length() * 0.30103:.0f} digits"
        if len(text.lstrip("-")) > _DIGITS_SHOWN:
            return f"{text[:12]}...{text[-4:]} (an integer of {len(text.lstrip('-'))} digits)"
    try:
        text = repr(value)
    except ValueError:  # a container of such an integer (a list, a dict)
        return f"a {type(value).__name__} holding an integer too long to print"
    text = _LONG_NUMBER.sub(lambda m: f"{m[0][:12]}...{m[0][-4:]} ({len(m[0])} digits)", text)  # inside a list
    if len(text) > _CHARACTERS_SHOWN:
        return f"{text[: _CHARACTERS_SHOWN - 40]}... ({type(value).__name__}, {len(text)} characters)"
    return text


def plain_number(value: Any, integral: bool) -> Any:
    """``value`` as a plain Python ``int`` (``integral``) or ``float``, if it is a number of that kind.

    NumPy scalars (``np.int64(10)`` from a sweep grid, ``np.float32(2.0)``) and 0-d NumPy arrays
    of a numeric dtype (a value loaded from an ``.npz``) become plain numbers, once, so that
    everything downstream (the transition, the code generator, JSON) sees Python numbers.
    Anything else (bools, strings, non-integral values for an integer, ``None``) is returned
    unchanged, for the validation to name. Raises ``OverflowError`` for an integer too large for
    a float (the caller names the setting).
    """
    if value is None or isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "dtype"):
        if value.dtype.kind not in ("iu" if integral else "iuf"):
            return value  # a bool, complex or other array: refused by the validation
        value = value.item()  # a 0-d array or a NumPy scalar: its Python value
        if isinstance(value, bool):
            return value
    if integral:
        return int(value) if isinstance(value, numbers.Integral) else value
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """The validated, immutable settings of a scaler (static under ``jax.jit``).

    Build one with :func:`ampscale.create_scaler`; the fields mirror its keyword arguments,
    already resolved against the preset. Fields whose names start with ``_`` are derived.
    """

    preset: str
    mode: str
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    on_floor: Any
    floor_patience: int
    hysteresis_mode: str
    counter_rule: str
    interval_offset: int
    first_growth_delay: int
    backoff_rule: str
    ceiling: str
    scale_dtype: str
    factor_precision: str
    axis_name: Hashable | None = None
    grad_dtype: str = "keep"

    # Derived values, computed once in __post_init__.
    interval: int = dataclasses.field(init=False, repr=False)
    initial_scale: float = dataclasses.field(init=False, repr=False)
    growth_value: float = dataclasses.field(init=False, repr=False)
    backoff_value: float = dataclasses.field(init=False, repr=False)
    floor_value: float = dataclasses.field(init=False, repr=False)
    min_value: float = dataclasses.field(init=False, repr=False)
    max_value: float = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)
    _cache: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:  # computed once: configs are hashed on every jitted call
        return self._hash

    def __post_init__(self) -> None:
        _normalise(self)
        _validate(self)
        set_ = object.__setattr__
        storage = self.scale_dtype
        set_(self, "interval", self.growth_interval + self.interval_offset)
        set_(self, "growth_value", _round_to(float(self.growth_factor), self.factor_precision))
        if self.backoff_rule == "divide":
            set_(self, "backoff_value", self.growth_value)
        else:
            set_(self, "backoff_value", _round_to(float(self.backoff_factor), self.factor_precision))
        lowest, highest = SCALE_RANGE[storage]
        # the bounds in use: the settings rounded to the scale's dtype, else the dtype's range
        min_value = lowest if self.min_scale is None else _round_to(float(self.min_scale), storage)
        max_value = highest if self.max_scale is None else _round_to(float(self.max_scale), storage)
        set_(self, "min_value", min_value)
        set_(self, "max_value", max_value)
        set_(self, "floor_value", min_value)
        set_(self, "initial_scale", 1.0 if self.mode == "guard" else _round_to(float(self.init_scale), storage))
        _validate_rounded(self)
        set_(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare)))
        set_(self, "_cache", {})

    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = ScalerConfig(**state)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, getattr(fresh, f.name))

    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (``mode == "dynamic"``)."""
        return self.mode == "dynamic"

    @property
    def scales(self) -> bool:
        """Whether losses and gradients are multiplied at all (false in ``guard`` mode)."""
        return self.mode != "guard"

    def settings(self) -> dict[str, Any]:
        """The settings as plain values (``on_floor`` callables appear as ``"callback"``)."""
        out = {name: getattr(self, name) for name in _SETTINGS if name != "axis_name"}
        if callable(out["on_floor"]):
            out["on_floor"] = "callback"
        return out

    def replace(self, **settings: Any) -> ScalerConfig:
        """Return a copy with some settings changed, validated like the original."""
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}; accepted: {list(_SETTINGS)}")
        if "growth_factor" in settings and "backoff_factor" not in settings and self.backoff_rule == "divide":
            try:
                growth = plain_number(settings["growth_factor"], integral=False)
            except OverflowError:
                growth = None  # refused by the validation, naming growth_factor
            settings["backoff_factor"] = 1.0 / growth if _is_real(growth) and growth != 0 else 0.5
        return dataclasses.replace(self, **settings)


def _fail(setting: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"{setting} must be {accepted}; got {shown(value)}")


_REAL_ACCEPTED: Final = {
    "init_scale": "a finite number > 0",
    "growth_factor": "a finite number > 1",
    "backoff_factor": "a number in the open interval (0, 1)",
    "min_scale": "None or a finite number > 0",
    "max_scale": "None or a number > 0",
}


def _normalise(c: ScalerConfig) -> None:
    """Turn every numeric setting into a plain Python number, once, before it is validated.

    The one place settings change type: NumPy scalars and 0-d arrays become ``int`` or
    ``float``, ``max_scale=inf`` becomes ``None`` (no ceiling), string settings become plain
    ``str``. An integer too large for a float is refused here, naming the setting.
    """
    set_ = object.__setattr__
    for name in REAL_SETTINGS:
        value = getattr(c, name)
        try:
            plain = plain_number(value, integral=False)
        except OverflowError:
            raise _fail(name, value, _REAL_ACCEPTED[name] + " (this integer is too large for a float)") from None
        if plain is not value:
            set_(c, name, plain)
    if isinstance(c.max_scale, float) and math.isinf(c.max_scale) and c.max_scale > 0:
        set_(c, "max_scale", None)
    for name in INT_SETTINGS:
        value = getattr(c, name)
        plain = plain_number(value, integral=True)
        if plain is not value:
            set_(c, name, plain)
    for name in ("preset", *_CHOICES):
        value = getattr(c, name)
        if isinstance(value, str) and type(value) is not str:
            set_(c, name, str(value))


def _validate(c: ScalerConfig) -> None:
    """Raise ``ValueError`` naming the first setting outside its accepted range."""
    if c.preset not in PRESETS:
        raise _fail("preset", c.preset, f"one of {sorted(PRESETS)}")
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        if value not in choices:
            raise _fail(name, value, f"one of {list(choices)}")
    if not _is_real(c.init_scale) or not math.isfinite(c.init_scale) or c.init_scale <= 0:
        raise _fail("init_scale", c.init_scale, "a finite number > 0")
    if c.mode == "guard" and c.init_scale != 1.0:
        raise _fail("init_scale", c.init_scale, "1 (or left out) with mode='guard', which never scales")
    if not _is_real(c.growth_factor) or not math.isfinite(c.growth_factor) or c.growth_factor <= 1:
        raise _fail("growth_factor", c.growth_factor, "a finite number > 1")
    if not _is_real(c.backoff_factor) or not 0 < c.backoff_factor < 1:
        raise _fail("backoff_factor", c.backoff_factor, "a number in the open interval (0, 1)")
    if c.backoff_rule == "divide" and not math.isclose(c.backoff_factor * c.growth_factor, 1.0, rel_tol=1e-12):
        raise ValueError(
            f"backoff_factor must be 1 / growth_factor = {1.0 / c.growth_factor!r} with "
            f"backoff_rule='divide' (preset {c.preset!r} has a single factor); got "
            f"{c.backoff_factor!r}. Pass backoff_rule='multiply' for independent factors."
        )
    for name in ("interval_offset", "first_growth_delay"):
        if not _is_int(getattr(c, name)) or getattr(c, name) not in (0, 1):
            raise _fail(name, getattr(c, name), "0 or 1")
    lowest = 1 - c.interval_offset
    if not _is_int(c.growth_interval) or not lowest <= c.growth_interval <= INT32_MAX - 1:
        raise _fail("growth_interval", c.growth_interval, f"an integer in [{lowest}, {INT32_MAX - 1}]")
    if not _is_int(c.hysteresis) or not 1 <= c.hysteresis <= INT32_MAX:
        raise _fail("hysteresis", c.hysteresis, "an integer >= 1")
    if c.min_scale is not None and (not _is_real(c.min_scale) or not math.isfinite(c.min_scale) or c.min_scale <= 0):
        raise _fail("min_scale", c.min_scale, "None or a finite number > 0")
    if c.max_scale is not None and (not _is_real(c.max_scale) or math.isnan(c.max_scale) or c.max_scale <= 0):
        raise _fail("max_scale", c.max_scale, "None or a number > 0")
    if c.min_scale is not None and c.max_scale is not None and c.min_scale > c.max_scale:
        raise ValueError(f"min_scale must be <= max_scale; got min_scale={c.min_scale!r} > max_scale={c.max_scale!r}")
    if not (callable(c.on_floor) or c.on_floor in ("ignore", "warn", "raise")):
        raise _fail("on_floor", c.on_floor, "'ignore', 'warn', 'raise' or a callable taking a FloorEvent")
    if not _is_int(c.floor_patience) or not 1 <= c.floor_patience <= INT32_MAX:
        raise _fail("floor_patience", c.floor_patience, f"an integer in [1, {INT32_MAX}]")
    try:
        hash(c.axis_name)
    except TypeError:
        raise _fail("axis_name", c.axis_name, "None or a hashable axis name (str or tuple of str)") from None


def _validate_rounded(c: ScalerConfig) -> None:
    """Raise ``ValueError`` for values that are valid as given but not as used: after rounding
    to the scale's dtype (``scale_dtype``) and the factors' precision (``factor_precision``)."""
    dtype = c.scale_dtype
    lowest, highest = SCALE_RANGE[dtype]
    span = f"[{lowest:.7g}, {highest:.7g}] (the normal {dtype} range)"
    for name, value in (("min_scale", c.min_scale), ("max_scale", c.max_scale), ("init_scale", c.init_scale)):
        if value is None or (name == "init_scale" and c.mode == "guard"):
            continue
        rounded = _round_to(float(value), dtype)
        if not lowest <= rounded <= highest:
            raise ValueError(
                f"{name} must lie in {span} once rounded to scale_dtype={dtype!r}; got {value!r}, which "
                f"becomes {rounded!r}"
            )
    if c.min_value > c.max_value:
        raise ValueError(
            f"min_scale must be <= max_scale once rounded to {dtype}; got {c.min_value!r} > {c.max_value!r}"
        )
    if c.mode == "dynamic" and not c.min_value <= c.initial_scale <= c.max_value:
        raise ValueError(
            f"init_scale must lie in [min_scale, max_scale] = [{c.min_value!r}, {c.max_value!r}]; got "
            f"{c.init_scale!r} (an overflow would jump to the floor, or the first growth fall to the ceiling)"
        )
    precision = c.factor_precision
    growth = c.growth_value
    if not (math.isfinite(growth) and growth > 1 and _round_to(growth, dtype) > 1):
        raise ValueError(
            f"growth_factor must stay finite and > 1 once rounded to factor_precision={precision!r} and "
            f"to scale_dtype={dtype!r}; got {c.growth_factor!r}, which becomes {growth!r}"
        )
    backoff = c.backoff_value
    if c.backoff_rule == "multiply" and not (0 < backoff < 1 and 0 < _round_to(backoff, dtype) < 1):
        raise ValueError(
            f"backoff_factor must stay in (0, 1) once rounded to factor_precision={precision!r} and to "
            f"scale_dtype={dtype!r}; got {c.backoff_factor!r}, which becomes {backoff!r}"
        )


#: the ``growth_interval`` that stands for torch's "never grows" (an interval below 1)
NEVER_GROWS: Final = INT32_MAX - 1


def torch_growth_interval(value: Any, interval_offset: int) -> Any:
    """The ``growth_interval`` ampscale stores for one given in torch's terms.

    torch grows when its good-step counter *equals* the interval, so an interval below the
    counter's first value (1, or 0 for a preset that grows on the N+1-th step) means "never":
    the longest interval has the same trajectory. Other values are returned as given (plain
    Python ints for NumPy integers), for the validation to judge.
    """
    plain = plain_number(value, integral=True)
    if isinstance(plain, int) and not isinstance(plain, bool) and plain < 1 - interval_offset:
        return NEVER_GROWS
    return plain


def torch_setting(name: str, value: Any, interval_offset: int) -> Any:
    """The value ampscale's config stores for a setting given in torch's terms (an argument or
    attribute of the drop-in ``GradScaler``): ``growth_interval`` as :func:`torch_growth_interval`
    says, with an ``AmpscaleWarning`` where that means the scale never grows; the others as given.
    """
    if name != "growth_interval":
        return value
    stored = torch_growth_interval(value, interval_offset)
    if stored == NEVER_GROWS and stored != value:
        warnings.warn(
            f"growth_interval={shown(value)}: the scale never grows (the good-step counter never equals it)",
            AmpscaleWarning,
            stacklevel=4,
        )
    return stored


def as_float(value: Any) -> float:
    """``float(value)``; an integer too large for a float is +-inf (which every range check refuses)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def given_number(value: Any, integral: bool) -> Any:
    """A NumPy number given for a torch setting as a plain Python number (Python numbers and
    anything else as given: ``16`` stays ``16``, as torch's getters return it)."""
    if type(value) in (int, float):
        return value
    try:
        return plain_number(value, integral)
    except OverflowError:  # (refused by the validation first, on an enabled scaler)
        return value


class _Default:
    """The default of a setting left out: a named singleton, so signatures read as what it means.

    ``help(create_scaler)`` shows ``init_scale=<preset default>`` instead of an anonymous
    ``<object object at 0x...>``; compare with ``is``.
    """

    __slots__ = ("_meaning",)

    def __init__(self, meaning: str) -> None:
        self._meaning = meaning

    def __repr__(self) -> str:
        return f"<{self._meaning}>"


#: a setting left out takes the preset's default (``create_scaler``, ``GradScaler``)
_UNSET: Final[Any] = _Default("preset default")  # Any: it stands in for a value of any setting's type
#: a per-call ``axis_name`` left out takes the scaler's ``axis_name`` setting
_SCALER_SETTING: Final[Any] = _Default("the scaler's axis_name")


def make_config(preset: str = "torch", **settings: Any) -> ScalerConfig:
    """Resolve ``settings`` against ``preset``'s defaults and validate them.

    Settings left out (or passed as ``_UNSET``, shown as ``<preset default>``) take the preset's
    own default. Settings given are read in that system's own terms; for single-factor presets
    (jmp, DeepSpeed, apex, MindSpore, tf.keras) the backoff is ``1 / growth_factor`` unless
    ``backoff_rule`` is changed too.
    """
    if not isinstance(preset, str) or preset not in PRESETS:
        raise _fail("preset", preset, f"one of {sorted(PRESETS)}")
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; accepted: {list(_SETTINGS)}")
    given = {k: v for k, v in settings.items() if v is not _UNSET}
    values = dict(PRESETS[preset].defaults)
    values.update(given)
    if values["backoff_rule"] == "divide" and "backoff_factor" not in given:
        try:
            growth = plain_number(values["growth_factor"], integral=False)
        except OverflowError:
            growth = None  # refused by the validation, naming growth_factor
        values["backoff_factor"] = 1.0 / growth if _is_real(growth) and growth != 0 else 0.5
    if values["mode"] == "guard" and "init_scale" not in given:
        values["init_scale"] = 1.0
    return ScalerConfig(preset=preset, **values)
