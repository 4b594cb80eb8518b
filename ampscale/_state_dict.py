"""The checkpoint format: plain, JSON-serialisable, versioned, portable across backends.

Host operations and checkpoints layer.

A dict from :meth:`ampscale.Scaler.state_dict` holds ``torch.amp.GradScaler``'s five keys at
the top level, so ``torch.amp.GradScaler.load_state_dict`` accepts it, plus everything else
under ``"ampscale"``::

    {
        "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 2000, "_growth_tracker": 17,
        "ampscale": {
            "version": 1,
            "preset": "torch",
            "settings": {"mode": "dynamic", "init_scale": 65536.0, ...},
            "state": {"scale": 65536.0, "growth_tracker": 17, "hysteresis_tracker": 1,
                      "steps": 17, "skipped_steps": 0, ...},
        },
    }

:func:`from_state_dict` also accepts a dict saved by ``torch.amp.GradScaler`` (the five keys
only): like torch, it replaces the growth and backoff settings and the tracker, and keeps the
scaler's other settings. torch's ``growth_interval`` below 1 ("never grows") is read as the
longest interval, whose trajectory is the same. It accepts apex's ``LossScaler`` checkpoints
too (``{"loss_scale": ..., "unskipped": ...}``, or ``amp.state_dict()``'s
``{"loss_scaler0": {...}}`` with one scaler): the scale and the good-step counter, under the
scaler's settings. A torch or apex dict loaded into a scaler whose rules differ from that
system's (another preset, hysteresis, a floor, ...) warns (:class:`~ampscale.AmpscaleWarning`),
naming each differing setting: the trajectory goes on under the scaler's rules.

Every key is checked before anything is built, and every value as it will be used (a scale
rounded to the scale's dtype must lie in ``[min_scale, max_scale]``, counters in their ranges
and consistent with each other, ``last_reason`` one of the codes, torch's keys beside the
``"ampscale"`` entry equal to it, no unknown key; a number of any size or NumPy type is
judged by its value); a bad dict raises :class:`~ampscale.StateDictError` naming the key, the
value and what is accepted, and nothing is loaded.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from typing import Any, Final

from ampscale._config import (
    _SETTINGS,
    FLOOR_SETTINGS,
    PRESETS,
    RULE_SETTINGS,
    TORCH_SETTINGS,
    ScalerConfig,
    _round_to,
    make_config,
    plain_number,
    shown,
    torch_growth_interval,
)
from ampscale._core import INT_FIELDS, REASONS, ScalerState, initial_values
from ampscale._errors import AmpscaleWarning, StateDictError

__all__ = ["FORMAT_VERSION", "check_scale", "from_state_dict", "to_state_dict", "torch_compatible"]

#: Version of the format written by this ampscale. Loading accepts this version and older ones.
FORMAT_VERSION: Final = 1

_TORCH_KEYS: Final = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_APEX_KEYS: Final = ("loss_scale", "unskipped")
_APEX_ENTRY: Final = re.compile(r"loss_scaler\d+")
_INT32 = (-(2**31), 2**31 - 1)


def to_state_dict(config: ScalerConfig, values: ScalerState) -> dict[str, Any]:
    """Build the dict for ``config`` and host-scalar state ``values``."""
    settings = config.settings()
    state = {
        name: (int(v) if name in INT_FIELDS else float(v)) for name, v in zip(ScalerState._fields, values, strict=True)
    }
    return {
        "scale": state["scale"],
        "growth_factor": float(config.growth_factor),
        "backoff_factor": float(config.backoff_factor),
        "growth_interval": int(config.growth_interval),
        "_growth_tracker": state["growth_tracker"],
        "ampscale": {
            "version": FORMAT_VERSION,
            "preset": config.preset,
            "settings": {k: (float(v) if isinstance(v, float) else v) for k, v in settings.items()},
            "state": state,
        },
    }


def torch_compatible(config: ScalerConfig) -> bool:
    """Whether torch's five keys describe ``config`` completely (``state_dict`` then needs no
    ``"ampscale"`` entry).

    Compared with the torch preset's defaults setting by setting (no config is built, so this
    holds for any config a scaler accepted, and writing a state dict cannot raise).
    """
    if config.preset != "torch":
        return False
    torch_defaults = PRESETS["torch"].defaults
    held = (*TORCH_SETTINGS, *FLOOR_SETTINGS)  # in torch's keys, or no part of the trajectory
    return all(value == torch_defaults[name] for name, value in config.settings().items() if name not in held)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bad(key: str, value: Any, accepted: str) -> StateDictError:
    return StateDictError(f"state dict key {key!r} must be {accepted}; got {shown(value)}")


def _number(key: str, value: Any, accepted: str) -> float:
    """A finite real number as a Python float (an int of any size, a NumPy scalar), else refused."""
    try:
        number = plain_number(value, integral=False)
    except OverflowError:
        raise _bad(key, value, accepted + " (this integer is too large for a float)") from None
    if not _is_number(number) or not math.isfinite(number):
        raise _bad(key, value, accepted)
    return float(number)


def _integer(key: str, value: Any, accepted: str) -> int:
    """An integer as a Python int (a NumPy integer, a 0-d integer array), else refused."""
    number = plain_number(value, integral=True)
    if not _is_int(number):
        raise _bad(key, value, accepted)
    return int(number)


def check_scale(key: str, value: Any, config: ScalerConfig, what: str = "state dict key") -> float:
    """A scale as it will be used: rounded to the scale's dtype, within the config's bounds.

    Raises :class:`StateDictError` naming ``key`` (``what`` says what it is: a state dict key,
    or an argument). Every way a scale is set from outside (a checkpoint, ``GradScaler.update(
    new_scale)``) is checked here, so the scale is never 0, inf, nan or outside its bounds.
    """
    low, high = config.min_value, config.max_value
    accepted = f"a number in [{low!r}, {high!r}] (min_scale to max_scale, in {config.scale_dtype})"
    try:
        rounded = _round_to(_number(key, value, accepted), config.scale_dtype)
        if not low <= rounded <= high:
            raise _bad(key, value, accepted)
    except StateDictError as exc:
        if what == "state dict key":
            raise
        raise StateDictError(str(exc).replace("state dict key", what, 1)) from None
    return rounded


def _check_counter(key: str, value: Any, low: int, high: int = _INT32[1]) -> int:
    accepted = f"an integer in [{low}, {high}]"
    number = _integer(key, value, accepted)
    if not low <= number <= high:
        raise _bad(key, value, accepted)
    return number


def from_state_dict(state_dict: Any, current: ScalerConfig) -> tuple[ScalerConfig, ScalerState]:
    """Validate ``state_dict`` and return the config and host-scalar state it describes.

    Args:
        state_dict: a dict from :func:`to_state_dict` (any version up to :data:`FORMAT_VERSION`)
            or from ``torch.amp.GradScaler.state_dict()``.
        current: the loading scaler's config; supplies what the dict does not hold (the
            ``axis_name``, an ``on_floor`` callback, and for torch dicts every ampscale setting).
    """
    if not isinstance(state_dict, dict):
        raise StateDictError(f"a state dict must be a dict; got {type(state_dict).__name__}")
    if not state_dict:
        raise StateDictError("the state dict is empty (torch.amp.GradScaler returns {} when disabled); nothing to load")
    if "ampscale" in state_dict:
        unknown = sorted(map(repr, set(state_dict) - {"ampscale", *_TORCH_KEYS}))
        if unknown:
            raise StateDictError(f"state dict has unknown key(s) {', '.join(unknown)}")
        config, values = _from_ampscale(state_dict["ampscale"], current)
        _check_torch_keys(state_dict, config, values)
        return config, values
    if "loss_scale" in state_dict or any(isinstance(k, str) and _APEX_ENTRY.fullmatch(k) for k in state_dict):
        return _from_apex(state_dict, current)
    return _from_torch(state_dict, current)


def _warn_foreign_rules(system: str, preset: str, config: ScalerConfig, stacklevel: int = 5) -> None:
    """Warn that a dict of ``system`` (torch, apex) goes on under rules that differ from its own."""
    theirs = PRESETS[preset].defaults
    ours = config.settings()
    differ = [
        f"{name}={ours[name]!r} ({system}: {theirs[name]!r})" for name in RULE_SETTINGS if ours[name] != theirs[name]
    ]
    if not differ:
        return
    article = "an" if system[0].lower() in "aeiou" else "a"
    warnings.warn(
        f"loading {article} {system} state dict into a scaler whose rules differ from {system}'s: {', '.join(differ)}. "
        f"The scale and the counters go on under this scaler's rules (preset {config.preset!r}), not "
        f"{system}'s; create the scaler with preset={preset!r} to continue {system}'s trajectory exactly",
        AmpscaleWarning,
        stacklevel=stacklevel,
    )


def _from_torch(state_dict: dict[str, Any], current: ScalerConfig) -> tuple[ScalerConfig, ScalerState]:
    missing = [k for k in _TORCH_KEYS if k not in state_dict]
    if missing:
        raise StateDictError(
            f"state dict misses key(s) {missing}: expected ampscale's format (with an 'ampscale' "
            f"key) or torch.amp.GradScaler's keys {list(_TORCH_KEYS)}; got keys {sorted(state_dict)}"
        )
    unknown = sorted(map(repr, set(state_dict) - set(_TORCH_KEYS)))
    if unknown:
        raise StateDictError(f"state dict has unknown key(s) {', '.join(unknown)}; accepted: {list(_TORCH_KEYS)}")
    growth = _number("growth_factor", state_dict["growth_factor"], "a finite number")
    backoff = _number("backoff_factor", state_dict["backoff_factor"], "a finite number")
    # torch's "never grows" (an interval below 1) is the longest interval: the same trajectory
    given = _integer("growth_interval", state_dict["growth_interval"], "an integer")
    interval = torch_growth_interval(given, current.interval_offset)
    if interval != given:
        warnings.warn(
            f"growth_interval={shown(given)}: the scale never grows (the good-step counter never equals it)",
            AmpscaleWarning,
            stacklevel=4,
        )
    try:
        config = current.replace(growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    except ValueError as exc:
        raise StateDictError(f"state dict holds invalid settings: {exc}") from exc
    scale = check_scale("scale", state_dict["scale"], config)
    tracker = _check_counter("_growth_tracker", state_dict["_growth_tracker"], -config.first_growth_delay)
    values = initial_values(config)._replace(scale=scale, last_scale=scale, growth_tracker=tracker)
    _warn_foreign_rules("torch.amp.GradScaler", "torch", config)
    return config, values


def _from_apex(state_dict: dict[str, Any], current: ScalerConfig) -> tuple[ScalerConfig, ScalerState]:
    """apex's ``LossScaler`` state: ``amp.state_dict()`` (one ``loss_scaler<N>`` entry) or one entry."""
    entry: Any = state_dict
    prefix = ""
    if "loss_scale" not in state_dict:
        names = sorted(map(str, state_dict))
        others = [k for k in names if not _APEX_ENTRY.fullmatch(k)]
        if others:
            raise StateDictError(f"state dict has unknown key(s) {others} beside apex's {names[0]!r}")
        if len(names) != 1:
            raise StateDictError(
                f"state dict holds {len(names)} apex loss scalers ({', '.join(names)}: amp.initialize(num_losses="
                f"{len(names)})); a scaler loads one: pass state_dict[{names[0]!r}]"
            )
        prefix = f"{names[0]}."
        entry = state_dict[names[0]]
        if not isinstance(entry, dict):
            raise _bad(names[0], entry, "a dict with apex's keys 'loss_scale' and 'unskipped'")
    missing = [k for k in _APEX_KEYS if k not in entry]
    unknown = sorted(map(repr, set(entry) - set(_APEX_KEYS)))
    if missing or unknown:
        raise StateDictError(
            f"an apex LossScaler state dict holds exactly the keys {list(_APEX_KEYS)}; "
            f"missing {missing}, unknown [{', '.join(unknown)}]"
        )
    scale = check_scale(f"{prefix}loss_scale", entry["loss_scale"], current)
    unskipped = _check_counter(f"{prefix}unskipped", entry["unskipped"], 0)
    values = initial_values(current)._replace(scale=scale, last_scale=scale, growth_tracker=unskipped)
    _warn_foreign_rules("apex LossScaler", "apex", current)
    return current, values


def _from_ampscale(payload: Any, current: ScalerConfig) -> tuple[ScalerConfig, ScalerState]:
    if not isinstance(payload, dict):
        raise _bad("ampscale", payload, "a dict")
    version: Any = payload.get("version")
    if not _is_int(version) or version < 1:
        raise _bad("ampscale.version", version, "a positive integer")
    if version > FORMAT_VERSION:
        raise StateDictError(
            f"state dict has format version {shown(version)}, newer than the {FORMAT_VERSION} this "
            "ampscale reads; upgrade ampscale to load it"
        )
    unknown = sorted(map(repr, set(payload) - {"version", "preset", "settings", "state"}))
    if unknown:
        raise StateDictError(f"state dict has unknown key(s) {', '.join(unknown)} under 'ampscale'")
    preset = payload.get("preset")
    if not isinstance(preset, str) or preset not in PRESETS:
        raise _bad("ampscale.preset", preset, f"one of {sorted(PRESETS)}")
    settings = payload.get("settings")
    if not isinstance(settings, dict):
        raise _bad("ampscale.settings", settings, "a dict")
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise StateDictError(f"state dict has unknown setting(s) {unknown} under 'ampscale.settings'")
    settings = dict(settings)
    if settings.get("on_floor") == "callback":
        settings["on_floor"] = current.on_floor if callable(current.on_floor) else "warn"
    settings["axis_name"] = current.axis_name
    try:
        config = make_config(preset, **settings)
    except (ValueError, TypeError) as exc:
        raise StateDictError(f"state dict holds invalid settings: {exc}") from exc
    state = payload.get("state")
    if not isinstance(state, dict):
        raise _bad("ampscale.state", state, "a dict")
    unknown = sorted(map(repr, set(state) - set(ScalerState._fields)))
    if unknown:
        raise StateDictError(
            f"state dict has unknown key(s) {', '.join(unknown)} under 'ampscale.state'; accepted: "
            f"{list(ScalerState._fields)}"
        )
    defaults = initial_values(config)
    values: dict[str, Any] = {}
    for name, default in zip(ScalerState._fields, defaults, strict=True):
        key = f"ampscale.state.{name}"
        if name not in state:
            if name in ("scale", "growth_tracker"):
                raise StateDictError(f"state dict misses key {key!r}")
            values[name] = default  # fields added in later versions keep their initial value
            continue
        value = state[name]
        if name in ("scale", "last_scale"):
            values[name] = check_scale(key, value, config)
        elif name == "growth_tracker":
            values[name] = _check_counter(key, value, -config.first_growth_delay)
        elif name == "hysteresis_tracker":
            values[name] = _check_counter(key, value, _INT32[0], config.hysteresis)
        elif name == "last_reason":
            if not _is_int(value) or value not in REASONS:
                raise _bad(key, value, f"one of {sorted(REASONS)} ({', '.join(map(repr, REASONS.values()))})")
            values[name] = int(value)
        else:
            assert name in INT_FIELDS
            values[name] = _check_counter(key, value, 0)
    if "last_scale" not in state:
        values["last_scale"] = values["scale"]
    _check_counts(values, state)
    return config, ScalerState(**values)


def _check_counts(values: dict[str, Any], given: dict[str, Any]) -> None:
    """Counters that contradict each other (a saturated counter is exempt: it stopped)."""
    counted = ("steps", "skipped_steps", "loss_overflows", "grad_overflows")
    if any(values[name] == _INT32[1] for name in counted):
        return
    if values["skipped_steps"] > values["steps"]:
        raise StateDictError(
            f"state dict key 'ampscale.state.skipped_steps' ({values['skipped_steps']}) exceeds "
            f"'ampscale.state.steps' ({values['steps']})"
        )
    parts = values["loss_overflows"] + values["grad_overflows"]
    if set(counted[1:]) <= set(given) and parts != values["skipped_steps"]:
        raise StateDictError(
            "state dict keys 'ampscale.state.loss_overflows' + 'grad_overflows' "
            f"({values['loss_overflows']} + {values['grad_overflows']}) must equal 'skipped_steps' "
            f"({values['skipped_steps']})"
        )


def _check_torch_keys(state_dict: dict[str, Any], config: ScalerConfig, values: ScalerState) -> None:
    """torch's keys beside an ``"ampscale"`` entry must say what the entry says."""
    written = to_state_dict(config, values)
    for key in _TORCH_KEYS:
        given = state_dict.get(key)
        if key == "growth_interval" and _is_int(given):
            # torch's "never grows" beside the entry's longest interval (the drop-in writes both)
            given = torch_growth_interval(given, config.interval_offset)
        if key in state_dict and not _same(given, written[key]):
            raise StateDictError(
                f"state dict key {key!r} ({shown(state_dict[key])}) disagrees with the 'ampscale' entry, which "
                f"says {written[key]!r}: edit both, or remove the top-level key"
            )


def _same(given: Any, expected: Any) -> bool:
    if isinstance(given, bool) or not isinstance(given, numbers.Real):
        return False
    return bool(given == expected)
