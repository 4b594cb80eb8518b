"""The FP8 update on an array-API namespace: ``array_api_strict``, the standard's police.

The state lives in ``array_api_strict`` arrays and the transition runs with the standard's
functions only (no bitcast: the power-of-two rules go through ``searchsorted`` on a table of
powers of two); every preset must equal the NumPy backend bit for bit, skipped steps and
checkpoints included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale.fp8 as fp8
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config
from ampscale.fp8._ops import make_ops
from tests.test_fp8_presets import amax_value

xp = pytest.importorskip("array_api_strict")
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}


def host(state):
    return [np.asarray(f) if isinstance(f, (np.ndarray, np.generic)) else np.from_dlpack(f) for f in state]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        return bool((a.view(np.uint32) == b.view(np.uint32)).all())
    return bool((a == b).all())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    preset=st.sampled_from(sorted(FP8_PRESETS)),
    length=st.sampled_from([1, 2, 16]),
    steps=st.lists(st.tuples(st.lists(amax_value, min_size=3, max_size=3), st.booleans()), min_size=1, max_size=6),
    pow2=st.sampled_from(["preset", "mask", "floor_log2"]),
)
def test_array_api_strict_equals_numpy_bit_for_bit(preset, length, steps, pow2):
    settings_ = {} if pow2 == "preset" else {"pow2": pow2}
    config = make_fp8_config(preset, SLOTS, history_len=length, **settings_)
    reference, state = fp8.init_state(config, "numpy"), fp8.init_state(config, xp)
    assert type(state.scale).__module__.startswith("array_api_strict")
    for amax, ok in steps:
        reference, _ = fp8.update_state(config, reference, np.float32(amax), ok)
        flag = xp.asarray(ok) if len(amax) % 2 else ok  # a 0-d array flag and a Python one
        state, _ = fp8.update_state(config, state, xp.asarray(amax, dtype=xp.float32), flag)
    for name, got, want in zip(fp8.Fp8State._fields, host(state), host(reference), strict=True):
        assert same(got, want), f"{name}: {got} != {want} ({preset}, L={length}, {steps})"


def test_the_standard_power_of_two_rules_equal_the_bit_rules_on_every_exponent():
    """Every float32 exponent, mantissas at and around torchao's thresholds, and the specials."""
    from ampscale.fp8._ops import floor_log2_thresholds

    mantissas = {0, 1, (1 << 23) - 1, 1 << 22}
    values = []
    for biased in range(256):
        threshold = floor_log2_thresholds()[biased]
        for m in mantissas | {threshold - 1, threshold, threshold + 1}:
            if 0 <= m < (1 << 23):
                for sign in (0, 1 << 31):
                    values.append(sign | (biased << 23) | m)
    x = np.asarray(values, np.uint32).view(np.float32)
    bit_ops, standard = make_ops("numpy"), make_ops("array_api", xp=xp)
    for name in ("pow2_mask", "pow2_floor_log2"):
        want = getattr(bit_ops, name)(x.copy())
        got = np.from_dlpack(getattr(standard, name)(xp.asarray(x)))
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), name
        assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all(), name


def test_the_standard_log2_exponent_and_window_rules_equal_the_bit_rules() -> None:
    """MS-AMP's ``floor_log2`` and ``exp2_abs``, and the window's max, without a bitcast: every
    exponent, subnormals by their leading bit, the specials, -0 and negatives."""
    from ampscale.fp8._ops import floor_log2_thresholds, subnormal_floor_log2_thresholds

    values = []
    for biased in range(1, 255):
        threshold = floor_log2_thresholds()[biased]
        for m in {0, 1, (1 << 23) - 1, threshold - 1, threshold, threshold + 1}:
            if 0 <= m < (1 << 23):
                values += [(biased << 23) | m, (1 << 31) | (biased << 23) | m]
    for j, threshold in enumerate(subnormal_floor_log2_thresholds()):
        values += [f for f in (1 << j, threshold - 1, threshold, (1 << (j + 1)) - 1) if 1 << j <= f < 1 << 23]
    values += [0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x80000001]
    x = np.asarray(values, np.uint32).view(np.float32)
    bit_ops, standard = make_ops("numpy"), make_ops("array_api", xp=xp)

    def same_bits(got, want, name):
        got, want = np.from_dlpack(got), np.asarray(want)
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), name
        assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all(), name

    same_bits(standard.floor_log2(xp.asarray(x)), bit_ops.floor_log2(x.copy()), "floor_log2")
    exponents = np.float32([*range(-130, 131), np.inf, -np.inf, np.nan])
    same_bits(standard.exp2_abs(xp.asarray(exponents)), bit_ops.exp2_abs(exponents), "exp2_abs")
    rows = np.stack([x[i : i + 8] for i in range(0, len(x) - 8, 5)])
    for rule in ("drop", "propagate"):
        same_bits(standard.window_max(xp.asarray(rows), rule), bit_ops.window_max(rows, rule), rule)


def test_the_scaler_on_array_api_strict_updates_casts_nothing_and_round_trips_checkpoints():
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend=xp, history_len=4)
    assert f8.framework == "array_api"
    f8 = f8.update({"x": 2.0, "w": xp.asarray(4.0, dtype=xp.float32), "dy": 8.0})
    assert f8.scales_sync() == {"x": 224.0, "w": 112.0, "dy": 7168.0}
    numpy_twin = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4).update([2.0, 4.0, 8.0])
    assert f8.state_dict() == numpy_twin.state_dict()
    f8 = f8.update([1.0, 1.0, 1.0])  # the ring moves on; history() reads it oldest first
    assert np.from_dlpack(f8.history()).tolist() == [[0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 4.0, 1.0], [0.0, 0.0, 8.0, 1.0]]
    assert np.from_dlpack(f8.state.head).tolist() == [2, 2, 2]
    again = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="array_api_strict", history_len=4)
    again = again.load_state_dict(f8.state_dict())
    assert type(again.state.history).__module__.startswith("array_api_strict")
    assert again.scales_sync() == f8.scales_sync()
    with pytest.raises(TypeError, match="amax must be a array_api array like the state; got ndarray"):
        f8.update(np.float32([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"backend must be one of .* or an array-API namespace"):
        fp8.create_fp8_scaler("te_delayed", SLOTS, backend="not_a_namespace")


def test_the_combined_step_on_array_api_strict_with_a_callable_group():
    import ampscale

    seen = []

    def group(buffer):  # one "collective": a callable that sees the whole buffer
        seen.append(buffer.shape)
        return buffer

    scaler = ampscale.create_scaler(backend=xp, init_scale=4.0)
    f8 = fp8.create_fp8_scaler("te_delayed", {"x": "forward", "dy": "backward"}, backend=xp, history_len=2)
    outcomes = []
    for gradient in (1.0, np.inf):
        grads = [xp.asarray([8.0 * gradient, 4.0], dtype=xp.float32)]
        amax = xp.asarray([2.0, 3.0], dtype=xp.float32)
        step = fp8.unscale_and_update(scaler, f8, grads, amax, loss=xp.asarray(8.0, dtype=xp.float32), group=group)
        scaler, f8 = step.scaler, step.fp8_scaler
        outcomes.append((bool(step.finite), scaler.get_scale(), f8.scales_sync()["x"]))
    assert seen == [(6,), (6,)]  # 2 amaxes, 2 nan flags, the gradients' and the loss's flags
    assert outcomes == [(True, 4.0, 224.0), (False, 2.0, 224.0)]
