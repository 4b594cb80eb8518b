"""FP8 checkpoints: versioned JSON, portable across backends, and importers from the anchors.

A dict from :meth:`Fp8Scaler.state_dict` is plain JSON::

    {"ampscale_fp8": {
        "version": 2, "preset": "te_delayed",
        "settings": {"formats": "hybrid", "history_len": 1024, ...},
        "steps": 17,
        "slots": [{"name": "fc1.x", "role": "forward", "format": "e4m3fn",
                   "scale": "0x1.c000000000000p+7", "scale_inv": "0x1.2492480000000p-8",
                   "history": "<base64 of little-endian float32, oldest first>",
                   "filled": 17, "zero_amax": 0, "nonfinite": 0}, ...]}}

Floats are written as hex (exact, inf and nan included) and the history in canonical order,
oldest first, whatever layout a backend keeps it in (the state's ring buffer is unrolled here).
Loading checks every key and value before anything is built, and that the recipe matches the
loading scaler's: every setting must be there (a version-1 dict may lack the settings version 2
added, and is read as holding the values that version-1 ampscale used), and a setting that
differs is named, with both values. :func:`from_transformer_engine`, :func:`from_flax` and
:func:`from_keras` turn the anchors' own state into this layout.
"""

from __future__ import annotations

import base64
import collections
import io
import math
import numbers
import pickle
from typing import Any, Final, NamedTuple

import numpy as np

from ampscale._config import shown
from ampscale._errors import StateDictError
from ampscale.fp8._config import FP8_PRESETS, SETTINGS_ORDER, SETTINGS_SINCE_V2, Fp8Config
from ampscale.fp8._transition import Fp8State, canonical_order
from ampscale.fp8._update import update_state

__all__ = [
    "FP8_FORMAT_VERSION",
    "from_flax",
    "from_keras",
    "from_state_dict",
    "from_transformer_engine",
    "to_state_dict",
]

FP8_FORMAT_VERSION: Final = 2
_INT32_MAX = 2**31 - 1
_SLOT_KEYS = ("name", "role", "format", "scale", "scale_inv", "history", "filled", "zero_amax", "nonfinite")


def _hex(value: Any) -> str:
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v.hex()


def to_state_dict(config: Fp8Config, state: Fp8State) -> dict[str, Any]:
    """The dict for ``config`` and a host (NumPy) ``state``."""
    slots = []
    formats = config.slot_formats
    heads = np.zeros(config.size, np.int64) if state.head is None else np.asarray(state.head, np.int64)
    for k, name in enumerate(config.slots):
        ring = np.asarray(state.history[k])
        history = np.ascontiguousarray(ring[canonical_order(int(heads[k]), ring.shape[0])], dtype="<f4")
        slots.append(
            {
                "name": name,
                "role": config.roles[k],
                "format": formats[k],
                "scale": _hex(state.scale[k]),
                "scale_inv": _hex(state.scale_inv[k]),
                "history": base64.b64encode(history.tobytes()).decode("ascii"),
                "filled": int(state.filled[k]),
                "zero_amax": int(state.zero_amax[k]),
                "nonfinite": int(state.nonfinite[k]),
            }
        )
    return {
        "ampscale_fp8": {
            "version": FP8_FORMAT_VERSION,
            "preset": config.preset,
            "settings": config.settings(),
            "steps": int(state.steps),
            "slots": slots,
        }
    }


def _bad(key: str, value: Any, accepted: str) -> StateDictError:
    return StateDictError(f"FP8 state dict key {key!r} must be {accepted}; got {shown(value)}")


def _float(key: str, value: Any) -> np.float32:
    if isinstance(value, str):
        try:
            parsed = float(value) if value in ("nan", "inf", "-inf") else float.fromhex(value)
        except ValueError:
            raise _bad(key, value, "a float written as hex ('0x1.8p+3'), 'inf', '-inf' or 'nan'") from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            parsed = float(value)
        except OverflowError:  # an integer beyond any float: not a float32 value
            raise _bad(key, value, "a float32 value") from None
    else:
        raise _bad(key, value, "a float written as hex ('0x1.8p+3'), 'inf', '-inf' or 'nan'")
    with np.errstate(over="ignore"):
        rounded: np.float32 = np.float32(parsed)
    if not math.isnan(parsed) and float(rounded) != parsed:
        raise _bad(key, value, "a float32 value")
    return rounded


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= _INT32_MAX:
        raise _bad(key, value, f"an integer in [0, {_INT32_MAX}]")
    return int(value)


def from_state_dict(state_dict: Any, config: Fp8Config) -> Fp8State:
    """Validate ``state_dict`` against ``config`` and return the host state it holds.

    Raises:
        ampscale.StateDictError: a missing, unknown or ill-typed key, a newer version, other
            slots, or a recipe setting that differs from ``config``'s (each one named).
    """
    if not isinstance(state_dict, dict) or "ampscale_fp8" not in state_dict:
        raise StateDictError(
            "an FP8 state dict is a dict with the key 'ampscale_fp8' (from Fp8Scaler.state_dict()); "
            f"got {type(state_dict).__name__}"
            + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
        )
    payload = state_dict["ampscale_fp8"]
    if not isinstance(payload, dict):
        raise _bad("ampscale_fp8", payload, "a dict")
    unknown = sorted(set(payload) - {"version", "preset", "settings", "steps", "slots"})
    if unknown:
        raise StateDictError(f"FP8 state dict has unknown key(s) {unknown} under 'ampscale_fp8'")
    version = payload.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _bad("ampscale_fp8.version", version, "a positive integer")
    if version > FP8_FORMAT_VERSION:
        raise StateDictError(
            f"FP8 state dict has format version {shown(version)}, newer than the {FP8_FORMAT_VERSION} this "
            "ampscale reads; upgrade ampscale to load it"
        )
    preset = payload.get("preset")
    if preset not in FP8_PRESETS:
        raise _bad("ampscale_fp8.preset", preset, f"one of {sorted(FP8_PRESETS)}")
    settings = payload.get("settings")
    if not isinstance(settings, dict):
        raise _bad("ampscale_fp8.settings", settings, "a dict")
    unknown = sorted(set(settings) - set(SETTINGS_ORDER))
    if unknown:
        raise StateDictError(f"FP8 state dict has unknown setting(s) {unknown} under 'ampscale_fp8.settings'")
    mine = config.settings()
    if version < 2:
        # settings that version 1 did not write: the value it used (None: it changed no state)
        settings = {
            **{name: mine[name] if value is None else value for name, value in SETTINGS_SINCE_V2.items()},
            **settings,
        }
    missing = [name for name in SETTINGS_ORDER if name not in settings]
    if missing:
        raise StateDictError(
            f"FP8 state dict misses recipe setting(s) {missing} under 'ampscale_fp8.settings'; a checkpoint of "
            f"format version {version} holds every one of {list(SETTINGS_ORDER)}, so it cannot be checked "
            "against this scaler's recipe"
        )
    differ = [
        f"{name}: saved {shown(settings[name])}, this scaler {mine[name]!r}"
        for name in SETTINGS_ORDER
        if settings[name] != mine[name]
    ]
    if differ:
        raise StateDictError(
            "the FP8 state dict was saved with another recipe; settings that differ: "
            + "; ".join(differ)
            + ". Create the scaler with the saved settings to load it"
        )
    steps = _count("ampscale_fp8.steps", payload.get("steps"))
    slots = payload.get("slots")
    if not isinstance(slots, list):
        raise _bad("ampscale_fp8.slots", slots, "a list of slot dicts")
    names = [s.get("name") if isinstance(s, dict) else None for s in slots]
    if names != list(config.slots):
        raise StateDictError(f"the FP8 state dict holds slots {names}; this scaler has slots {list(config.slots)}")
    n, length = config.size, config.history_len
    scale = np.empty(n, np.float32)
    scale_inv = np.empty(n, np.float32)
    history = np.empty((n, length), np.float32)
    counters = {key: np.empty(n, np.int32) for key in ("filled", "zero_amax", "nonfinite")}
    for k, entry in enumerate(slots):
        where = f"ampscale_fp8.slots[{k}]"
        unknown = sorted(set(entry) - set(_SLOT_KEYS))
        missing = [key for key in _SLOT_KEYS if key not in entry]
        if unknown or missing:
            raise StateDictError(f"FP8 state dict {where} has unknown key(s) {unknown} / misses key(s) {missing}")
        if entry["role"] != config.roles[k]:
            raise _bad(f"{where}.role", entry["role"], repr(config.roles[k]))
        if entry["format"] != config.slot_formats[k]:
            raise _bad(f"{where}.format", entry["format"], repr(config.slot_formats[k]))
        scale[k] = _float(f"{where}.scale", entry["scale"])
        scale_inv[k] = _float(f"{where}.scale_inv", entry["scale_inv"])
        encoded = entry["history"]
        try:
            raw = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != 4 * length:
            raise _bad(f"{where}.history", encoded, f"base64 of {length} little-endian float32 values")
        history[k] = np.frombuffer(raw, "<f4")
        for key, array in counters.items():
            array[k] = _count(f"{where}.{key}", entry[key])
    return Fp8State(
        scale,
        scale_inv,
        history,
        counters["filled"],
        counters["zero_amax"],
        counters["nonfinite"],
        np.int32(steps),
        head=np.zeros(n, np.int32),
    )


# ------------------------------------------------------------------------------ importers


def _canonical_te(history: np.ndarray) -> np.ndarray:
    """TE's ``[L, N]`` history (row 0: the amax being accumulated; rows 1..L-1 the past
    amaxes, oldest first) as ampscale's ``[N, L]``, oldest first.

    ampscale keeps the last L amaxes; TE keeps L-1 of them, because the oldest one leaves the
    window at the next update before the window is read. The one TE forgot is written as 0
    (it is never read again), and row 0, an amax of a step not yet finished, is dropped.
    """
    h = np.asarray(history, np.float32)
    out = np.zeros((h.shape[1], h.shape[0]), np.float32)
    out[:, 1:] = h[1:].T
    return out


class _TEFormat(NamedTuple):
    """Stand-in for ``transformer_engine.common.recipe._FormatHelper`` (the maxima of a format)."""

    max_fwd: float
    max_bwd: float


#: TE's ``Format`` members by their maxima, and the ``formats`` setting each one is
_TE_FORMATS: Final = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID", (6, 6): "E2M1"}
_TE_FORMAT_SETTING: Final = {"E4M3": "e4m3fn", "HYBRID": "hybrid", "E5M2": "e5m2"}


class _TERecipe:
    """Stand-in for TE's recipe dataclasses (``DelayedScaling``, ...): their fields, nothing run."""

    kind = "Recipe"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"TE's {self.kind} pickled a {type(state).__name__}, not its fields")
        self.__dict__.update(state)


def _te_format(value: Any) -> str:
    """``Format(_FormatHelper(...))``, as unpickling an enum member calls it: the member's name."""
    return _TE_FORMATS.get((value.max_fwd, value.max_bwd), f"unknown {tuple(value)}")


_TE_STAND_INS: dict[str, type] = {}


def _te_class(name: str) -> Any:
    if name == "Format":
        return _te_format
    if name == "_FormatHelper":
        return _TEFormat
    if name not in _TE_STAND_INS:
        _TE_STAND_INS[name] = type(name, (_TERecipe,), {"kind": name, "__module__": __name__})
    return _TE_STAND_INS[name]


class _TEUnpickler(pickle.Unpickler):
    """Unpickles TE's ``_extra_state`` without importing TE and without running any code but
    the constructors listed here: TE's recipe classes become plain stand-ins (TE 2.x pickles
    ``transformer_engine.common.recipe.DelayedScaling``, and importing TE without its CUDA core
    raises "Found empty transformer-engine meta package"), and torch's tensors are rebuilt by
    torch's own weights-only loader."""

    _RECIPES = frozenset(
        {
            "Recipe",
            "DelayedScaling",
            "Float8CurrentScaling",
            "MXFP8BlockScaling",
            "Float8BlockScaling",
            "NVFP4BlockScaling",
            "CustomRecipe",
            "MMParams",
            "QParams",
            "Format",
            "_FormatHelper",
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if module == "transformer_engine.common.recipe" and name in self._RECIPES:
            return _te_class(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")):
            try:
                import torch
                import torch._utils
            except ImportError:
                raise StateDictError("TE's _extra_state holds torch tensors: install torch to read it") from None
            if name == "_load_from_bytes":
                # torch's own _load_from_bytes loads with weights_only=False; the bytes are a
                # storage, which the weights-only loader reads without running code
                return lambda data: torch.load(io.BytesIO(data), weights_only=True)
            return torch._utils._rebuild_tensor_v2
        raise pickle.UnpicklingError(
            f"TE's _extra_state refers to {module}.{name}, which is not one of TE's recipe classes or torch's "
            "tensor rebuilders; refusing to load it"
        )


def _unpickle_te(raw: bytes) -> Any:
    try:
        return _TEUnpickler(io.BytesIO(raw)).load()
    except StateDictError:
        raise
    except Exception as error:
        raise StateDictError(f"TE's _extra_state could not be unpickled: {error}") from error


def _check_te_recipe(recipe: Any, config: Fp8Config) -> None:
    """Refuse a TE recipe whose trajectory differs from ``config``'s, naming the field."""
    kind = recipe.kind if isinstance(recipe, _TERecipe) else type(recipe).__name__
    if kind in _TEUnpickler._RECIPES and kind != "DelayedScaling":
        raise StateDictError(f"TE's _extra_state holds a {kind} recipe; only DelayedScaling keeps a history to import")
    if getattr(recipe, "scaling_factor_compute_algo", None) is not None:
        raise StateDictError(
            "TE's recipe has scaling_factor_compute_algo set (a callable ampscale cannot reproduce); accepted: None"
        )
    algo = getattr(recipe, "amax_compute_algo", "max")
    if not isinstance(algo, str):
        raise StateDictError(
            f"TE's recipe has a callable amax_compute_algo ({shown(algo)}); accepted: 'max' or 'most_recent'"
        )
    fmt = getattr(recipe, "fp8_format", "HYBRID")
    fmt = fmt if isinstance(fmt, str) else getattr(fmt, "name", str(fmt))
    expected = {
        "amax_history_len": config.history_len,
        "margin": config.margin,
        "amax_compute_algo": config.amax_algo,
        "fp8_format": next((k for k, v in _TE_FORMAT_SETTING.items() if v == config.formats), config.formats),
    }
    theirs = {
        "amax_history_len": getattr(recipe, "amax_history_len", 1024),
        "margin": getattr(recipe, "margin", 0),
        "amax_compute_algo": algo,
        "fp8_format": fmt,
    }
    for name, mine in expected.items():
        if theirs[name] != mine:
            raise StateDictError(f"TE's recipe has {name}={shown(theirs[name])}; this scaler has {mine!r}")


def from_transformer_engine(
    extra_state: Any, config: Fp8Config, allow_pickle: bool = False, steps: int = 0
) -> dict[str, Any]:
    """An ampscale FP8 state dict from TE's torch ``_extra_state`` (a dict, or its pickled bytes).

    ``config``'s slots must list TE's forward scales first, then its backward scales, as TE
    orders ``scale_fwd`` and ``scale_bwd``. Every field of the recipe inside that changes the
    scales' trajectory is checked against ``config``: ``amax_history_len``, ``margin``,
    ``amax_compute_algo`` (a callable is refused), ``fp8_format`` and
    ``scaling_factor_compute_algo`` (must be ``None``). ``reduce_amax`` is not a setting of the
    update: it says whether the amaxes given to :meth:`~ampscale.fp8.Fp8Scaler.update` were
    reduced across ranks first, which is the caller's to do. Pickles are read by a restricted
    unpickler that maps TE's recipe classes to plain stand-ins and imports nothing of TE, so TE
    2.x checkpoints load on machines without TE's CUDA core.

    Args:
        extra_state: the dict ``{"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd",
            "amax_history_bwd", ...}`` or the bytes / uint8 tensor TE stores.
        config: the loading scaler's config.
        allow_pickle: unpickle bytes (never by default: TE's format is a pickle).
        steps: the ``steps`` counter to record.

    Raises:
        ampscale.StateDictError: pickled bytes without ``allow_pickle``, a pickle that refers
            to anything but TE's recipe classes and torch's tensors, or a recipe field, slot
            count or history length that differs from ``config`` (each one named).
    """
    if isinstance(extra_state, (bytes, bytearray)) or hasattr(extra_state, "numpy"):
        if not allow_pickle:
            raise StateDictError(
                "TE's _extra_state is a pickle; pass allow_pickle=True if you trust this checkpoint (it is read "
                "by a restricted unpickler that only rebuilds TE's recipe fields and torch tensors)"
            )
        raw = bytes(extra_state) if isinstance(extra_state, (bytes, bytearray)) else extra_state.numpy().tobytes()
        extra_state = _unpickle_te(raw)
    if not isinstance(extra_state, dict):
        raise StateDictError(f"TE's _extra_state must be a dict; got {type(extra_state).__name__}")
    scales, histories = [], []
    for part in ("fwd", "bwd"):
        if f"scale_{part}" in extra_state and extra_state[f"scale_{part}"] is not None:
            scales.append(_numpy(extra_state[f"scale_{part}"]).reshape(-1))
            histories.append(_numpy(extra_state[f"amax_history_{part}"]))
    if not scales:
        raise StateDictError("TE's _extra_state holds no 'scale_fwd' / 'scale_bwd'")
    scale = np.concatenate(scales).astype(np.float32)
    history = np.concatenate([_canonical_te(h) for h in histories]).astype(np.float32)
    recipe = extra_state.get("recipe")
    if recipe is not None:
        _check_te_recipe(recipe, config)
    if scale.shape[0] != config.size or history.shape[1] != config.history_len:
        raise StateDictError(
            f"TE's _extra_state holds {scale.shape[0]} scales with history length {history.shape[1]}; this "
            f"scaler has {config.size} slots with history_len={config.history_len}"
        )
    with np.errstate(divide="ignore"):
        inverse = (np.float32(1.0) / scale).astype(np.float32)
    zeros = np.zeros(config.size, np.int32)
    state = Fp8State(scale, inverse, history, zeros, zeros.copy(), zeros.copy(), np.int32(steps), head=zeros.copy())
    return to_state_dict(config, state)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, np.float32)


def _from_inverse(
    config: Fp8Config, inverse: dict[str, tuple[Any, Any]], recompute: bool, steps: int
) -> dict[str, Any]:
    """flax / Keras variables ``{slot: (dequant scale, history with the newest at 0)}``."""
    missing = [name for name in config.slots if name not in inverse]
    if missing:
        raise StateDictError(f"the variables miss slot(s) {missing}; got {sorted(inverse)}")
    n = config.size
    scale_inv = np.empty(n, np.float32)
    history = np.empty((n, config.history_len), np.float32)
    for k, name in enumerate(config.slots):
        s, h = inverse[name]
        s, h = _numpy(s).reshape(-1), _numpy(h).reshape(-1)
        if s.shape != (1,) or h.shape != (config.history_len,):
            raise StateDictError(
                f"slot {name!r}: expected a scale of shape (1,) and a history of shape ({config.history_len},); "
                f"got {s.shape} and {h.shape}"
            )
        scale_inv[k] = s[0]
        history[k] = np.concatenate([h[1:], h[:1]])  # flax and Keras write the newest at 0
    with np.errstate(divide="ignore"):
        scale = (np.float32(1.0) / scale_inv).astype(np.float32)
    zeros = np.zeros(n, np.int32)
    state = Fp8State(scale, scale_inv, history, zeros, zeros.copy(), zeros.copy(), np.int32(steps), head=zeros.copy())
    if recompute:
        # flax's variable scale was computed before the newest amax; ampscale's scale has seen
        # it (flax computes it at its next call): the window's scale, without writing anything
        window_only = config.replace(timing="before_write", on_skipped_step="record", zero_amax="write")
        after, _ = update_state(window_only, state, np.zeros(n, np.float32), True)
        state = state._replace(scale=after.scale, scale_inv=after.scale_inv)
    return to_state_dict(config, state)


def from_flax(variables: Any, config: Fp8Config, steps: int = 0) -> dict[str, Any]:
    """An ampscale FP8 state dict from flax ``fp8_ops`` variables.

    Args:
        variables: ``{slot: {"scale": S, "amax_history": h}}``, or ``{slot: (S, h)}``: each
            slot's dequantization scale and history as flax keeps them (e.g. the
            ``_overwrite_with_gradient`` collection's ``input_scale`` / ``input_amax_history``).
        config: the loading scaler's config (preset ``"flax"``).
        steps: the ``steps`` counter to record.
    """
    return _from_inverse(config, _pairs(variables), recompute=config.timing == "after_write", steps=steps)


def from_keras(variables: Any, config: Fp8Config, steps: int = 0) -> dict[str, Any]:
    """An ampscale FP8 state dict from Keras ``float8`` variables (``inputs_scale``,
    ``inputs_amax_history``, ...), given as for :func:`from_flax`; preset ``"keras"``."""
    return _from_inverse(config, _pairs(variables), recompute=config.timing == "after_write", steps=steps)


def _pairs(variables: Any) -> dict[str, tuple[Any, Any]]:
    if not isinstance(variables, dict):
        raise StateDictError(f"variables must be a dict slot -> (scale, amax_history); got {type(variables).__name__}")
    out = {}
    for name, value in variables.items():
        if isinstance(value, dict):
            if "scale" not in value or "amax_history" not in value:
                raise StateDictError(f"variables[{name!r}] must have 'scale' and 'amax_history'; got {sorted(value)}")
            out[name] = (value["scale"], value["amax_history"])
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            out[name] = (value[0], value[1])
        else:
            raise StateDictError(f"variables[{name!r}] must be (scale, amax_history); got {type(value).__name__}")
    return out
