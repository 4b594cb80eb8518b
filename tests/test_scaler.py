"""The public contract of SPEC.md, on every installed backend."""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings

import numpy as np
import pytest

import ampscale
from tests.conftest import FRAMEWORKS, Framework

# ----------------------------------------------------------------------------- scale


def test_scale_multiplies_and_follows_framework_promotion(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=1024.0)
    loss = fw.array(0.5, "float32")
    scaled = scaler.scale(loss)
    assert type(scaled) is type(loss)
    assert float(scaled) == 512.0
    if "float16" in fw.dtypes:
        half = scaler.scale(fw.array(0.5, "float16"))
        assert "float32" in str(half.dtype)  # a float32 scale promotes a 0-d half loss


def test_scale_detects_backend_lazily_and_guard_returns_the_loss(fw: Framework) -> None:
    loss = fw.array(2.0, "float32")
    assert float(ampscale.create_scaler(init_scale=4.0).scale(loss)) == 8.0
    guard = ampscale.create_scaler(mode="guard")
    assert guard.scale(loss) is loss


# ----------------------------------------------------------------------------- unscale


def test_unscale_trees_of_every_shape(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=8.0)
    tree = {
        "layer": [fw.array([8.0, 16.0]), (fw.array(24.0), None)],
        "bias": fw.array([32.0]),
    }
    out, finite = scaler.unscale(tree)
    assert bool(finite)
    assert set(out) == {"layer", "bias"}  # JAX rebuilds dicts with sorted keys
    assert out["layer"][1][1] is None
    assert isinstance(out["layer"][1], tuple)
    np.testing.assert_array_equal(fw.to_numpy(out["layer"][0]), [1.0, 2.0])
    assert float(out["layer"][1][0]) == 3.0
    np.testing.assert_array_equal(fw.to_numpy(out["bias"]), [4.0])


def test_a_scaled_loss_that_overflowed_counts_as_an_overflow(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=2.0**16)
    loss = fw.array(np.inf, "float32")
    grads = [fw.array([1.0, 2.0])]
    _, finite = scaler.unscale(grads, loss=scaler.scale(loss))
    assert not bool(finite)
    _params, _opt_state, scaler = scaler.step(
        lambda p, g, s: ([x * 0 for x in p], s), [fw.array([5.0])], [fw.array([1.0])], (), loss=scaler.scale(loss)
    )
    assert scaler.get_scale() == 2.0**15
    outcome = scaler.outcome.to_dict()
    assert outcome["applied"] is False
    assert outcome["reason"] == "loss"
    assert outcome["loss_overflows"] == 1
    assert outcome["grad_overflows"] == 0


def test_update_is_functional(fw: Framework) -> None:
    first = ampscale.create_scaler(backend=fw.backend, init_scale=4.0, growth_interval=1)
    second = first.update(fw.array(True, "bool") if False else True)
    assert first.get_scale() == 4.0
    assert second.get_scale() == 8.0
    with pytest.raises(AttributeError, match="immutable"):
        first.anything = 1  # type: ignore[attr-defined]


def test_step_applies_or_skips_bitwise(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=2.0, growth_interval=10)
    params = {"w": fw.array([1.0, 2.0, 3.0]), "b": fw.array(0.5)}
    opt_state = {"momentum": fw.array([0.1, 0.2, 0.3]), "count": fw.array(7, "int32")}

    def sgd(p, g, s):
        return (
            {k: p[k] - 0.1 * g[k] for k in p},
            {"momentum": s["momentum"] * 0.9 + g["w"], "count": s["count"] + 1},
        )

    good = {"w": fw.array([2.0, 2.0, 2.0]), "b": fw.array(2.0)}
    new_params, new_state, scaler = scaler.step(sgd, params, good, opt_state)
    np.testing.assert_allclose(fw.to_numpy(new_params["w"]), [0.9, 1.9, 2.9], rtol=1e-6)
    assert int(new_state["count"]) == 8
    assert bool(scaler.outcome.applied)

    bad = {"w": fw.array([2.0, np.nan, 2.0]), "b": fw.array(2.0)}
    before = {k: fw.to_numpy(v).copy() for k, v in new_params.items()}
    before_state = {k: fw.to_numpy(v).copy() for k, v in new_state.items()}
    skipped_params, skipped_state, scaler = scaler.step(sgd, new_params, bad, new_state)
    for k in before:
        assert fw.to_numpy(skipped_params[k]).tobytes() == before[k].tobytes()
    for k in before_state:
        assert fw.to_numpy(skipped_state[k]).tobytes() == before_state[k].tobytes()
    assert scaler.get_scale() == 1.0
    out = scaler.outcome.to_dict()
    assert out == {
        "applied": False,
        "reason": "gradients",
        "scale_before": 2.0,
        "scale_after": 1.0,
        "steps": 2,
        "skipped_steps": 1,
        "loss_overflows": 0,
        "grad_overflows": 1,
    }


def test_host_step_does_not_even_call_update_fn_on_overflow() -> None:
    """Once ``update_fn`` was checked (its first run, on copies, comes before its first step
    whatever the flag), a host backend does not call it on an overflowing step."""
    calls = []

    def update_fn(p, g, s):
        calls.append(1)
        return [x.copy() for x in p], s

    scaler = ampscale.create_scaler(backend="numpy")
    scaler.step(update_fn, [np.ones(2)], [np.array([np.inf, 1.0])], ())
    assert calls == [1]  # the check, on copies
    scaler.step(update_fn, [np.ones(2)], [np.array([np.inf, 1.0])], ())
    assert calls == [1]


def test_outcome_before_any_step() -> None:
    outcome = ampscale.create_scaler().outcome
    assert outcome.reason == -1
    assert not bool(outcome.applied)
    assert ampscale.StepOutcome.reason_name(-1) == "no step yet"


# ----------------------------------------------------------------------------- floor reactions


def _at_floor(**settings) -> ampscale.Scaler:
    return ampscale.create_scaler(backend="numpy", init_scale=2.0, min_scale=1.0, **settings).update(False)


def test_floor_raise_warn_callback_ignore() -> None:
    with pytest.raises(ampscale.ScaleAtFloorError) as info:
        _at_floor(on_floor="raise").update(False)
    assert info.value.consecutive == 1
    assert info.value.scale == 1.0

    with pytest.warns(ampscale.ScaleAtFloorWarning, match="floor"):
        _at_floor(on_floor="warn").update(False)

    events: list[ampscale.FloorEvent] = []
    scaler = _at_floor(on_floor=events.append, floor_patience=3)
    for _ in range(4):
        scaler = scaler.update(False)
    assert [e.consecutive for e in events] == [3, 4]
    assert events[0].reason == "gradients"
    assert events[0].scale == 1.0
    scaler = scaler.update(True).update(False)  # a finite step resets the count
    assert len(events) == 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _at_floor().update(False).update(False)  # torch's default: keep going silently


def test_warnings_thin_out_in_an_overflow_storm() -> None:
    scaler = _at_floor(on_floor="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(100):
            scaler = scaler.update(False)
    assert len(caught) == 7  # at 1, 2, 4, 8, 16, 32 and 64 overflows in a row


def test_floor_reaction_on_device_backends(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=1.0, min_scale=1.0, on_floor="raise")
    flag = ampscale.all_finite([fw.array([np.inf])])
    with pytest.raises(ampscale.ScaleAtFloorError):
        scaler.update(flag)


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_is_json_and_round_trips(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, preset="megatron", init_scale=2.0**20, growth_interval=3)
    for finite in [True, False, True, True, False, False, True]:
        scaler = scaler.update(finite)
    d = scaler.state_dict()
    restored = ampscale.create_scaler(backend=fw.backend).load_state_dict(json.loads(json.dumps(d)))
    assert restored.config == scaler.config
    assert restored.state_dict() == d
    a, b = scaler, restored
    for finite in [True] * 5 + [False, True]:
        a, b = a.update(finite), b.update(finite)
        assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("target", FRAMEWORKS, ids=[f.name for f in FRAMEWORKS])
def test_checkpoint_moves_between_backends(fw: Framework, target: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, preset="paddle", hysteresis=2, growth_interval=2)
    for finite in [False, True, False, False, True]:
        scaler = scaler.update(finite)
    moved = ampscale.create_scaler(backend=target.backend).load_state_dict(scaler.state_dict())
    for finite in [True, True, False, False, True, True]:
        scaler, moved = scaler.update(finite), moved.update(finite)
        assert scaler.state_dict() == moved.state_dict()


def test_loads_torch_grad_scaler_dicts() -> None:
    torch_dict = {
        "scale": 1024.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }
    scaler = ampscale.create_scaler(backend="numpy").load_state_dict(torch_dict)
    assert scaler.get_scale() == 1024.0
    assert (scaler.config.growth_factor, scaler.config.backoff_factor, scaler.config.growth_interval) == (4.0, 0.25, 3)
    assert scaler.update(True).get_scale() == 4096.0  # tracker 2 + 1 == 3
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        assert key in scaler.state_dict()


def test_state_dict_before_backend_is_known() -> None:
    d = ampscale.create_scaler(preset="jmp", init_scale=64.0).update(False).state_dict()
    pending = ampscale.create_scaler().load_state_dict(d)
    assert pending.get_scale() == 32.0
    assert pending.state_dict() == d
    assert pending.update(np.bool_(False)).get_scale() == 16.0


def test_pickle_and_copy(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, preset="flax", growth_interval=1).update(True).update(False)
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        assert clone.config == scaler.config


# ----------------------------------------------------------------------------- bad configuration

BAD_SETTINGS = [
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"growth_factor": 0.5}, "growth_factor"),
    ({"growth_factor": math.inf}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"backoff_factor": -0.5}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.5}, "growth_interval"),
    ({"growth_interval": True}, "growth_interval"),
    ({"init_scale": math.nan}, "init_scale"),
    ({"init_scale": math.inf}, "init_scale"),
    ({"init_scale": -1.0}, "init_scale"),
    ({"init_scale": 0.0}, "init_scale"),
    ({"init_scale": 1e39}, "init_scale"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"min_scale": 4.0, "max_scale": 2.0}, "min_scale"),
    ({"min_scale": -1.0}, "min_scale"),
    ({"min_scale": math.nan}, "min_scale"),
    ({"max_scale": 0.0}, "max_scale"),
    ({"on_floor": "explode"}, "on_floor"),
    ({"floor_patience": 0}, "floor_patience"),
    ({"mode": "auto"}, "mode"),
    ({"counter_rule": "less"}, "counter_rule"),
    ({"hysteresis_mode": "sometimes"}, "hysteresis_mode"),
    ({"ceiling": "none"}, "ceiling"),
    ({"scale_dtype": "float16"}, "scale_dtype"),
    ({"mode": "guard", "init_scale": 2.0}, "init_scale"),
]


@pytest.mark.parametrize(("settings", "name"), BAD_SETTINGS, ids=[n for _, n in BAD_SETTINGS])
def test_bad_configuration_raises_naming_the_setting(settings: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        ampscale.create_scaler(**settings)
    message = str(info.value)
    assert "got" in message or "must be" in message


def test_unknown_preset_backend_and_setting() -> None:
    with pytest.raises(ValueError, match="preset must be one of"):
        ampscale.create_scaler(preset="tensorflow")
    with pytest.raises(ValueError, match="backend must be one of"):
        ampscale.create_scaler(backend="mxnet")
    with pytest.raises(TypeError, match="unknown setting"):
        ampscale.create_scaler(growth_intervall=5)
    with pytest.raises(ValueError, match=r"1 / growth_factor"):
        ampscale.create_scaler(preset="jmp", backoff_factor=0.25)
    assert ampscale.create_scaler(preset="jmp", growth_factor=4.0).config.backoff_factor == 0.25


def test_flax_accepts_its_own_zero_interval() -> None:
    scaler = ampscale.create_scaler(preset="flax", growth_interval=0, init_scale=1.0)
    assert scaler.update(True).update(True).get_scale() == 4.0  # grows on every step


def test_grad_dtype_promote_returns_float32_copies_and_keep_is_the_default(fw: Framework) -> None:
    """``grad_dtype="promote"`` (jmp's arithmetic): float16/bfloat16 gradients come back as new
    float32 arrays, unscaled and checked in float32 (so with a scale below 1 a float16 value
    whose unscaled value passes 65504 stays finite, as in jmp); ``keep`` (every preset's
    default) keeps each dtype."""
    narrow = [d for d in ("float16", "bfloat16") if d in fw.dtypes]
    assert all(ampscale.create_scaler(preset=name).config.grad_dtype == "keep" for name in ampscale.PRESETS)
    with pytest.raises(ValueError, match="grad_dtype must be one of"):
        ampscale.create_scaler(grad_dtype="float32")
    promote = ampscale.create_scaler(
        backend=fw.backend, preset="jmp", init_scale=0.5, min_scale=0.25, grad_dtype="promote"
    )
    keep = promote.replace(grad_dtype="keep")
    for dtype in narrow:
        big = 60000.0 if dtype == "float16" else 1e38  # doubled: past float16's range, not bfloat16's
        grads = {"g": fw.array([big, 3.0], dtype), "w": fw.array([2.0])}
        expected = (fw.to_numpy(grads["g"]).astype(np.float32) * 2).tolist()
        out, finite = promote.unscale(grads)
        assert str(fw.to_numpy(out["g"]).dtype) == "float32"
        assert bool(finite)
        assert fw.to_numpy(out["g"]).tolist() == expected
        assert fw.to_numpy(out["w"]).tolist() == [4.0]
        assert fw.to_numpy(grads["g"]).tolist()[1] == 3.0  # the narrow input is not modified
        kept, _ = keep.unscale({"g": fw.array([big, 3.0], dtype)})
        assert str(fw.to_numpy(kept["g"]).dtype) == dtype
    # tiny values are still counted in the gradients' own dtype
    if "float16" in narrow:
        subnormal = fw.array([1e-7, 1.0, 1.0, 1.0], "float16")
        _, _, fraction = promote.unscale([subnormal], underflow=True)
        assert float(fraction) == 0.25


# ----------------------------------------------------------------------------- bad input


def test_integer_boolean_and_non_array_gradients_are_refused_unchanged(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=4.0)
    good = fw.array([4.0, 8.0])
    for bad, pattern in [
        (fw.array([1, 2], "int32"), "int32"),
        (fw.array([True, False], "bool"), "bool"),
        (3.0, "float"),
        ("grad", "str"),
    ]:
        with pytest.raises(TypeError, match=pattern) as info:
            scaler.unscale({"ok": good, "bad": [bad]})
        assert "['bad'][0]" in str(info.value)
        np.testing.assert_array_equal(fw.to_numpy(good), [4.0, 8.0])  # nothing was unscaled


def test_two_frameworks_in_one_tree_are_refused(fw: Framework) -> None:
    others = [f for f in FRAMEWORKS if f.name.split("-")[0] != fw.name.split("-")[0] and not f.gpu]
    if not others:
        pytest.skip("only one framework installed")
    good = fw.array([4.0])
    for other in others:
        with pytest.raises(TypeError, match="framework"):
            ampscale.create_scaler(init_scale=4.0).unscale([good, other.array([4.0])])
        with pytest.raises(TypeError, match="framework"):
            ampscale.all_finite([good, other.array([4.0])])
        np.testing.assert_array_equal(fw.to_numpy(good), [4.0])


def test_scaler_state_backend_mismatch() -> None:
    if not any(f.name == "array_api_strict" for f in FRAMEWORKS):
        pytest.skip("array_api_strict not installed")
    import array_api_strict as xp

    scaler = ampscale.create_scaler(backend="numpy")
    with pytest.raises(TypeError, match="numpy backend"):
        scaler.unscale([xp.asarray([1.0])])


BAD_DICTS = [
    ([1, 2], "must be a dict"),
    ({}, "empty"),
    ({"scale": 1.0}, "misses key"),
    (
        {"scale": "big", "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "_growth_tracker": 0},
        "'scale'",
    ),
    (
        {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1.5, "_growth_tracker": 0},
        "growth_interval",
    ),
    (
        {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "_growth_tracker": True},
        "_growth_tracker",
    ),
    (
        {"scale": 1.0, "growth_factor": 0.5, "backoff_factor": 0.5, "growth_interval": 1, "_growth_tracker": 0},
        "growth_factor",
    ),
]


@pytest.mark.parametrize(("bad", "pattern"), BAD_DICTS)
def test_bad_state_dicts_raise_and_change_nothing(bad, pattern: str) -> None:
    scaler = ampscale.create_scaler(backend="numpy", init_scale=8.0).update(True)
    before = scaler.state_dict()
    with pytest.raises(ampscale.StateDictError, match=pattern):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_ampscale_dict_errors() -> None:
    scaler = ampscale.create_scaler(backend="numpy")
    good = scaler.update(False).state_dict()

    def broken(**changes):
        d = json.loads(json.dumps(good))
        for path, value in changes.items():
            target = d["ampscale"]
            *parents, leaf = path.split("__")
            for p in parents:
                target = target[p]
            if value is KeyError:
                del target[leaf]
            else:
                target[leaf] = value
        return d

    cases = [
        (broken(version=ampscale.FORMAT_VERSION + 1), "newer"),
        (broken(version="1"), "version"),
        (broken(preset="nope"), "preset"),
        (broken(settings__growth_interval=0), "growth_interval"),
        (broken(settings__surprise=1), "unknown setting"),
        (broken(state__scale=KeyError), "scale"),
        (broken(state__scale=-2.0), "scale"),
        (broken(state__steps=2**40), "steps"),
        (broken(state__growth_tracker=1.5), "growth_tracker"),
        (broken(state=[]), "state"),
    ]
    for bad, pattern in cases:
        with pytest.raises(ampscale.StateDictError, match=pattern):
            scaler.load_state_dict(bad)
    # fields added by later versions are optional
    older = broken(state__growths=KeyError, state__last_reason=KeyError)
    assert scaler.load_state_dict(older).get_scale() == 32768.0
