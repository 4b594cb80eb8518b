"""FP8 scaling settings: the formats, the frozen :class:`Fp8Config`, the presets, and validation.

Every FP8 scaling system ampscale reproduces is one row of the same orthogonal settings; each
quirk of an anchor is a named value of one setting, so a preset is only a row of defaults.

==================== ==========================================================================
setting              meaning
==================== ==========================================================================
formats              the FP8 format of each role: ``"hybrid"`` (E4M3FN forward, E5M2 backward),
                     ``"e4m3fn"``, ``"e5m2"``, ``"e4m3fnuz"``, ``"hybrid_fnuz"``.
history_len          how many amaxes the window holds (1 to 2**20).
amax_algo            ``"max"`` of the window, ``"most_recent"`` amax, or ``"current"`` (the
                     amax of this step only: current scaling).
margin               the scale is divided by ``2**margin`` (an integer 0 to 64).
scale_rule           how ``fp8_max / m`` is rounded: ``"divide"`` (TE's kernel:
                     ``f32(f32(fp8_max * 2**-margin) / m)``), ``"reciprocal"`` (TE's unfused
                     torch path, whose ``float / tensor`` is ``reciprocal(m) * fp8_max``),
                     ``"divide_then_margin"`` (TE-JAX, flax, Keras: ``(fp8_max / m) / 2**margin``),
                     ``"float64"`` (torchao: in float64, ``m`` floored at ``eps``, then rounded),
                     ``"msamp"`` (MS-AMP's power of two: ``e = floor(log2(reciprocal(m) *
                     fp8_max)) - margin``, ``2**|e|``, inverted when ``e < 0``; its own
                     fallbacks, so ``bad_amax="formula"``).
eps                  ``"float64"``: the floor of ``m`` (torchao 1e-12); otherwise an amax below
                     ``eps`` counts as ``eps`` (TE current scaling's ``amax_epsilon``).
bad_amax             ``m`` zero, inf or nan: ``"keep"`` the scale (TE delayed, flax, Keras),
                     set it to ``"one"`` (TE current scaling), or apply the ``"formula"``
                     anyway (torchao: inf gives 0, nan gives nan).
inf_scale            a scale that overflows to inf becomes ``"flt_max"`` (TE), the largest
                     bfloat16 or float16 (``"bf16_max"``, ``"fp16_max"``: TE's block scaling
                     uses the input dtype's largest value) or stays inf (``"none"``: TE-JAX,
                     flax, Keras, MS-AMP).
pow2                 ``"none"``, ``"mask"`` (TE: the scale's mantissa bits cleared) or
                     ``"floor_log2"`` (torchao: ``exp2(floor(log2(s)))`` with float32 ``log2``,
                     which rounds up just below a power of two).
zero_amax            an amax of 0 is ``"write"``-n into the history, or ``"skip"``-ped: nothing
                     is written and the scale is kept (TE's fused update: "the module did not
                     run").
nonfinite_amax       an inf or nan amax is ``"write"``-n into the history (every anchor but
                     MS-AMP), ``"skip"``-ped and only counted (ampscale's default), or written
                     as ``"zero"`` with the warm-up restarted (MS-AMP's optimizer).
amax_nan             a nan amax is kept (``"keep"``) or read as inf (``"inf"``: MS-AMP, which
                     turns nan into inf before its all-reduce because NCCL's max drops nan).
warmup               ``"none"``; ``"first_amax"`` (torchao's removed delayed scaling: until the
                     first update a cast scales by the tensor's own amax, and the first update
                     writes its amax twice, as torchao's initialisation and sync do);
                     ``"window"`` (MS-AMP: a cast scales by the tensor's own amax until
                     ``history_len`` amaxes were written since the last restart, and always
                     with ``history_len=1``).
history_nan          a nan in the window is ``"drop"``-ped (TE's fused ``fmaxf``) or
                     ``"propagate"``-s (``torch.max``, ``jnp.max``) and freezes the scale.
storage              ``"scale"``: the scale is the state and ``scale_inv = 1/scale``;
                     ``"inverse"``: ``scale_inv`` is the state (flax and Keras store the
                     dequantization scale) and ``scale = 1/scale_inv``.
timing               ``"after_write"``: the new scale sees this step's amax (TE, flax's cast);
                     ``"before_write"``: it sees the window before it (Keras: its cast uses the
                     variable, one step later than flax).
subnormals           ``"keep"``; ``"flush"``: subnormal amaxes count as 0 and subnormal
                     results become 0, as XLA's CPU computes eager ``jnp`` operations (flax,
                     Keras); ``"flush_window"``: only a window's max (a reduction over two or
                     more amaxes) flushes a subnormal to 0, as TE-JAX's jitted update does on
                     XLA's CPU (a single amax keeps its bits there, and its scale is inf).
on_skipped_step      a step the loss scaler skips still ``"record"``-s its amaxes (TE) or
                     ``"freeze"``-s every slot (Keras: the whole apply is skipped).
cast                 how a cast applies the scale: ``"multiply"`` (``q = sat(f32(x) * s)``,
                     ``x ~ f32(q) * s_inv`` rounded to the output dtype: TE, Megatron, MS-AMP),
                     ``"multiply_divide"`` (torchao: the same ``q``, ``x ~ q / s``),
                     ``"multiply_divide_f32"`` (torchao rowwise, whose ``[rows, 1]`` scale
                     promotes the dequantized tensor to float32), ``"divide"`` (flax:
                     ``q = sat(x / S)`` in the compute dtype, ``x ~ q * S`` in ``x``'s dtype) or
                     ``"divide_compute"`` (Keras: the same ``q``, ``x ~ q * S`` in the compute
                     dtype).
==================== ==========================================================================

The history is a ring buffer: each update writes one value per slot (TE's fused update, which
writes nothing for an amax of 0, leaves its ring where it is); the canonical order, oldest
first, appears only in checkpoints and in the accessors that return a history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, Final

from ampscale._config import FLOAT32_MAX, _round_to, shown

__all__ = ["FORMATS", "FP8_PRESETS", "INF_SCALE_VALUES", "ROLES", "Fp8Config", "Fp8Preset", "make_fp8_config"]

#: the largest finite value of each FP8 format (ml_dtypes ``finfo(...).max``)
FORMATS: Final[dict[str, float]] = {
    "e4m3fn": 448.0,
    "e5m2": 57344.0,
    "e4m3fnuz": 240.0,
    "e5m2fnuz": 57344.0,
}
#: ``formats`` setting -> (forward format, backward format)
FORMAT_PAIRS: Final[dict[str, tuple[str, str]]] = {
    "hybrid": ("e4m3fn", "e5m2"),
    "e4m3fn": ("e4m3fn", "e4m3fn"),
    "e5m2": ("e5m2", "e5m2"),
    "e4m3fnuz": ("e4m3fnuz", "e4m3fnuz"),
    "hybrid_fnuz": ("e4m3fnuz", "e5m2fnuz"),
}
#: slot roles: forward tensors (inputs, weights) and backward tensors (gradients)
ROLES: Final = ("forward", "backward")
MAX_HISTORY: Final = 2**20
MAX_MARGIN: Final = 64

_CHOICES: Final[dict[str, tuple[str, ...]]] = {
    "formats": tuple(FORMAT_PAIRS),
    "amax_algo": ("max", "most_recent", "current"),
    "scale_rule": ("divide", "reciprocal", "divide_then_margin", "float64", "msamp"),
    "bad_amax": ("keep", "one", "formula"),
    "inf_scale": ("flt_max", "bf16_max", "fp16_max", "none"),
    "pow2": ("none", "mask", "floor_log2"),
    "zero_amax": ("write", "skip"),
    "nonfinite_amax": ("write", "skip", "zero"),
    "amax_nan": ("keep", "inf"),
    "warmup": ("none", "first_amax", "window"),
    "history_nan": ("drop", "propagate"),
    "storage": ("scale", "inverse"),
    "timing": ("after_write", "before_write"),
    "subnormals": ("keep", "flush", "flush_window"),
    "on_skipped_step": ("record", "freeze"),
    "cast": ("multiply", "multiply_divide", "multiply_divide_f32", "divide", "divide_compute"),
}
#: the largest finite value of the input dtypes a block-scaling scale saturates at
INF_SCALE_VALUES: Final[dict[str, float]] = {
    "flt_max": FLOAT32_MAX,
    "bf16_max": float.fromhex("0x1.fep+127"),
    "fp16_max": 65504.0,
}
#: every setting, in the order of the docs' table (the checkpoint's ``settings`` keys)
SETTINGS_ORDER: Final = (
    "formats",
    "history_len",
    "amax_algo",
    "margin",
    "scale_rule",
    "eps",
    "bad_amax",
    "inf_scale",
    "pow2",
    "zero_amax",
    "nonfinite_amax",
    "history_nan",
    "storage",
    "timing",
    "subnormals",
    "on_skipped_step",
    "amax_nan",
    "warmup",
    "cast",
)
#: the settings that checkpoints of format version 1 did not hold, and the value that reproduces
#: what a version-1 ampscale did (a version-1 checkpoint is read as holding these values)
#: (``None``: the loading scaler's own value; ``cast`` changes how casts apply a scale, never the
#: state a checkpoint holds)
SETTINGS_SINCE_V2: Final[dict[str, Any]] = {"amax_nan": "keep", "warmup": "none", "cast": None}


@dataclasses.dataclass(frozen=True)
class Fp8Preset:
    """One system's FP8 scaling recipe, as defaults for every setting.

    Attributes:
        name: the preset's name (``create_fp8_scaler(preset=...)``).
        system: the system whose scales and histories the preset reproduces.
        source: where its rule lives (repository, file and function).
        defaults: the value of every setting.
    """

    name: str
    system: str
    source: str
    defaults: Mapping[str, Any]


def _preset(name: str, system: str, source: str, **settings: Any) -> Fp8Preset:
    base: dict[str, Any] = {
        "formats": "hybrid",
        "history_len": 1024,
        "amax_algo": "max",
        "margin": 0,
        "scale_rule": "divide",
        "eps": 0.0,
        "bad_amax": "keep",
        "inf_scale": "flt_max",
        "pow2": "none",
        "zero_amax": "write",
        "nonfinite_amax": "write",
        "history_nan": "propagate",
        "storage": "scale",
        "timing": "after_write",
        "subnormals": "keep",
        "on_skipped_step": "record",
        "amax_nan": "keep",
        "warmup": "none",
        "cast": "multiply",
    }
    unknown = set(settings) - set(base)
    assert not unknown, unknown
    base.update(settings)
    return Fp8Preset(name, system, source, base)


_TE = "NVIDIA/TransformerEngine:"
FP8_PRESETS: Final[dict[str, Fp8Preset]] = {
    p.name: p
    for p in [
        _preset(
            "ampscale",
            "ampscale's own delayed scaling: TE's fused rule, but a non-finite amax never enters "
            "the history and a skipped step changes nothing",
            "ampscale/fp8/_transition.py",
            zero_amax="skip",
            nonfinite_amax="skip",
            history_nan="drop",
            on_skipped_step="freeze",
        ),
        _preset(
            "te_delayed",
            "Transformer Engine DelayedScaling, torch, fused update (the default)",
            _TE + "transformer_engine/common/recipe/delayed_scaling.cu (kernel_bulk)",
            zero_amax="skip",
            history_nan="drop",
        ),
        _preset(
            "te_delayed_unfused",
            "Transformer Engine DelayedScaling, torch, NVTE_UNFUSED_FP8_UPDATE=1 or callable algorithms",
            _TE + "transformer_engine/pytorch/quantization.py (_default_get_amax_and_update_history, "
            "_update_amax_history, _default_sf_compute)",
            scale_rule="reciprocal",
        ),
        _preset(
            "te_jax_delayed",
            "Transformer Engine JAX DelayedScaleQuantizer (jitted, on XLA's CPU)",
            _TE
            + "transformer_engine/jax/quantize/quantizer.py (DelayedScaleQuantizer.update, compute_scale_from_amax)",
            scale_rule="divide_then_margin",
            inf_scale="none",
            subnormals="flush_window",
        ),
        _preset(
            "te_current",
            "Transformer Engine Float8CurrentScaling",
            _TE + "transformer_engine/common/recipe/recipe_common.cuh (compute_scale_from_amax)",
            history_len=1,
            amax_algo="current",
            bad_amax="one",
        ),
        _preset(
            "megatron",
            "Megatron-Core delayed scaling (fp8_amax_history_len=1, most_recent) on TE's fused update",
            "NVIDIA/Megatron-LM:megatron/core/fp8_utils.py (get_fp8_recipe), transformer_config.py",
            history_len=1,
            amax_algo="most_recent",
            zero_amax="skip",
            history_nan="drop",
        ),
        _preset(
            "torchao_tensorwise",
            "torchao float8 training, Float8LinearRecipeName.TENSORWISE",
            "pytorch/ao:torchao/float8/float8_utils.py (amax_to_scale)",
            history_len=1,
            amax_algo="current",
            scale_rule="float64",
            eps=1e-12,
            bad_amax="formula",
            inf_scale="none",
            cast="multiply_divide",
        ),
        _preset(
            "torchao_rowwise",
            "torchao float8 training, Float8LinearRecipeName.ROWWISE (one slot per row)",
            "pytorch/ao:torchao/float8/float8_utils.py (amax_to_scale, _round_scale_down_to_power_of_2)",
            formats="e4m3fn",
            history_len=1,
            amax_algo="current",
            scale_rule="float64",
            eps=1e-12,
            bad_amax="formula",
            inf_scale="none",
            pow2="floor_log2",
            cast="multiply_divide_f32",
        ),
        _preset(
            "torchao_delayed",
            "torchao float8 delayed scaling, removed in pytorch/ao#1753 (history 16, newest first)",
            "pytorch/ao@d37019636^:torchao/float8/float8_linear_utils.py (sync_float8_amax_and_scale_history, "
            "_update_history_stack), float8_scaling_utils.py (_maybe_initialize_amaxes_scales_for_float8_cast), "
            "float8_utils.py (amax_history_to_scale_stack, amax_to_scale)",
            history_len=16,
            scale_rule="float64",
            eps=1e-12,
            bad_amax="formula",
            inf_scale="none",
            warmup="first_amax",
            cast="multiply_divide",
        ),
        _preset(
            "flax",
            "flax.linen.fp8_ops (Fp8DotGeneral, Fp8Einsum; on XLA's CPU: subnormals flushed)",
            "google/flax:flax/linen/fp8_ops.py (update_fp8_meta, compute_scale, compute_amax_history)",
            scale_rule="divide_then_margin",
            inf_scale="none",
            storage="inverse",
            subnormals="flush",
            cast="divide",
        ),
        _preset(
            "keras",
            "Keras 3 Dense.quantize('float8') (on JAX's CPU: subnormals flushed)",
            "keras-team/keras:keras/src/layers/core/dense.py (_float8_call), "
            "keras/src/quantizers/quantizers.py (compute_float8_scale)",
            scale_rule="divide_then_margin",
            inf_scale="none",
            storage="inverse",
            timing="before_write",
            subnormals="flush",
            on_skipped_step="freeze",
            cast="divide_compute",
        ),
        _preset(
            "te_block",
            "Transformer Engine Float8BlockScaling: one slot per 1x128 or 128x128 block, scaled by the "
            "block's own amax (see ampscale.fp8.quantize_block)",
            _TE + "transformer_engine/common/recipe/recipe_common.cuh (compute_scale_from_types), "
            "transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu",
            formats="e4m3fn",
            history_len=1,
            amax_algo="current",
            bad_amax="one",
            inf_scale="bf16_max",
            pow2="mask",
        ),
        _preset(
            "msamp",
            "MS-AMP ScalingMeta: power-of-two scales from a window of 16, scaled in time during the warm-up",
            "Azure/MS-AMP:msamp/common/tensor/meta.py (ScalingMeta.compute_scaling_factor, is_in_time_scaling), "
            "msamp/optim/optimizer.py (_update_scaling_factors), msamp/common/tensor/cast.py (cast_to_fp8)",
            history_len=16,
            scale_rule="msamp",
            bad_amax="formula",
            inf_scale="none",
            nonfinite_amax="zero",
            amax_nan="inf",
            warmup="window",
            on_skipped_step="freeze",
        ),
    ]
}


@dataclasses.dataclass(frozen=True, eq=True)
class Fp8Config:
    """The static settings of an FP8 scaler (hashable; never an array leaf).

    Build it with :func:`make_fp8_config`; every field is described in this module's table.
    ``slots`` names the tensors (``"fc1.x"``) and ``roles`` says which are forward tensors and
    which are gradients; the role picks the slot's FP8 format from ``formats``.
    """

    preset: str
    slots: tuple[str, ...]
    roles: tuple[str, ...]
    formats: str
    history_len: int
    amax_algo: str
    margin: int
    scale_rule: str
    eps: float
    bad_amax: str
    inf_scale: str
    pow2: str
    zero_amax: str
    nonfinite_amax: str
    history_nan: str
    storage: str
    timing: str
    subnormals: str
    on_skipped_step: str
    amax_nan: str
    warmup: str
    cast: str

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def size(self) -> int:
        """The number of slots."""
        return len(self.slots)

    @functools.cached_property
    def slot_formats(self) -> tuple[str, ...]:
        """The FP8 format of each slot."""
        forward, backward = FORMAT_PAIRS[self.formats]
        return tuple(forward if role == "forward" else backward for role in self.roles)

    @functools.cached_property
    def slot_max(self) -> tuple[float, ...]:
        """The largest finite value of each slot's format."""
        return tuple(FORMATS[f] for f in self.slot_formats)

    @property
    def eps_value(self) -> float:
        """``eps`` as the transition uses it: float64 for ``"float64"``, else rounded to float32."""
        return self.eps if self.scale_rule == "float64" else _round_to(self.eps, "float32")

    def settings(self) -> dict[str, Any]:
        """Every setting but the slots, in the table's order (a checkpoint's ``settings``)."""
        return {name: getattr(self, name) for name in SETTINGS_ORDER}

    def replace(self, **settings: Any) -> Fp8Config:
        """A copy with some settings changed, validated again."""
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown FP8 setting(s) {unknown}; accepted: {['slots', 'roles', *SETTINGS_ORDER]}")
        return dataclasses.replace(self, **settings)


def _fail(setting: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"FP8 setting {setting!r} must be {accepted}; got {shown(value)}")


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, or inf for an integer too large for a float (refused as out of range)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _validate(c: Fp8Config) -> None:
    if c.preset not in FP8_PRESETS:
        raise _fail("preset", c.preset, f"one of {sorted(FP8_PRESETS)}")
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        if not isinstance(value, str) or value not in choices:
            raise _fail(name, value, f"one of {list(choices)}")
    if not _is_int(c.history_len) or not 1 <= c.history_len <= MAX_HISTORY:
        raise _fail("history_len", c.history_len, f"an integer from 1 to {MAX_HISTORY}")
    if not _is_int(c.margin) or not 0 <= c.margin <= MAX_MARGIN:
        raise _fail("margin", c.margin, f"an integer from 0 to {MAX_MARGIN} (2**-margin is then exact)")
    if isinstance(c.eps, bool) or not isinstance(c.eps, numbers.Real) or not 0.0 <= _as_float(c.eps) <= FLOAT32_MAX:
        raise _fail("eps", c.eps, "a finite number >= 0")
    if not isinstance(c.slots, tuple) or not c.slots:
        raise _fail("slots", c.slots, "a non-empty tuple of slot names")
    if not all(isinstance(s, str) and s for s in c.slots) or len(set(c.slots)) != len(c.slots):
        raise _fail("slots", c.slots, "distinct non-empty strings")
    if not isinstance(c.roles, tuple) or len(c.roles) != len(c.slots) or any(r not in ROLES for r in c.roles):
        raise _fail("roles", c.roles, f"one of {list(ROLES)} per slot ({len(c.slots)} slots)")
    if c.storage == "inverse" and c.bad_amax == "one":
        raise _fail("bad_amax", c.bad_amax, "'keep' or 'formula' with storage='inverse'")
    if c.amax_algo == "current" and c.timing == "before_write":
        raise _fail("timing", c.timing, "'after_write' with amax_algo='current' (the scale of this step's amax)")
    if c.scale_rule == "msamp" and c.bad_amax != "formula":
        raise _fail("bad_amax", c.bad_amax, "'formula' with scale_rule='msamp' (MS-AMP's rule has its own fallbacks)")
    if c.warmup != "none" and c.amax_algo == "current":
        raise _fail("warmup", c.warmup, "'none' with amax_algo='current' (current scaling is always in time)")


def normalise_slots(slots: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``slots`` as ``(names, roles)``.

    Accepted: an int ``n`` (``n`` forward slots named ``"0"`` ... ``"n-1"``), a sequence of names
    (all forward), or a mapping from name to role.
    """
    if _is_int(slots):
        if slots < 1:
            raise _fail("slots", slots, "a positive number of slots, a list of names, or a dict of name -> role")
        names = tuple(str(i) for i in range(int(slots)))
        return names, ("forward",) * len(names)
    if isinstance(slots, Mapping):
        names = tuple(slots)
        roles = tuple(slots.values())
        for name, role in zip(names, roles, strict=True):
            if role not in ROLES:
                raise _fail(f"slots[{name!r}]", role, f"one of {list(ROLES)}")
        return names, roles
    if isinstance(slots, (list, tuple)) and all(isinstance(s, str) for s in slots):
        return tuple(slots), ("forward",) * len(slots)
    raise _fail("slots", slots, "a positive number of slots, a list of names, or a dict of name -> role")


def make_fp8_config(preset: str = "ampscale", slots: Any = 1, **settings: Any) -> Fp8Config:
    """The config of ``preset`` for ``slots``, with some settings overridden.

    Args:
        preset: one of :data:`FP8_PRESETS`.
        slots: an int, a list of names (forward slots) or a dict of name -> ``"forward"`` /
            ``"backward"``.
        **settings: any setting of this module's table.

    Raises:
        ValueError: an unknown preset or a setting out of range (the message names it, the
            value and what is accepted).
        TypeError: an unknown setting name.
    """
    if not isinstance(preset, str) or preset not in FP8_PRESETS:
        raise _fail("preset", preset, f"one of {sorted(FP8_PRESETS)}")
    unknown = sorted(set(settings) - set(SETTINGS_ORDER))
    if unknown:
        raise TypeError(f"unknown FP8 setting(s) {unknown}; accepted: {list(SETTINGS_ORDER)}")
    names, roles = normalise_slots(slots)
    values = {**FP8_PRESETS[preset].defaults, **settings}
    if isinstance(values["eps"], numbers.Real) and not isinstance(values["eps"], bool):
        with contextlib.suppress(OverflowError):  # an integer beyond a float stays as given, for the message
            values["eps"] = float(values["eps"])
    return Fp8Config(preset=preset, slots=names, roles=roles, **values)
