"""The loss scaler and the FP8 scaler in one step, and amaxes combined over micro-batches.

* fp16 + FP8 and bf16 + FP8 (``mode="guard"``) on NumPy, torch and JAX, with injected inf and
  nan steps (a gradient, the scaled loss, an amax), against a reference computed separately:
  the loss scale by a plain-Python model of torch's rule, the FP8 slots by the transition
  emitted as Python (:func:`ampscale.fp8._codegen.python_slot_transition`), one slot at a time;
* the skipped-step policy of each preset (TE records, Keras and ampscale freeze);
* loss-scale-invariant gradient amaxes (exact; refused where the loss scale can leave the
  powers of two);
* gradient accumulation: the amaxes of every micro-batch combined by a nan-keeping max and the
  history written once per optimizer step (marin-community/marin#7659: the last micro-batch
  won, and an earlier larger one was clipped);
* refusals before anything changes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import ampscale
import ampscale.fp8 as fp8
from ampscale.fp8._codegen import python_slot_transition

SLOTS = {"fc.x": "forward", "fc.w": "forward", "fc.dy": "backward"}
INF, NAN = math.inf, math.nan
# (gradient value, scaled loss, amaxes of x, w, dy): step 2's gradient overflows, step 4's
# scaled loss, step 5's dy amax is inf with finite gradients, step 6's x amax is nan
STEPS = [
    (1.0, 3.0, [2.0, 0.5, 40.0]),
    (2.0, 3.0, [3.0, 0.5, 60.0]),
    (INF, 3.0, [100.0, 0.5, INF]),
    (1.0, 3.0, [1.0, 0.25, 10.0]),
    (1.0, INF, [5.0, 0.5, 20.0]),
    (1.0, 3.0, [4.0, 0.5, INF]),
    (1.0, 3.0, [NAN, 0.5, 30.0]),
    (1.0, 3.0, [6.0, 1.0, 50.0]),
]


class TorchRuleReference:
    """torch.amp.GradScaler's update, in plain Python: the loss scaler's reference."""

    def __init__(self, scale: float, growth_interval: int) -> None:
        self.scale, self.interval, self.tracker = scale, growth_interval, 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= 0.5
            self.tracker = 0
            return
        self.tracker += 1
        if self.tracker == self.interval:
            self.scale *= 2.0
            self.tracker = 0


class Fp8Reference:
    """The FP8 transition emitted as Python, run one slot at a time on Python floats."""

    def __init__(self, config: fp8.Fp8Config) -> None:
        self.config = config
        self.function = python_slot_transition(config)
        # scale, scale_inv, the history ring, filled, zero_amax, nonfinite, head
        self.slots = [(1.0, 1.0, (0.0,) * config.history_len, 0, 0, 0, 0) for _ in config.slots]

    def update(self, amax: list[float], step_ok: bool) -> None:
        self.slots = [
            self.function(*fields, float(np.float32(a)), m, step_ok)[0]
            for fields, a, m in zip(self.slots, amax, self.config.slot_max, strict=True)
        ]


def bits(values) -> list[str]:
    return ["nan" if v != v else np.float32(v).tobytes().hex() for v in np.asarray(values, np.float32).ravel()]


def host(array) -> np.ndarray:
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


class Numpy:
    name = "numpy"

    def array(self, values, dtype=np.float32):
        return np.asarray(values, dtype=dtype)


class Torch:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def array(self, values, dtype=None):
        return self.torch.tensor(np.asarray(values, np.float32), dtype=dtype or self.torch.float32)


class Jax:
    name = "jax"

    def __init__(self) -> None:
        import jax.numpy as jnp

        self.jnp = jnp

    def array(self, values, dtype=None):
        return self.jnp.asarray(np.asarray(values, np.float32), dtype=dtype or self.jnp.float32)


def framework(name: str):
    if name == "torch":
        pytest.importorskip("torch")
        return Torch()
    if name == "jax":
        pytest.importorskip("jax")
        return Jax()
    return Numpy()


@pytest.mark.parametrize("name", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("preset", ["ampscale", "te_delayed", "keras"])
@pytest.mark.parametrize("mode", ["dynamic", "guard"])
def test_fp16_and_bf16_plus_fp8_against_a_separate_reference(name: str, preset: str, mode: str) -> None:
    fw = framework(name)
    if mode == "guard":  # bf16 + FP8: no loss scaling, only the skipped steps
        scaler = ampscale.create_scaler(backend=name, mode="guard")
    else:
        scaler = ampscale.create_scaler(backend=name, init_scale=2.0**4, growth_interval=2)
    f8 = fp8.create_fp8_scaler(preset, SLOTS, backend=name, history_len=4)
    loss_reference = TorchRuleReference(1.0 if mode == "guard" else 2.0**4, 2)
    fp8_reference = Fp8Reference(f8.config)
    for step, (gradient, loss, amax) in enumerate(STEPS):
        scale = loss_reference.scale
        grads = [fw.array(np.full(3, gradient * scale)), fw.array([[scale, -scale]])]
        result = fp8.unscale_and_update(scaler, f8, grads, fw.array(amax), loss=fw.array(loss * scale))
        scaler, f8 = result.scaler, result.fp8_scaler
        finite = math.isfinite(gradient) and math.isfinite(loss)
        loss_reference.update(finite) if mode == "dynamic" else None
        fp8_reference.update(amax, finite)
        where = f"{name} {preset} {mode} step {step}"
        assert bool(result.finite) == finite, where
        if finite:
            assert host(result.grads[0]).tolist() == [gradient] * 3, where
            assert host(result.grads[1]).tolist() == [[1.0, -1.0]], where
        assert scaler.get_scale() == loss_reference.scale, where
        state = [host(field) for field in f8.state]
        for k, fields in enumerate(fp8_reference.slots):
            assert bits(state[0][k]) == bits(fields[0]), f"scale of slot {k}, {where}"
            assert bits(state[1][k]) == bits(fields[1]), f"scale_inv of slot {k}, {where}"
            assert bits(state[2][k]) == bits(fields[2]), f"history of slot {k}, {where}"
            assert [state[3][k], state[4][k], state[5][k], state[7][k]] == list(fields[3:]), where
    outcome = scaler.get_stats()
    assert outcome["skipped_steps"] == 2
    assert outcome["loss_overflows"] == 1


def test_each_presets_skipped_step_policy() -> None:
    """Step 2 overflows (its dy amax is inf): TE writes the inf into the history and keeps its
    scale for the rest of the window; Keras and ampscale leave every slot as it was."""
    histories = {}
    for preset in ("te_delayed", "keras", "ampscale"):
        scaler = ampscale.create_scaler(init_scale=2.0**4, growth_interval=1000)
        f8 = fp8.create_fp8_scaler(preset, SLOTS, history_len=4)
        for gradient, _loss, amax in STEPS[:4]:
            grads = [np.full(3, gradient * scaler.get_scale(), np.float32)]
            scaler, f8, _grads, _finite = fp8.unscale_and_update(scaler, f8, grads, np.float32(amax))
        histories[preset] = f8.history(2).tolist()
        if preset == "te_delayed":
            assert f8.state.nonfinite[2] == 1
    assert histories["te_delayed"] == [40.0, 60.0, INF, 10.0]
    assert histories["keras"] == [0.0, 40.0, 60.0, 10.0]
    assert histories["ampscale"] == [0.0, 40.0, 60.0, 10.0]


def test_loss_scale_invariant_gradient_amaxes_are_exact_and_follow_no_backoff() -> None:
    """The same unscaled gradient before and after a backoff: the recorded amax is the same
    (the division by a power of two is exact), while the scaled amaxes halve."""
    invariant, raw = [], []
    for opt_in, out in ((True, invariant), (False, raw)):
        scaler = ampscale.create_scaler(init_scale=2.0**10, growth_interval=1000)
        f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4)
        for gradient in (1.0, INF, 1.0):
            scale = scaler.get_scale()
            unscaled_dy = np.float32(0.3)
            amax = np.float32([1.0, 0.5, unscaled_dy * np.float32(scale)])  # dy carries the loss scale
            grads = [np.full(2, gradient * scale, np.float32)]
            step = fp8.unscale_and_update(scaler, f8, grads, amax, loss_scale_invariant=opt_in)
            scaler, f8 = step.scaler, step.fp8_scaler
            out.append(float(f8.history(2)[-1]))
    assert invariant == [np.float32(0.3)] * 3
    assert raw == [np.float32(0.3) * 2**10, np.float32(0.3) * 2**10, np.float32(0.3) * 2**9]
    # forward slots are never divided
    assert f8.history(0)[-1] == 1.0


def test_loss_scale_invariant_refuses_a_scale_that_is_not_a_power_of_two_and_changes_nothing() -> None:
    scaler = ampscale.create_scaler(init_scale=1000.0)
    f8 = fp8.create_fp8_scaler("ampscale", SLOTS, history_len=2)
    grads = [np.full(2, 8.0, np.float32)]
    with pytest.raises(ValueError, match=r"init_scale is 1000\.0.*powers of two"):
        fp8.unscale_and_update(scaler, f8, grads, [1.0, 1.0, 1.0], loss_scale_invariant=True)
    assert grads[0].tolist() == [8.0, 8.0]
    with pytest.raises(ValueError, match=r"min_scale is 3\.0"):
        fp8.unscale_and_update(
            ampscale.create_scaler(min_scale=3.0), f8, grads, [1.0, 1.0, 1.0], loss_scale_invariant=True
        )
    assert grads[0].tolist() == [8.0, 8.0]


def test_bad_input_is_refused_before_any_gradient_changes() -> None:
    scaler = ampscale.create_scaler(init_scale=4.0)
    f8 = fp8.create_fp8_scaler("ampscale", SLOTS, history_len=2)
    grads = [np.full(2, 8.0, np.float32)]
    cases = [
        ((scaler, f8, grads, np.float32([1.0, 2.0])), {}, ValueError, r"amax must have shape \(3,\).*got shape \(2,\)"),
        ((scaler, f8, grads, {"fc.x": 1.0}), {}, ValueError, r"amax misses slot\(s\) \['fc.w', 'fc.dy'\]"),
        ((scaler, f8, grads, [1.0, 1.0, 1.0]), {"loss_scale_invariant": 1}, TypeError, "True or False; got 1"),
        ((f8, f8, grads, [1.0, 1.0, 1.0]), {}, TypeError, "scaler must be an ampscale Scaler"),
        ((scaler, scaler, grads, [1.0, 1.0, 1.0]), {}, TypeError, "fp8_scaler must be an Fp8Scaler"),
        ((scaler, f8, grads, [1.0, 1.0, 1.0]), {"group": "data"}, TypeError, "group must be None, a callable"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            fp8.unscale_and_update(*args, **kwargs)
        assert grads[0].tolist() == [8.0, 8.0], message
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="gradients are torch arrays and the FP8 state holds numpy arrays"):
        fp8.unscale_and_update(scaler, f8, [torch.full((2,), 8.0)], [1.0, 1.0, 1.0])


def test_the_group_setting_of_the_loss_scaler_is_the_default_group() -> None:
    """A loss scaler created with ``axis_name`` agrees over it; here a callable that plays a
    second rank whose gradients overflowed and whose dy amax was nan."""
    seen = []

    def other_rank_overflowed(buffer):
        seen.append(buffer.copy())
        other = np.float32([1.0, 9.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # amaxes x, w, dy(nan as 0) | nan flags | found-inf
        return np.maximum(buffer, other)

    scaler = ampscale.create_scaler(init_scale=4.0, axis_name=other_rank_overflowed)
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=2)
    step = fp8.unscale_and_update(scaler, f8, [np.full(2, 8.0, np.float32)], [3.0, 2.0, 5.0])
    assert len(seen) == 1
    assert seen[0].tolist() == [3.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0]
    assert not bool(step.finite)
    assert step.scaler.get_scale() == 2.0
    assert np.isnan(step.fp8_scaler.history(2)[-1])  # te_delayed records the skipped step
    assert step.fp8_scaler.history()[:2, -1].tolist() == [3.0, 9.0]


# ------------------------------------------------------------------------------ accumulation


def test_combine_amax_keeps_nan_and_inf_on_every_framework() -> None:
    a, b = [1.0, NAN, 3.0, INF], [2.0, 1.0, NAN, 5.0]
    want = ["nan" if v != v else v for v in (2.0, NAN, NAN, INF)]
    for name in ("numpy", "torch", "jax"):
        fw = framework(name)
        got = host(fp8.combine_amax(fw.array(a), fw.array(b))).tolist()
        assert ["nan" if v != v else v for v in got] == want, name
    assert math.isnan(fp8.combine_amax(NAN, 1.0))
    assert fp8.combine_amax(2.0, 1.0) == 2.0
    assert fp8.combine_amax(None, 3.0) == 3.0


def test_combine_amax_on_trees_and_its_refusals() -> None:
    tree = {"layer": [np.float32([1.0, 5.0]), np.float32(2.0)], "head": (np.float32(1.0),)}
    other = {"layer": [np.float32([4.0, 2.0]), np.float32(NAN)], "head": (np.float32(0.5),)}
    merged = fp8.combine_amax(tree, other)
    assert merged["layer"][0].tolist() == [4.0, 5.0]
    assert np.isnan(merged["layer"][1])
    assert merged["head"] == (1.0,)
    with pytest.raises(ValueError, match=r"trees differ at the root: keys \['head', 'layer'\] and \['layer'\]"):
        fp8.combine_amax(tree, {"layer": other["layer"]})
    with pytest.raises(ValueError, match=r"one shape .* got \(2,\) and \(3,\) at the root\['layer'\]\[0\]"):
        fp8.combine_amax(tree, {**other, "layer": [np.zeros(3, np.float32), np.float32(1.0)]})
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="one framework; got ndarray and Tensor"):
        fp8.combine_amax(np.float32([1.0]), torch.tensor([1.0]))
    with pytest.raises(TypeError, match="got a bool"):
        fp8.combine_amax(True, 1.0)
    jnp = pytest.importorskip("jax.numpy")
    merged = fp8.combine_amax({"a": jnp.float32(1.0)}, {"a": jnp.float32(3.0)})
    assert float(merged["a"]) == 3.0


def test_accumulated_micro_batches_write_the_history_once_and_the_largest_amax_wins() -> None:
    """marin-community/marin#7659: with the amax of the last micro-batch only, the scale of a
    step follows a micro-batch of amax 2 while another held 100, which then saturates. With the
    micro-batches combined and one update per optimizer step, the history gets one entry per
    step, the step's largest amax, and nothing saturates."""
    micro_batches = [np.float32([100.0]), np.float32([7.0]), np.float32([2.0])]
    combined = fp8.create_fp8_scaler("te_delayed", ["x"], history_len=4)
    last_wins = fp8.create_fp8_scaler("te_delayed", ["x"], history_len=4)
    for _step in range(2):
        acc = None
        for amax in micro_batches:
            acc = fp8.combine_amax(acc, amax)
        combined = combined.update(acc)
        last_wins = last_wins.update(micro_batches[-1])
    assert combined.history(0).tolist() == [0.0, 0.0, 100.0, 100.0]
    assert combined.state.filled[0] == 2  # one write per optimizer step, not one per micro-batch
    x = np.float32([100.0, -100.0])
    assert np.abs(combined.qdq(x, "x")).max() == 100.0
    assert np.abs(last_wins.qdq(x, "x")).max() < 3.0  # clipped at 448 / 224 = 2: "no error and no NaN"


def test_a_nan_micro_batch_survives_the_accumulation() -> None:
    acc = None
    for amax in (np.float32([1.0, NAN]), np.float32([2.0, 3.0])):
        acc = fp8.combine_amax(acc, amax)
    f8 = fp8.create_fp8_scaler("ampscale", ["a", "b"], history_len=2).update(acc)
    assert f8.state.nonfinite.tolist() == [0, 1]  # counted, not written, the scale kept
    assert f8.history(1).tolist() == [0.0, 0.0]


def test_the_amaxes_of_many_tensors_in_one_call() -> None:
    """``fp8.amax``, the fused pass the demo and the hooks take their amaxes from: per tensor, in
    order, nan if it holds a nan, else inf if it holds an inf, 0 for an empty one; on every
    framework, an array-API namespace included."""
    leaves = [
        np.float32([[1.0, -7.0], [2.0, 3.0]]),
        np.float16([np.inf, 1.0]),
        np.float32([np.nan, np.inf]),
        np.zeros(0, np.float32),
        np.float64([-0.5]),
    ]
    got = fp8.amax(leaves)
    assert got.dtype == np.float32
    assert ["nan" if v != v else v for v in got.tolist()] == [7.0, INF, "nan", 0.0, 0.5]
    torch = pytest.importorskip("torch")
    assert fp8.amax([torch.tensor([1.0, -2.0]), torch.tensor([3.0])]).tolist() == [2.0, 3.0]
    with pytest.raises(TypeError, match=r"leaf \[1\] a torch array"):
        fp8.amax([np.float32([1.0]), torch.tensor([1.0])])
    with pytest.raises(ValueError, match="at least one array"):
        fp8.amax([])
    xp = pytest.importorskip("array_api_strict")
    got, finite = fp8.amax(
        [xp.asarray([1.0, NAN], dtype=xp.float32), xp.asarray([-4.0], dtype=xp.float32)], with_finite=True
    )
    assert ["nan" if v != v else v for v in np.from_dlpack(got).tolist()] == ["nan", 4.0]
    assert not bool(finite)
    with pytest.raises(TypeError, match="leaf \\[0\\] has dtype int32"):
        fp8.amax([xp.asarray([1], dtype=xp.int32)])
