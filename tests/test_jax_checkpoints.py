"""Checkpoints move between flax's ``DynamicScale`` and ampscale's, both ways, bit for bit.

A flax ``TrainState`` program (Adam, a float16 loss, overflows injected on some steps and
reached by the growing scale on others) runs half its steps with one class, is saved, restored
into a template built with the other class (whose default scale and ``fin_steps`` would show
if a leaf were not restored), and runs the other half; the scale trajectory, ``fin_steps``, the
flags, the parameters and Adam's state equal those of the run that never stopped, bit for bit.
Each way of saving a flax program is used: orbax's ``StandardCheckpointer`` and
``PyTreeCheckpointer``, ``flax.training.checkpoints``, and ``flax.serialization``
(``to_bytes``/``from_bytes``, ``to_state_dict``/``from_state_dict``). Also here: ampscale's
``Scaler`` with ``flax.serialization``.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
flax = pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

import ampscale  # noqa: E402
import ampscale.jax as ajax  # noqa: E402

STEPS = 24
SAVED_AT = 11


def _flax_dynamic_scale():
    from flax.training.dynamic_scale import DynamicScale

    return DynamicScale


CLASSES = {"flax": _flax_dynamic_scale, "ampscale": lambda: ajax.DynamicScale}


def _values(tree) -> list:
    return [(np.asarray(x).dtype.name, np.asarray(x).tobytes()) for x in jax.tree_util.tree_leaves(tree)]


@functools.cache
def _program(kind: str):
    """A flax TrainState program, written once against ``DynamicScale`` of ``kind``."""
    import optax
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        dynamic_scale: object

    def create(dynamic_scale_class):
        params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.zeros(3)}
        return TrainState.create(
            apply_fn=None, params=params, tx=optax.adam(1e-2), dynamic_scale=dynamic_scale_class(growth_interval=3)
        )

    def loss_fn(params, x, poison):
        h = jnp.tanh(x.astype(jnp.float16) @ params["w"].astype(jnp.float16)) + params["b"].astype(jnp.float16)
        return jnp.mean(jnp.square(h.astype(jnp.float32) - 0.5)) * poison

    @jax.jit
    def step(state, x, poison):
        dynamic_scale, is_fin, _loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(state.params, x, poison)
        new = state.apply_gradients(grads=grads)
        select = functools.partial(jax.tree_util.tree_map, functools.partial(jnp.where, is_fin))
        new = new.replace(
            params=select(new.params, state.params),
            opt_state=select(new.opt_state, state.opt_state),
            dynamic_scale=dynamic_scale,
        )
        return new, (dynamic_scale.scale, dynamic_scale.fin_steps, is_fin)

    return functools.partial(create, CLASSES[kind]()), step


def _data():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(STEPS, 8, 4)).astype(np.float32) * 4)
    poison = np.ones(STEPS, np.float32)
    poison[[2, 9, 15]] = 1e30  # overflows injected; the growing scale finds others
    return x, jnp.asarray(poison)


def _run(kind: str, state, start: int, stop: int):
    _, step = _program(kind)
    x, poison = _data()
    trajectory = []
    for i in range(start, stop):
        state, out = step(state, x[i], poison[i])
        trajectory.append(out)
    return state, trajectory


def _save_and_restore(how: str, state, template, where: str):
    import orbax.checkpoint as ocp
    from flax import serialization

    if how == "orbax_standard":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(where, state)
        checkpointer.wait_until_finished()
        return checkpointer.restore(where, template)
    if how == "orbax_pytree":
        checkpointer = ocp.PyTreeCheckpointer()
        checkpointer.save(where, state)
        return checkpointer.restore(where, item=template)
    if how == "flax_checkpoints":
        from flax.training import checkpoints

        checkpoints.save_checkpoint(where, state, step=SAVED_AT, overwrite=True)
        return checkpoints.restore_checkpoint(where, target=template)
    if how == "to_bytes":
        return serialization.from_bytes(template, serialization.to_bytes(state))
    if how == "state_dict":
        saved = jax.tree_util.tree_map(np.asarray, serialization.to_state_dict(state))
        return serialization.from_state_dict(template, saved)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["orbax_standard", "orbax_pytree", "flax_checkpoints", "to_bytes", "state_dict"])
@pytest.mark.parametrize(("source", "target"), [("flax", "ampscale"), ("ampscale", "flax")])
def test_a_checkpoint_restores_into_the_other_class_and_resumes_bit_for_bit(tmp_path, how, source, target) -> None:
    create_source, _ = _program(source)
    create_target, _ = _program(target)
    straight, straight_trajectory = _run(source, create_source(), 0, STEPS)
    middle, first_half = _run(source, create_source(), 0, SAVED_AT)
    template = create_target()  # scale 65536 and fin_steps 0: what an unrestored leaf would keep
    restored = _save_and_restore(how, middle, template, os.path.join(tmp_path, "ckpt"))
    assert type(restored.dynamic_scale) is type(template.dynamic_scale)
    assert float(restored.dynamic_scale.scale) == float(middle.dynamic_scale.scale) != 65536.0
    assert int(restored.dynamic_scale.fin_steps) == int(middle.dynamic_scale.fin_steps)
    assert restored.dynamic_scale.growth_interval == 3  # settings come from the template, as in flax
    resumed, second_half = _run(target, restored, SAVED_AT, STEPS)
    assert _values(first_half + second_half) == _values(straight_trajectory)
    assert _values((resumed.params, resumed.opt_state, resumed.dynamic_scale)) == _values(
        (straight.params, straight.opt_state, straight.dynamic_scale)
    )
    scales = np.asarray([float(s) for s, _, _ in straight_trajectory])
    assert (np.diff(scales) > 0).any()
    assert (np.diff(scales) < 0).any()


def test_the_leaves_their_names_and_order_are_flaxs() -> None:
    theirs, ours = _flax_dynamic_scale()(growth_interval=5), ajax.DynamicScale(growth_interval=5)
    for _ in range(2):
        their_paths = jax.tree_util.tree_flatten_with_path(theirs)[0]
        our_paths = jax.tree_util.tree_flatten_with_path(ours)[0]
        assert [p for p, _ in our_paths] == [p for p, _ in their_paths]
        assert [jax.tree_util.keystr(p) for p, _ in our_paths] == [".fin_steps", ".scale"]
        assert [type(v) for _, v in our_paths] == [type(v) for _, v in their_paths]  # Python numbers at first
        assert _values(ours) == _values(theirs)
        step = jax.jit(lambda d: d.value_and_grad(lambda w: jnp.sum(w * w))(jnp.ones(2)).dynamic_scale)
        theirs, ours = step(theirs), step(ours)
    from flax import serialization

    assert (
        serialization.to_state_dict(ours).keys() == serialization.to_state_dict(theirs).keys() == {"fin_steps", "scale"}
    )


def test_flax_serialization_refuses_what_flax_refuses() -> None:
    from flax import serialization

    template = ajax.DynamicScale()
    with pytest.raises(
        ValueError, match="Missing field fin_steps in state dict while restoring an instance of DynamicScale"
    ):
        serialization.from_state_dict(template, {"scale": 1.0})
    with pytest.raises(ValueError, match='Unknown field\\(s\\) "extra"'):
        serialization.from_state_dict(template, {"scale": 1.0, "fin_steps": 0, "extra": 1})
    with pytest.raises(ValueError, match="scale must be"):
        serialization.from_state_dict(template, {"scale": -1.0, "fin_steps": 0})


def test_a_scaler_in_a_train_state_goes_through_flax_serialization() -> None:
    """ampscale's ``Scaler`` (in a ``loss_scaled`` optimizer's state, or anywhere in a state)
    is registered with ``flax.serialization``: its two leaves by their pytree names, restored
    into a scaler with the target's settings; a malformed entry is named."""
    import optax
    from flax import serialization

    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10, growth_interval=3)
    for finite in (True, True, False, True):
        scaler = scaler.update(jnp.bool_(finite))
    state = {"params": {"w": jnp.ones(3)}, "scaler": scaler}
    state_dict = serialization.to_state_dict(state)
    assert state_dict["scaler"].keys() == {"scales", "counters"}
    template = {"params": {"w": jnp.zeros(3)}, "scaler": ampscale.create_scaler(backend="jax", growth_interval=3)}
    restored = serialization.from_bytes(template, serialization.to_bytes(state))
    assert _values(restored["scaler"]) == _values(scaler)  # the state: scale, trackers, counters
    assert restored["scaler"].get_stats()["skipped_steps"] == 1
    assert restored["scaler"].config == template["scaler"].config  # the settings: the target's
    # inside an optax state: loss_scaled's
    opt = ajax.loss_scaled(optax.sgd(0.1), scaler)
    opt_state = opt.init({"w": jnp.ones(3)})
    back = serialization.from_bytes(opt.init({"w": jnp.zeros(3)}), serialization.to_bytes(opt_state))
    assert _values(ajax.scaler_of(back)) == _values(scaler)
    with pytest.raises(ValueError, match=r"counters of a scaler's state must be a int32 array of shape \(10,\)"):
        serialization.from_state_dict(
            template["scaler"], {"scales": np.ones(2, np.float32), "counters": np.ones(3, np.int32)}
        )
    with pytest.raises(ValueError, match="Missing field counters"):
        serialization.from_state_dict(template["scaler"], {"scales": np.ones(2, np.float32)})


@pytest.mark.parametrize("flax_first", [True, False])
def test_the_registration_waits_for_flax_whichever_comes_first(flax_first: bool) -> None:
    """ampscale never imports flax: the classes are registered with ``flax.serialization`` when
    it is imported, before or after ampscale."""
    import subprocess
    import sys

    imports = ["import flax.serialization", "import ampscale, ampscale.jax"]
    code = "\n".join(
        [
            *(imports if flax_first else imports[::-1]),
            "import sys, jax.numpy as jnp",
            "from flax import serialization",
            "state = {'ds': ampscale.jax.DynamicScale(scale=8.0), 's': ampscale.create_scaler(backend='jax'),",
            "         'ls': ampscale.jax.DynamicLossScale(jnp.float32(4.0))}",
            "back = serialization.from_bytes(state, serialization.to_bytes(state))",
            "print(float(back['ds'].scale), back['s'].get_scale(), float(back['ls'].loss_scale))",
        ]
    )
    if not flax_first:
        code = "import sys\nassert 'flax' not in sys.modules\n" + code.replace(
            "import ampscale, ampscale.jax\n", "import ampscale, ampscale.jax\nassert 'flax' not in sys.modules\n", 1
        )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["8.0", "65536.0", "4.0"]
