"""``ampscale.jax.DynamicScale`` as a dataclass, side by side with flax's ``DynamicScale``.

flax's class is a ``flax.struct.dataclass``: programs compare instances with ``==``, copy them
with ``dataclasses.replace`` or ``.replace()``, list their fields, print them. Each test runs
the same assertions on flax's class and on ampscale's (the drop-in must pass whatever flax
passes); what ampscale adds (``check_loss``, ``settings``) is checked on ampscale's alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
flax_dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")

import ampscale.jax as ajax  # noqa: E402

CLASSES = {"flax": flax_dynamic_scale.DynamicScale, "ampscale": ajax.DynamicScale}
FLAX_FIELDS = ["growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale", "minimum_scale"]


def _sig(x) -> tuple:
    aval = jax.typeof(x)
    return (str(aval.dtype), aval.weak_type, aval.shape, np.asarray(x).tobytes())


@pytest.fixture(params=list(CLASSES))
def ds_class(request):
    return CLASSES[request.param]


def test_equal_settings_and_state_compare_equal(ds_class) -> None:
    assert ds_class() == ds_class()
    assert ds_class(growth_interval=10, scale=8.0) == ds_class(growth_interval=10, scale=8.0)
    assert ds_class(growth_factor=2) == ds_class(growth_factor=2.0)  # compared by value
    assert ds_class() != ds_class(scale=8.0)
    assert ds_class() != ds_class(fin_steps=1)
    assert ds_class() != ds_class(minimum_scale=None)
    assert hash(ds_class()) == hash(ds_class())
    # with array leaves (after a step), compared leaf by leaf
    ds = ds_class(growth_interval=3, scale=8.0)
    after = ds.value_and_grad(lambda w: w * w)(jnp.float32(1.0)).dynamic_scale
    assert after == ds_class(growth_interval=3, fin_steps=jnp.int32(1), scale=jnp.float32(8.0))
    assert after != ds_class(growth_interval=3, fin_steps=jnp.int32(2), scale=jnp.float32(8.0))


def test_it_is_a_frozen_dataclass_with_flaxs_fields(ds_class) -> None:
    ds = ds_class(scale=4.0)
    assert dataclasses.is_dataclass(ds)
    assert [f.name for f in dataclasses.fields(ds)][:6] == FLAX_FIELDS
    assert {f.name: f.default for f in dataclasses.fields(ds_class) if f.name in FLAX_FIELDS} == {
        f.name: f.default for f in dataclasses.fields(flax_dynamic_scale.DynamicScale)
    }
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'scale'"):
        ds.scale = 2.0


def test_dataclasses_replace_and_the_replace_method(ds_class) -> None:
    ds = ds_class(growth_interval=7, scale=4.0, minimum_scale=0.5)
    for moved in (dataclasses.replace(ds, scale=8.0, fin_steps=2), ds.replace(scale=8.0, fin_steps=2)):
        assert type(moved) is ds_class
        assert moved == ds_class(growth_interval=7, fin_steps=2, scale=8.0, minimum_scale=0.5)
        assert moved.value_and_grad(lambda w: w * w)(jnp.float32(1.0)).dynamic_scale.fin_steps == 3
    grown = dataclasses.replace(ds, growth_factor=4.0, growth_interval=0)
    assert float(grown.value_and_grad(lambda w: w * w)(jnp.float32(1.0)).dynamic_scale.scale) == 16.0
    with pytest.raises(TypeError):
        dataclasses.replace(ds, scales=1.0)
    with pytest.raises(TypeError):
        ds.replace(scales=1.0)
    # under a trace, the state only, as flax's value_and_grad does
    traced = jax.jit(lambda d, s: d.replace(scale=s).scale)(ds, jnp.float32(2.0))
    assert float(traced) == 2.0


def test_the_repr_is_flaxs() -> None:
    for kwargs in ({}, {"growth_interval": 5, "scale": 8.0, "minimum_scale": None}, {"fin_steps": 3}):
        assert repr(ajax.DynamicScale(**kwargs)) == repr(flax_dynamic_scale.DynamicScale(**kwargs))
    ds = ajax.DynamicScale(scale=2.0)
    after = ds.value_and_grad(lambda w: w * w)(jnp.float32(1.0)).dynamic_scale
    theirs = flax_dynamic_scale.DynamicScale(scale=2.0).value_and_grad(lambda w: w * w)(jnp.float32(1.0)).dynamic_scale
    assert repr(after) == repr(theirs)
    assert repr(ajax.DynamicScale(check_loss=True)).endswith("check_loss=True)")


def test_replace_keeps_what_ampscale_adds() -> None:
    """``check_loss`` and the ampscale settings are fields too (keyword-only, after flax's),
    so ``dataclasses.replace`` and ``.replace()`` keep them, and ``==`` tells them apart."""
    ds = ajax.DynamicScale(scale=4.0, check_loss=True, on_floor="warn", max_scale=2.0**20)
    assert ds.settings == (("max_scale", 2.0**20), ("on_floor", "warn"))
    for moved in (dataclasses.replace(ds, scale=8.0), ds.replace(scale=8.0), ds.replace(growth_interval=3)):
        assert moved.check_loss
        assert moved.settings == ds.settings
        assert moved.scaler.config.on_floor == "warn"
        assert moved.scaler.config.max_scale == 2.0**20
    assert ds != dataclasses.replace(ds, check_loss=False)
    assert ds == ajax.DynamicScale(scale=4.0, check_loss=True, max_scale=2.0**20, on_floor="warn")
    with pytest.raises(TypeError, match="check_loss must be True or False"):
        dataclasses.replace(ds, check_loss=1)
    with pytest.raises(ValueError, match="scale must be"):
        dataclasses.replace(ds, scale=-1.0)
    with pytest.raises(TypeError, match=r"keeps flax's state only .*\['hysteresis'\]"):
        dataclasses.replace(ds, settings={"hysteresis": 2})


def test_the_default_flag_is_flaxs_over_random_steps() -> None:
    """A drop-in's default is flax's: scaled losses that overflow while the gradients stay
    finite on some steps, plus overflowing gradients on others: the same flags, scales,
    fin_steps, losses and gradients as flax's, step by step under ``jit``, dtypes and weak types
    included (a Python ``fin_steps`` of 0 becomes a weakly typed int32 in flax's ``where``)."""
    rng = np.random.default_rng(3)
    offsets = jnp.asarray(np.where(rng.random(40) < 0.3, 1e36, 0.0), jnp.float32)
    poisons = jnp.asarray(np.where(rng.random(40) < 0.15, np.inf, 1.0), jnp.float32)

    def loss_fn(w, offset, poison):
        return jnp.sum(w * w * poison) + offset

    def run(cls):
        step = jax.jit(lambda ds, w, o, p: ds.value_and_grad(loss_fn)(w, o, p))
        ds, w, out = cls(growth_interval=2, scale=2.0**10), jnp.ones(3), []
        for offset, poison in zip(offsets, poisons, strict=True):
            ds, finite, loss, grad = step(ds, w, offset, poison)
            out.append([_sig(x) for x in (finite, loss, grad, ds.fin_steps, ds.scale)])
        return out

    theirs = run(flax_dynamic_scale.DynamicScale)
    assert run(ajax.DynamicScale) == theirs
    assert sum(np.frombuffer(step[0][-1], bool)[0] for step in theirs) < len(theirs)  # some steps skipped


def test_the_leaves_alone_never_change_the_structure(ds_class) -> None:
    """The scale and ``fin_steps`` are leaves only: two instances that differ in them have one
    pytree structure (``tree_map`` over both, ``lax.cond`` branches, ``jit``'s cache), and a
    scale below ``minimum_scale`` is taken (the next backoff lifts it to the floor)."""
    structure = jax.tree_util.tree_structure
    assert structure(ds_class(scale=8.0)) == structure(ds_class(scale=16.0, fin_steps=3))
    assert structure(ds_class()) != structure(ds_class(growth_interval=3))
    summed = jax.tree_util.tree_map(lambda a, b: a + b, ds_class(scale=8.0), ds_class(scale=16.0, fin_steps=3))
    assert (float(summed.scale), int(summed.fin_steps)) == (24.0, 3)
    chosen = jax.jit(lambda flag: jax.lax.cond(flag, lambda: ds_class(scale=2.0), lambda: ds_class(scale=4.0)))
    assert float(chosen(jnp.bool_(False)).scale) == 4.0
    low = ds_class(scale=0.5, minimum_scale=1.0)
    backed_off = low.value_and_grad(lambda w: w * jnp.inf)(jnp.float32(1.0)).dynamic_scale
    assert float(backed_off.scale) == 1.0
