"""Every preset reproduces its system's scale trajectory exactly.

Two kinds of evidence: hand-derived trajectories for the cases where the systems differ
(``shared/reference/scaler-semantics.md`` section 3), and hypothesis-generated settings and
finite/non-finite sequences run side by side with the independent reference models of
``reference_models.py``.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale
from tests.conftest import FRAMEWORKS
from tests.reference_models import (
    F32_MAX,
    F32_TINY,
    ApexHysteresisKernel,
    DeepSpeedDynamicLossScaler,
    reference_for,
)

T, F = True, False


def trajectory(scaler: ampscale.Scaler, steps: list[bool]) -> list[float]:
    out = []
    for finite in steps:
        scaler = scaler.update(finite)
        out.append(scaler.get_scale())
    return out


def reference_trajectory(model, steps: list[bool]) -> list[float]:
    out = []
    for finite in steps:
        model.step(finite)
        out.append(float(model.scale))
    return out


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=False))


SCALE_RANGES = {"float32": (F32_TINY, F32_MAX), "float64": (2.0**-1022, sys.float_info.max)}


def same_within_range(ours: list[float], theirs: list[float], scale_dtype: str) -> bool:
    """The reference trajectory, step for step, while it stays in the scale dtype's normal
    range; from the step where it leaves it (through the subnormals to 0, or to inf) ampscale
    stops at the range's edge instead, and stays in the range from then on."""
    low, high = SCALE_RANGES[scale_dtype]
    for index, (x, y) in enumerate(zip(ours, theirs, strict=True)):
        if not low <= y <= high:
            return x in (low, high) and all(low <= z <= high for z in ours[index:])
        if x != y:
            return False
    return True


# --------------------------------------------------------------- hand-derived trajectories


def test_defaults_follow_torch() -> None:
    scaler = ampscale.create_scaler()
    c = scaler.config
    assert (c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    assert c.hysteresis == 1
    assert c.min_scale is None
    assert c.max_scale is None
    assert c.on_floor == "ignore"


@pytest.mark.parametrize(
    ("preset", "grow_at"),
    [
        ("torch", [3, 6, 9]),  # the N-th consecutive finite step
        ("jmp", [3, 6, 9]),
        ("keras", [3, 6, 9]),
        ("megatron", [3, 6, 9]),
        ("paddle", [3, 6, 9]),
        ("flax", [4, 8]),  # the N+1-th: fin_steps is compared before its increment
        ("deepspeed", [4, 7]),  # first after N+1 steps, then every N
        ("tf_keras", [3, 6, 9]),
    ],
)
def test_growth_timing(preset: str, grow_at: list[int]) -> None:
    scaler = ampscale.create_scaler(
        preset=preset,
        init_scale=1.0,
        growth_interval=3,
        min_scale=None,
        **({"on_floor": "ignore"} if preset == "deepspeed" else {}),
    )
    scales = trajectory(scaler, [T] * 9)
    grown = [i + 1 for i in range(9) if scales[i] > (scales[i - 1] if i else 1.0)]
    assert grown == grow_at


def test_deepspeed_growth_restarts_after_overflow() -> None:
    scaler = ampscale.create_scaler(preset="deepspeed", init_scale=8.0, growth_interval=2, hysteresis=1, min_scale=1)
    # overflow at step 1, then growth on the 3rd finite step after it, then every 2
    assert trajectory(scaler, [F, T, T, T, T, T]) == [4.0, 4.0, 4.0, 8.0, 8.0, 16.0]


@pytest.mark.parametrize(
    ("preset", "mode", "backoff_at"),
    [
        ("megatron", "cumulative", [3, 4, 5]),  # budget refills only on growth
        ("deepspeed", "cumulative", [3, 4, 5]),
        ("apex", "consecutive", [4, 5]),  # refills on every finite step
        ("deepspeed", "consecutive", [4, 5]),
        ("paddle", "every_n", [4]),  # n consecutive overflows, counter reset after each backoff
    ],
)
def test_hysteresis_with_non_consecutive_overflows(preset: str, mode: str, backoff_at: list[int]) -> None:
    """``F T F F F`` at hysteresis 2 (section 3, item 4)."""
    scaler = ampscale.create_scaler(
        preset=preset,
        init_scale=1024.0,
        hysteresis=2,
        hysteresis_mode=mode,
        growth_interval=100,
        min_scale=None,
        **({"on_floor": "ignore"} if preset == "deepspeed" else {}),
    )
    scales = trajectory(scaler, [F, T, F, F, F])
    backed = [i + 1 for i in range(5) if scales[i] < (scales[i - 1] if i else 1024.0)]
    assert backed == backoff_at


def test_absorbed_overflow_still_resets_growth_counter() -> None:
    scaler = ampscale.create_scaler(preset="megatron", init_scale=4.0, growth_interval=3, hysteresis=2)
    # T T F(absorbed) T T T: the absorbed overflow restarts the count, growth on the 3rd T after it
    assert trajectory(scaler, [T, T, F, T, T, T]) == [4.0, 4.0, 4.0, 4.0, 4.0, 8.0]


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("torch", [0.5, 0.25, 0.125]),  # no floor
        ("keras", [0.5, 0.25, 0.125]),
        ("paddle", [0.5, 0.25, 0.125]),
        ("jmp", [1.0, 1.0, 1.0]),  # floor 1
        ("mindspore", [1.0, 1.0, 1.0]),
        ("tf_keras", [1.0, 1.0, 1.0]),
        ("megatron", [1.0, 1.0, 1.0]),
    ],
)
def test_backoff_floor(preset: str, expected: list[float]) -> None:
    kwargs = {"hysteresis": 1} if preset == "megatron" else {}
    scaler = ampscale.create_scaler(preset=preset, init_scale=1.0, **kwargs)
    assert trajectory(scaler, [F, F, F]) == expected


def test_flax_floor_is_float32_tiny_and_none_stops_there_too() -> None:
    scaler = ampscale.create_scaler(preset="flax", init_scale=F32_TINY * 2)
    assert trajectory(scaler, [F, F]) == [F32_TINY, F32_TINY]
    # no floor: the scale stops at float32's smallest normal value, never reaching 0
    scaler = ampscale.create_scaler(preset="flax", init_scale=2.0**-125, min_scale=None)
    assert trajectory(scaler, [F, F, F]) == [2.0**-126, 2.0**-126, 2.0**-126]


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("torch", 2.0**127),  # growth skipped when it would not be finite
        ("jmp", 2.0**127),
        ("flax", F32_MAX),  # clamped to exactly float32 max
        ("keras", F32_MAX),  # no max_scale: clamped to float32 max (Keras itself reaches inf)
        ("megatron", F32_MAX),
        ("paddle", F32_MAX),
    ],
)
def test_growth_ceiling(preset: str, expected: float) -> None:
    interval = 0 if preset == "flax" else 1
    kwargs = {"hysteresis": 1} if preset == "megatron" else {}
    scaler = ampscale.create_scaler(preset=preset, init_scale=2.0**127, growth_interval=interval, **kwargs)
    assert trajectory(scaler, [T, T])[-1] == expected


def test_apex_caps_growth_and_refuses_an_initial_scale_above_the_cap() -> None:
    scaler = ampscale.create_scaler(preset="apex", init_scale=2.0**24, growth_interval=1)
    assert trajectory(scaler, [T, F, T]) == [2.0**24, 2.0**23, 2.0**24]
    # apex would silently start at its cap; a contradiction is refused instead
    with pytest.raises(ValueError, match="init_scale"):
        ampscale.create_scaler(preset="apex", init_scale=2.0**30)


def test_deepspeed_keeps_growing_past_float32_in_float64() -> None:
    scaler = ampscale.create_scaler(preset="deepspeed", init_scale=2.0**126, growth_interval=1)
    assert trajectory(scaler, [T, T, T, T]) == [2.0**126, 2.0**127, 2.0**128, 2.0**129]


def test_counter_rules_past_the_interval() -> None:
    """A tracker loaded at or past the interval: ``==`` stalls, modulo wraps, ``>=`` grows."""

    def loaded(preset: str, tracker: int) -> ampscale.Scaler:
        scaler = ampscale.create_scaler(preset=preset, init_scale=2.0, growth_interval=4)
        d = scaler.state_dict()
        d["ampscale"]["state"]["growth_tracker"] = d["_growth_tracker"] = tracker  # both say the same
        return scaler.load_state_dict(d)

    assert trajectory(loaded("torch", 5), [T] * 6) == [2.0] * 6  # stalls until an overflow
    # jmp: counter 7 -> (7+1) % 4 = 0 without growth, then grows on the 4th step
    assert trajectory(loaded("jmp", 7), [T] * 5) == [2.0, 2.0, 2.0, 2.0, 4.0]
    assert trajectory(loaded("tf_keras", 5), [T, T]) == [4.0, 4.0]  # counter+1 >= steps


def test_static_and_guard_modes_never_move_but_count_skips() -> None:
    static = ampscale.create_scaler(mode="static", init_scale=128.0)
    assert trajectory(static, [F, F, T, T]) == [128.0] * 4
    guard = ampscale.create_scaler(mode="guard")
    assert guard.get_scale() == 1.0
    g = guard
    for finite in [F, T, F]:
        g = g.update(finite)
    assert g.get_scale() == 1.0
    assert int(g.state.skipped_steps) == 2
    assert int(g.state.steps) == 3


def test_deepspeed_raises_at_floor_like_deepspeed() -> None:
    scaler = ampscale.create_scaler(preset="deepspeed", init_scale=4.0, hysteresis=1)
    model = DeepSpeedDynamicLossScaler(init_scale=4.0, delayed_shift=1)
    for _ in range(2):
        scaler = scaler.update(False)
        model.step(False)
    assert scaler.get_scale() == model.scale == 1.0
    with pytest.raises(DeepSpeedDynamicLossScaler.AtMinimum):
        model.step(False)
    with pytest.raises(ampscale.ScaleAtFloorError, match="floor") as info:
        scaler.update(False)
    assert info.value.scale == 1.0
    assert info.value.step == 2
    assert scaler.get_scale() == 1.0  # the scaler that raised is unchanged


# --------------------------------------------------------------- hypothesis vs reference models

POW2 = [2.0**k for k in (-20, -3, 0, 1, 10, 15, 16, 24, 32, 100, 120, 126)]
SCALES = st.sampled_from([*POW2, 1000.0, 3.0, 0.3, 12345.678])
GROWTH = st.sampled_from([2.0, 1.5, 3.0, 4.0, 1.1, 1.0001])
BACKOFF = st.sampled_from([0.5, 0.25, 0.75, 0.9, 0.1])
HYST = st.integers(1, 4)


@st.composite
def sequences(draw: st.DrawFn) -> list[bool]:
    """Runs of finite and non-finite steps: long finite runs reach ceilings, long overflow runs
    reach floors, short runs exercise hysteresis and counter resets."""
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 60)), min_size=1, max_size=12))
    steps = [value for value, length in runs for _ in range(length)]
    return steps[:400]


SETTINGS = {
    "torch": st.fixed_dictionaries(
        {"init_scale": SCALES, "growth_factor": GROWTH, "backoff_factor": BACKOFF, "growth_interval": st.integers(1, 6)}
    ),
    "jmp": st.fixed_dictionaries(
        {
            "init_scale": SCALES,
            "growth_factor": st.sampled_from([2, 3, 4, 1.5]),
            "growth_interval": st.integers(1, 6),
            "min_scale": st.sampled_from([1.0, 0.25, 2.0**-10, 0.0]),
        }
    ),
    "flax": st.fixed_dictionaries(
        {
            "init_scale": SCALES,
            "growth_factor": GROWTH,
            "backoff_factor": BACKOFF,
            "growth_interval": st.integers(0, 5),
            "min_scale": st.sampled_from([F32_TINY, None, 0.5, 1.0]),
        }
    ),
    "keras": st.fixed_dictionaries({"init_scale": SCALES, "growth_interval": st.integers(1, 6)}),
    "megatron": st.fixed_dictionaries(
        {
            "init_scale": st.sampled_from([2.0**32, 2.0**16, 1000.0, 2.0**120]),
            "min_scale": st.sampled_from([1.0, 0.5, 2.0**-10, 3.0]),
            "growth_factor": GROWTH,
            "backoff_factor": BACKOFF,
            "growth_interval": st.integers(1, 6),
            "hysteresis": HYST,
        }
    ),
    "deepspeed": st.fixed_dictionaries(
        {
            "init_scale": st.sampled_from([2.0**16, 2.0**32, 1000.0, 2.0**120]),
            "growth_interval": st.integers(1, 6),
            "min_scale": st.sampled_from([1.0, 0.25, 2.0**-10]),
            "hysteresis": HYST,
            "hysteresis_mode": st.sampled_from(["cumulative", "consecutive"]),
        }
    ),
    "apex": st.fixed_dictionaries(
        {
            "init_scale": SCALES,
            "growth_interval": st.integers(1, 6),
            "min_scale": st.sampled_from([None, 1.0, 0.25]),
            "max_scale": st.sampled_from([2.0**24, 2.0**10, 2.0**40]),
        }
    ),
    "paddle": st.fixed_dictionaries(
        {
            "init_scale": SCALES,
            "growth_factor": GROWTH,
            "backoff_factor": BACKOFF,
            "growth_interval": st.integers(1, 6),
            "hysteresis": HYST,
        }
    ),
    "mindspore": st.fixed_dictionaries(
        {"init_scale": SCALES, "growth_factor": st.sampled_from([2, 3, 4]), "growth_interval": st.integers(1, 6)}
    ),
    "tf_keras": st.fixed_dictionaries({"init_scale": SCALES, "growth_interval": st.integers(1, 6)}),
}


def _valid(preset: str, s: dict) -> bool:
    """Settings that do not contradict each other (ampscale refuses the others at creation)."""
    defaults = ampscale.PRESETS[preset].defaults
    low, high = s.get("min_scale", defaults["min_scale"]), s.get("max_scale", defaults["max_scale"])
    if low is not None and not 0 < low <= s["init_scale"]:
        return False
    return high is None or (s["init_scale"] <= high and (low is None or low <= high))


def _extra(preset: str) -> dict:
    return {"on_floor": "ignore"} if preset == "deepspeed" else {}


@pytest.mark.parametrize("preset", sorted(SETTINGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_preset_matches_reference_model(preset: str, data: st.DataObject) -> None:
    s = data.draw(SETTINGS[preset])
    if not _valid(preset, s):
        return
    steps = data.draw(sequences())
    scaler = ampscale.create_scaler(backend="numpy", preset=preset, **s, **_extra(preset))
    ours = trajectory(scaler, steps)
    theirs = reference_trajectory(reference_for(preset, **s), steps)
    assert same_within_range(ours, theirs, scaler.config.scale_dtype), (preset, s)


@settings(max_examples=150, deadline=None)
@given(init=SCALES, growth=GROWTH, backoff=BACKOFF, interval=st.integers(1, 6), hysteresis=HYST, steps=sequences())
def test_consecutive_hysteresis_matches_apex_kernel(init, growth, backoff, interval, hysteresis, steps) -> None:
    """torch's rule plus ``hysteresis_mode="consecutive"`` is apex's ``update_scale_hysteresis``."""
    scaler = ampscale.create_scaler(
        backend="numpy",
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
        hysteresis_mode="consecutive",
    )
    model = ApexHysteresisKernel(init, growth, backoff, interval, hysteresis)
    assert same_within_range(trajectory(scaler, steps), reference_trajectory(model, steps), "float32")


# --------------------------------------------------------------- every backend, same transition

ARRAY_FRAMEWORKS = [f for f in FRAMEWORKS if f.name != "numpy" and not f.gpu]


@pytest.mark.parametrize("framework", ARRAY_FRAMEWORKS, ids=[f.name for f in ARRAY_FRAMEWORKS])
@pytest.mark.parametrize("preset", sorted(ampscale.PRESETS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=sequences(), interval=st.integers(1, 4), hysteresis=HYST)
def test_every_backend_runs_the_same_transition(framework, preset, steps, interval, hysteresis) -> None:
    """The array-kernel path (device state) equals the host path field by field."""
    kwargs = {"preset": preset, "growth_interval": interval, "hysteresis": hysteresis, **_extra(preset)}
    if preset in ("deepspeed", "apex") and framework.name == "jax":
        kwargs["scale_dtype"] = "float32"
    host = ampscale.create_scaler(backend="numpy", **kwargs)
    device = ampscale.create_scaler(backend=framework.backend, **kwargs)
    flag = framework.array(np.float32(1.0))
    for finite in steps[:120]:
        host = host.update(finite)
        device = device.update(ampscale.all_finite([flag if finite else framework.array(np.float32(np.inf))]))
        assert host.state_dict()["ampscale"]["state"] == device.state_dict()["ampscale"]["state"]


@pytest.mark.parametrize("preset", sorted(ampscale.PRESETS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=sequences(), interval=st.integers(1, 4), hysteresis=HYST, loss_bad=st.booleans())
def test_plain_namespace_with_cached_constants_runs_the_same_transition(
    preset, steps, interval, hysteresis, loss_bad
) -> None:
    """The eager GPU backends' transition (framework calls, constants made once and reused
    across steps) equals the host transition, field by field; NumPy stands in for the module."""
    from ampscale._core import initial_values, transition
    from ampscale._ops import ArrayOps, HostOps, PlainNamespace

    config = ampscale.create_scaler(
        preset=preset, growth_interval=interval, hysteresis=hysteresis, **_extra(preset)
    ).config
    xp = PlainNamespace(np, np.bool_, lambda x, dtype: x.astype(dtype), lambda v, dtype, device: np.full((), v, dtype))
    ops = ArrayOps(config, xp, None, True, cache_constants=True)
    host_ops = HostOps(config)
    host = initial_values(config)
    storage = np.float64 if config.scale_dtype == "float64" else np.float32
    state = type(host)(*(np.asarray(v, dtype=np.int32 if isinstance(v, int) else storage) for v in host))
    for finite in steps[:120]:
        loss_ok = finite or not loss_bad
        host, host_event = transition(config, host, finite, loss_ok, host_ops)
        state, event = transition(config, state, np.bool_(finite), np.bool_(loss_ok), ops)
        assert [float(v) for v in state] == [float(v) for v in host]
        assert bool(event) == bool(host_event)
    assert ops._constants  # the constants were cached and reused across the steps


@pytest.mark.parametrize("mode", ["dynamic", "static", "guard"])
@pytest.mark.parametrize("preset", sorted(SETTINGS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_host_transition_equals_the_interpreted_one(preset: str, mode: str, data: st.DataObject) -> None:
    """The host backends run ``transition`` traced and compiled into one function
    (``HostOps.run``); field by field, value and type, and the floor event, it equals
    ``transition`` interpreted with ``HostOps``, for every preset's settings and both reasons
    a step can be skipped (loss or gradients)."""
    from ampscale._core import initial_values, transition
    from ampscale._ops import HostOps

    s = data.draw(SETTINGS[preset])
    if not _valid(preset, s):
        return
    steps = data.draw(sequences())
    loss_bad = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    if mode == "guard":
        s = {k: v for k, v in s.items() if k != "init_scale"}  # guard never scales
    config = ampscale.create_scaler(preset=preset, mode=mode, on_floor="ignore", **s).config
    ops = HostOps(config)
    interpreted = compiled = initial_values(config)
    for finite, loss in zip(steps, loss_bad, strict=True):
        loss_ok = finite or not loss
        interpreted, event = transition(config, interpreted, finite, loss_ok, ops)
        compiled, compiled_event = ops.run(compiled, finite, loss_ok)
        assert compiled == interpreted
        assert [type(v) for v in compiled] == [type(v) for v in interpreted]
        assert type(compiled) is type(interpreted)
        assert compiled_event is event


def test_compiled_transition_source_is_straight_line_code() -> None:
    """The compiled function has no loops or calls but the memoised grow/shrink and ``bool``;
    ``grow``/``shrink`` are only evaluated on the branch that takes them."""
    from ampscale._ops import HostOps

    ops = HostOps(ampscale.create_scaler(preset="megatron").config)
    for source in (ops.run.source, ops.run_split.source):  # the whole state, and the split one
        assert "for " not in source
        assert "while " not in source
        assert source.count("_grow(") == 1
        assert source.count("_shrink(") == 1
        # conditional operands, not statements evaluated every step
        assert "(_grow(scale) if " in source
        assert "(_shrink(scale) if " in source
    # the finite step, both flags folded in: it may grow, it never backs off
    finite_step = ops.run_split_ok.source
    assert "for " not in finite_step
    assert "while " not in finite_step
    assert finite_step.count("_grow(") == 1
    assert "(_grow(scale) if " in finite_step
    assert "_shrink(" not in finite_step
    assert "bool(" not in finite_step


def test_tracing_rejects_a_branch_on_a_value() -> None:
    """A transition that branched on a state value would be wrong on device backends; tracing
    it for the host fails loudly instead of baking one branch into the compiled function."""
    from ampscale._codegen import _Node

    with pytest.raises(TypeError, match="branched on a traced value"):
        bool(_Node("input", "int") >= 1)
