"""FP8 products for JAX and flax (:mod:`ampscale.fp8.jax`).

* ``fp8_dot`` (the plain route: an ``Fp8Scaler``'s scales, the amaxes as the gradient of a
  sink) against a product computed by hand with NumPy and ml_dtypes, bit for bit, forward and
  backward, direct (fp8 operands) and quantize-dequantized;
* the flax modules inside ``nn.Dense(dot_general_cls=...)`` against flax's own
  ``Fp8DirectDotGeneralOp`` and ``Fp8DotGeneralOp`` over a training loop whose trainer writes
  the overwrite collection back: with the ``flax`` preset the losses, the parameters'
  gradients and the ``*_scale`` variables equal flax's bit for bit, and the histories hold
  the same amaxes;
* the overwrite variables under accumulation: micro-batches merged by ``combine_amax`` (and
  uses merged by ``fm32`` autodiff) give one update with the largest amax, exactly;
* the skipped-step policy (``select_overwrite``) and refusals.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import ampscale.fp8 as fp8  # noqa: E402
from ampscale.fp8 import jax as fp8_jax  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def hand_quantize(x, scale, fmt, bound):
    return np.clip(np.float32(x) * np.float32(scale), -bound, bound).astype(getattr(ml_dtypes, fmt))


@pytest.mark.parametrize("direct", [True, False])
def test_fp8_dot_against_a_hand_computed_product(direct: bool) -> None:
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="jax", history_len=4)
    f8 = f8.update(jnp.asarray([3.5, 0.875, 24.0]))  # scales 128, 512, 2389.33...
    scale = np.asarray(f8.state.scale)
    inverse = np.asarray(f8.state.scale_inv)
    x = np.asarray([[1.0, -3.0, 2.5], [0.25, 0.5, -1.0]], np.float32)
    w = np.asarray([[0.5, -0.25], [0.125, 0.75], [-0.875, 0.375]], np.float32)
    upstream = np.asarray([[3.0, -1.0], [0.5, 2.0]], np.float32)

    def loss(x, w, sink):
        return jnp.sum(fp8_jax.fp8_dot(x, w, DIMS, f8, ("x", "w", "dy"), sink, direct=direct) * upstream)

    y = fp8_jax.fp8_dot(jnp.asarray(x), jnp.asarray(w), DIMS, f8, ("x", "w", "dy"), jnp.zeros(3), direct=direct)
    grad_x, grad_w, amax = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w), jnp.zeros(3))

    q_x = hand_quantize(x, scale[0], "float8_e4m3fn", 448.0).astype(np.float32)
    q_w = hand_quantize(w, scale[1], "float8_e4m3fn", 448.0).astype(np.float32)
    q_g = hand_quantize(upstream, scale[2], "float8_e5m2", 57344.0).astype(np.float32)
    if direct:  # fp8 operands, the product dequantized by both inverse scales at once
        want_y = (q_x @ q_w) * (inverse[0] * inverse[1])
        want_gx = (q_g @ q_w.T) * (inverse[1] * inverse[2])
        want_gw = (q_x.T @ q_g) * (inverse[0] * inverse[2])
    else:  # each operand quantize-dequantized, then the product
        dq_x, dq_w, dq_g = q_x * inverse[0], q_w * inverse[1], q_g * inverse[2]
        want_y, want_gx, want_gw = dq_x @ dq_w, dq_g @ dq_w.T, dq_x.T @ dq_g
    assert (bits(y) == bits(want_y)).all()
    assert (bits(grad_x) == bits(want_gx)).all()
    assert (bits(grad_w) == bits(want_gw)).all()
    assert np.asarray(amax).tolist() == [3.0, 0.875, 3.0]  # max |x|, max |w|, max |upstream|
    assert scale.tolist()[:2] == [128.0, 512.0]  # scales that move the values: the cast is not trivial


def test_fp8_dot_refuses_bad_slots_and_sinks() -> None:
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="jax", history_len=2)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"forward, a forward and a backward slot .* roles \('forward', 'backward'"):
        fp8_jax.fp8_dot(x, w, DIMS, f8, ("x", "dy", "w"), jnp.zeros(3))
    with pytest.raises(ValueError, match=r"amax_sink must have shape \(3,\) .* got shape \(2,\)"):
        fp8_jax.fp8_dot(x, w, DIMS, f8, ("x", "w", "dy"), jnp.zeros(2))
    with pytest.raises(KeyError, match="slot must be one of"):
        fp8_jax.fp8_dot(x, w, DIMS, f8, ("x", "v", "dy"), jnp.zeros(3))


# ------------------------------------------------------------------------------ against flax


def _train(module_class, steps: int, history: int = 4):
    from flax import linen as nn

    rng = np.random.default_rng(0)
    model = nn.Dense(5, dot_general_cls=lambda: module_class(amax_history_length=history))
    x0 = jnp.asarray(rng.normal(size=(3, 7)).astype(np.float32))
    variables = model.init(jax.random.PRNGKey(0), x0)

    @jax.jit
    def step(variables, x, y):
        return jax.value_and_grad(lambda v: jnp.sum((model.apply(v, x) - y) ** 2))(variables)

    seen = []
    for t in range(steps):
        x = jnp.asarray((rng.normal(size=(3, 7)) * (1 + 10 * t)).astype(np.float32))
        y = jnp.asarray(rng.normal(size=(3, 5)).astype(np.float32))
        loss, grads = step(variables, x, y)
        overwrite = next(iter(grads[fp8_jax.OVERWRITE_WITH_GRADIENT].values()))
        seen.append((loss, grads["params"], overwrite))
        params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, variables["params"], grads["params"])
        variables = {"params": params, fp8_jax.OVERWRITE_WITH_GRADIENT: grads[fp8_jax.OVERWRITE_WITH_GRADIENT]}
    return seen


@pytest.mark.parametrize(
    ("ours", "theirs"), [("Fp8DotGeneral", "Fp8DirectDotGeneralOp"), ("Fp8QdqDotGeneral", "Fp8DotGeneralOp")]
)
def test_the_flax_modules_equal_flaxs_own_bit_for_bit(ours: str, theirs: str) -> None:
    pytest.importorskip("flax")
    from flax.linen import fp8_ops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax's Fp8DotGeneralOp is deprecated
        reference = _train(getattr(fp8_ops, theirs), 6)
    got = _train(getattr(fp8_jax, ours), 6)
    for t, ((loss_a, params_a, meta_a), (loss_b, params_b, meta_b)) in enumerate(zip(reference, got, strict=True)):
        assert bits(loss_a) == bits(loss_b), t
        for a, b in zip(jax.tree_util.tree_leaves(params_a), jax.tree_util.tree_leaves(params_b), strict=True):
            assert (bits(a) == bits(b)).all(), t
        for operand in fp8_jax.OPERANDS:
            assert bits(meta_a[f"{operand}_scale"]) == bits(meta_b[f"{operand}_scale"]), (t, operand)
            # flax's history: the last 4 amaxes; ours: the 4 before, written at this call, and
            # this call's amax still pending
            theirs_history = sorted(np.asarray(meta_a[f"{operand}_amax_history"]).tolist())
            ours_history = np.asarray(meta_b[f"{operand}_amax_history"]).tolist()[1:]
            assert theirs_history == sorted([*ours_history, float(meta_b[f"{operand}_amax"][0])]), (t, operand)
    assert float(reference[-1][2]["input_scale"][0]) != 1.0  # the scales moved


# ------------------------------------------------------------------------------ accumulation


def test_micro_batches_merged_by_max_are_one_update_with_the_largest_amax() -> None:
    """Two micro-batches: the scale and history cotangents are the same in both (they come from
    the variables, not from the data), and the pending amaxes merge by max; the next call
    applies exactly the update an Fp8Scaler makes with the step's largest amax."""
    w = jnp.asarray(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    variables = fp8_jax.init_fp8_vars("te_delayed", history_len=4)

    def grads_of(v, x):
        return jax.grad(lambda v: jnp.sum(fp8_jax.fp8_dot_general(x, w, DIMS, fp8_vars=v, preset="te_delayed")))(v)

    for step, (scale_a, scale_b) in enumerate(((2.0, 9.0), (30.0, 4.0), (1.0, 0.5))):
        first = grads_of(variables, jnp.full((2, 3), scale_a))
        second = grads_of(variables, jnp.full((2, 3), scale_b))
        for name in ("input_scale", "input_amax_history", "kernel_scale", "output_grad_scale"):
            assert (bits(first[name]) == bits(second[name])).all(), name
        variables = fp8.combine_amax(first, second)
        assert float(variables["input_amax"][0]) == max(scale_a, scale_b), step
    reference = fp8.create_fp8_scaler("te_delayed", ["x"], history_len=4)
    for top in (9.0, 30.0):
        reference = reference.update([top])
    assert np.asarray(variables["input_amax_history"]).tolist() == reference.history(0).tolist()
    assert bits(variables["input_scale"]) == bits(reference.state.scale)


def test_fm32_variables_merge_the_uses_of_one_step_by_max() -> None:
    fm32 = pytest.importorskip("flax.linen.fp8_ops").fm32
    w = jnp.full((3, 4), 0.5)

    def loss(v):
        first = fp8_jax.fp8_dot_general(jnp.full((2, 3), 2.0), w, DIMS, fp8_vars=v)
        return first.sum() + fp8_jax.fp8_dot_general(jnp.full((2, 3), 5.0), w, DIMS, fp8_vars=v).sum()

    @jax.jit
    def overwrite(v):
        grads = jax.vjp(loss, v)[1](jnp.float32(1.0))[0]
        return jax.tree_util.tree_map(lambda a: jax.lax.convert_element_type(a, jnp.float32), grads)

    merged = overwrite(fp8_jax.init_fp8_vars("flax", 4, fm32))
    summed = overwrite(fp8_jax.init_fp8_vars("flax", 4, jnp.float32))
    assert float(merged["input_amax"][0]) == 5.0  # max of the two uses
    assert float(merged["input_scale"][0]) == 1.0
    assert float(summed["input_amax"][0]) == 7.0  # float32 variables add up: use fm32 for reuse


def test_select_overwrite_follows_the_presets_skipped_step_rule() -> None:
    old = fp8_jax.init_fp8_vars("ampscale", history_len=2)
    new = jax.tree_util.tree_map(lambda a: a + 1.0, old)
    kept = fp8_jax.select_overwrite("ampscale", old, new, jnp.asarray(False))
    taken = fp8_jax.select_overwrite("te_delayed", old, new, jnp.asarray(False))
    assert float(kept["input_scale"][0]) == 1.0
    assert float(taken["input_scale"][0]) == 2.0
    assert float(fp8_jax.select_overwrite("ampscale", old, new, jnp.asarray(True))["input_scale"][0]) == 2.0


def test_init_refuses_unknown_presets_and_history_lengths() -> None:
    with pytest.raises(ValueError, match="FP8 setting 'preset' must be one of"):
        fp8_jax.init_fp8_vars("nope")
    with pytest.raises(ValueError, match="FP8 setting 'history_len' must be an integer from 1"):
        fp8_jax.init_fp8_vars("flax", history_len=0)
