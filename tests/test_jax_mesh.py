"""Agreement across devices on 8 CPU devices: one collective per step, and 2-D meshes.

These run in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the test
session has 4 devices, set before JAX starts). Collectives are counted twice: the all-reduces
ampscale emits (StableHLO) and those XLA runs (the compiled HLO, after its passes, which may
combine some).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

PRELUDE = """
import functools, json
import numpy as np
import jax, jax.numpy as jnp
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P
import ampscale, ampscale.jax as ajax

assert len(jax.devices()) == 8, jax.devices()


def all_reduces(fn, *args):
    # all-reduces emitted (StableHLO, before XLA may combine some) and run (compiled HLO)
    lowered = jax.jit(fn).lower(*args)
    emitted = lowered.as_text().count("stablehlo.all_reduce")
    text = lowered.compile().as_text()
    run = sum(line.count(" all-reduce(") + line.count(" all-reduce-start(") for line in text.splitlines())
    return [emitted, run]
"""


def _run(body: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ONE_COLLECTIVE = """
mesh = Mesh(np.array(jax.devices()), ("data",))
grads = {"w": jnp.ones((8, 16)), "b": jnp.ones((8, 4))}
losses = jnp.ones((8,))
# a copy of the parameters per device (as pmap replicates them): their gradients vary over
# "data" and are averaged by value_and_grad's axis_name, the step's one all-reduce
params = {"w": jnp.ones((8, 16, 3)), "b": jnp.zeros((8, 3))}
x = jnp.ones((8, 2, 16))
scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10)


def loss_fn(params, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ params["w"]) + params["b"]))


def mapped(fn, in_specs):
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=True)


def unscale_step(scaler, g, loss):
    g, finite = scaler.unscale(g, loss=loss[0] * scaler.state.scale, axis_name="data")
    return scaler.update(finite).state.scale


def first(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def value_and_grad_step(scaler, params, x):
    out = ajax.value_and_grad(loss_fn, axis_name="data")(scaler, first(params), x[0])
    return scaler.update(out.finite, loss_finite=out.loss_finite).state.scale, out.grads


def dynamic_scale_step(params, x):
    ds = ajax.DynamicScale(check_loss=True)
    ds, finite, loss, grads = ds.value_and_grad(loss_fn, axis_name="data")(first(params), x[0])
    return ds.scale, grads


def dynamic_scale_default_step(params, x):
    ds, finite, loss, grads = ajax.DynamicScale().value_and_grad(loss_fn, axis_name="data")(first(params), x[0])
    return ds.scale, grads


def flax_step(params, x):
    from flax.training.dynamic_scale import DynamicScale
    ds, finite, loss, grads = DynamicScale().value_and_grad(loss_fn, axis_name="data")(first(params), x[0])
    return ds.scale, grads


counts = {
    "unscale": all_reduces(mapped(unscale_step, (P(), P("data"), P("data"))), scaler, grads, losses),
    "value_and_grad": all_reduces(mapped(value_and_grad_step, (P(), P("data"), P("data"))), scaler, params, x),
    "dynamic_scale": all_reduces(mapped(dynamic_scale_step, (P("data"), P("data"))), params, x),
    "dynamic_scale_default": all_reduces(mapped(dynamic_scale_default_step, (P("data"), P("data"))), params, x),
    "flax": all_reduces(mapped(flax_step, (P("data"), P("data"))), params, x),
    "value_and_grad_pmap": all_reduces(
        jax.pmap(
            lambda p, x: value_and_grad_step(scaler, jax.tree_util.tree_map(lambda a: a[None], p), x[None]),
            axis_name="data",
        ),
        params, x,
    ),
}
print(json.dumps(counts))
"""


def test_one_collective_per_step_for_the_gradients_and_the_loss() -> None:
    """With the scaled loss checked, a step runs one all-reduce: ``Scaler.unscale(loss=,
    axis_name=)`` reduces both flags in one ``pmin`` (it emitted one each), and
    ``ampscale.jax.value_and_grad(axis_name=)`` and ``DynamicScale.value_and_grad(axis_name=)``
    carry the loss's flag as one more operand of the gradients' own ``pmean`` (a ``pmin`` of the
    flag followed it, a second all-reduce XLA cannot merge with a sum), under ``shard_map`` and
    ``pmap``: as many collectives as flax's own ``DynamicScale``, which checks no loss (and
    ``DynamicScale``'s default, flax's flag, emits exactly flax's)."""
    counts = _run(ONE_COLLECTIVE)
    emitted = {name: pair[0] for name, pair in counts.items()}
    run = {name: pair[1] for name, pair in counts.items()}
    assert run == dict.fromkeys(counts, 1)
    assert emitted["unscale"] == 1
    # the gradients' reduction, one operand per leaf (XLA merges them), plus the loss's flag
    for name in ("value_and_grad", "dynamic_scale", "value_and_grad_pmap"):
        assert emitted[name] == emitted["flax"] + 1 == 3, name
    assert emitted["dynamic_scale_default"] == emitted["flax"]  # no loss check by default, as flax


NO_AXIS = """
mesh = Mesh(np.array(jax.devices()), ("data",))
params = {"w": jnp.ones((8, 16, 3)) * 0.1}
x = jnp.ones((8, 2, 16))
poison = jnp.ones((8,)).at[3].set(jnp.inf)  # one device's gradient overflows
scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10)


@jax.custom_vjp
def poison_grad(w, p):
    return w


poison_grad.defvjp(lambda w, p: (w, p), lambda p, g: (g * p, jnp.zeros_like(p)))


def loss_fn(params, x, p):
    return jnp.mean(jnp.square(jnp.tanh(x @ poison_grad(params["w"], p))))


def flax_step(params, x, p):
    from flax.training.dynamic_scale import DynamicScale
    ds, finite, loss, grads = DynamicScale(scale=2.0**10).value_and_grad(loss_fn)(params, x, p)
    return finite, ds.scale


def ours_step(params, x, p):
    ds, finite, loss, grads = ajax.DynamicScale(scale=2.0**10).value_and_grad(loss_fn, axis_name=None)(params, x, p)
    return finite, ds.scale


def ours_checked_step(params, x, p):
    ds = ajax.DynamicScale(scale=2.0**10, check_loss=True)
    ds, finite, loss, grads = ds.value_and_grad(loss_fn)(params, x, p)
    return finite, ds.scale


def ours_agreed_step(params, x, p):
    ds = ajax.DynamicScale(scale=2.0**10)
    ds, finite, loss, grads = ds.value_and_grad(loss_fn, agree_axes="data")(params, x, p)
    return finite, ds.scale


def helper_step(params, x, p):
    out = ajax.value_and_grad(loss_fn, axis_name=None)(scaler, params, x, p)
    return out.finite, scaler.update(out.finite, loss_finite=out.loss_finite).state.scale


def helper_agreed_step(params, x, p):
    out = ajax.value_and_grad(loss_fn, axis_name=None, agree_axes="data")(scaler, params, x, p)
    return out.finite, scaler.update(out.finite, loss_finite=out.loss_finite).state.scale


def mapped(step):
    def fn(params, x, p):
        finite, scale = step({"w": params["w"][0]}, x[0], p[0])
        return finite[None], scale[None]
    return shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=P("data"), check_vma=True)


out = {}
for name, step in (
    ("flax", flax_step), ("ours", ours_step), ("ours_checked", ours_checked_step),
    ("ours_agreed", ours_agreed_step), ("helper", helper_step), ("helper_agreed", helper_agreed_step),
):
    finite, scale = jax.jit(mapped(step))(params, x, poison)
    out[name] = {
        "finite": np.asarray(finite).tolist(),
        "scale": np.asarray(scale).tolist(),
        "all_reduces": all_reduces(mapped(step), params, x, poison),
    }
print(json.dumps(out))
"""


def test_axis_name_none_agrees_nothing_as_flax_and_agree_axes_agrees() -> None:
    """Under ``shard_map`` (``check_vma=True``) with ``axis_name=None`` nothing is averaged nor
    agreed, as in flax: the device whose gradient overflowed skips the step alone and no
    collective runs, for ``DynamicScale.value_and_grad`` (with and without ``check_loss``) and
    ``ampscale.jax.value_and_grad`` alike. ``agree_axes="data"`` agrees the flag over the axis,
    in one all-reduce: every device skips."""
    out = _run(NO_AXIS)
    alone = [i != 3 for i in range(8)]
    assert out["flax"]["finite"] == alone
    assert out["flax"]["all_reduces"] == [0, 0]
    for name in ("ours", "ours_checked", "helper"):
        assert out[name]["finite"] == alone, name
        assert out[name]["scale"] == out["flax"]["scale"], name
        assert out[name]["all_reduces"] == [0, 0], name
    for name in ("ours_agreed", "helper_agreed"):
        assert out[name]["finite"] == [False] * 8, name
        assert out[name]["scale"] == [512.0] * 8, name
        assert out[name]["all_reduces"][0] == 1, name


MESH_2D = """
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


@jax.custom_vjp
def poison_grad(w, p):
    return w


poison_grad.defvjp(lambda w, p: (w, p), lambda p, g: (g * p, jnp.zeros_like(p)))


def loss_fn(params, x, p):
    # tensor parallel: each device holds a column shard of w, the loss sums over the shards
    w = poison_grad(params["w"], p)
    local = jnp.sum(jnp.square(jnp.tanh(x @ w)))
    return jax.lax.psum(local, "model") / x.shape[0]


# a copy per data row (as pmap replicates), each holding column shards over "model"
params = {"w": jnp.ones((4, 16, 8)) * 0.1}
x = jnp.ones((4, 2, 16))
poison = jnp.ones((4, 2)).at[1, 0].set(jnp.inf)  # one model shard's gradient overflows, on one data row
specs = (P("data", None, "model"), P("data"), P("data", "model"))


def per_device(step):
    def fn(params, x, p):
        finite, scale = step({"w": params["w"][0]}, x[0], p[0, 0])
        return finite[None, None], scale[None, None]
    return jax.jit(shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P("data", "model"), P("data", "model"))))


def ours(params, x, p):
    ds, finite, loss, grads = ajax.DynamicScale(scale=2.0**10).value_and_grad(loss_fn, axis_name="data")(params, x, p)
    return finite, ds.scale


def theirs(params, x, p):
    from flax.training.dynamic_scale import DynamicScale
    ds, finite, loss, grads = DynamicScale(scale=2.0**10).value_and_grad(loss_fn, axis_name="data")(params, x, p)
    return finite, ds.scale


scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10)


def helper(params, x, p):
    out = ajax.value_and_grad(loss_fn, axis_name="data")(scaler, params, x, p)
    return out.finite, scaler.update(out.finite, loss_finite=out.loss_finite).state.scale


def unscale(params, x, p):
    grads = jax.grad(lambda q: scaler.scale(loss_fn(q, x, p)))(params)
    grads, finite = scaler.unscale(grads, axis_name="data")
    return finite, scaler.update(finite).state.scale


def no_vma(agree):
    def step(params, x, p):
        ds, finite, loss, grads = ajax.DynamicScale(scale=2.0**10).value_and_grad(
            loss_fn, axis_name="data", agree_axes=agree)(params, x, p)
        return finite, ds.scale

    def fn(params, x, p):
        finite, scale = step({"w": params["w"][0]}, x[0], p[0, 0])
        return finite[None, None], scale[None, None]
    return jax.jit(shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P("data", "model"),) * 2, check_vma=False))


def helper_no_vma(agree):
    def step(params, x, p):
        out = ajax.value_and_grad(loss_fn, axis_name="data", agree_axes=agree)(scaler, params, x, p)
        return out.finite, scaler.update(out.finite, loss_finite=out.loss_finite).state.scale

    def fn(params, x, p):
        finite, scale = step({"w": params["w"][0]}, x[0], p[0, 0])
        return finite[None, None], scale[None, None]
    return jax.jit(shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P("data", "model"),) * 2, check_vma=False))


out = {}
for name, step in (("ours", ours), ("flax", theirs), ("helper", helper), ("unscale", unscale)):
    finite, scale = per_device(step)(params, x, poison)
    out[name] = {"finite": np.asarray(finite).tolist(), "scale": np.asarray(scale).tolist()}
for name, agree in (("no_vma", None), ("no_vma_agree_axes", "model")):
    finite, scale = no_vma(agree)(params, x, poison)
    out[name] = {"finite": np.asarray(finite).tolist(), "scale": np.asarray(scale).tolist()}
for name, agree in (("helper_no_vma", None), ("helper_no_vma_agree_axes", "model")):
    finite, scale = helper_no_vma(agree)(params, x, poison)
    out[name] = {"finite": np.asarray(finite).tolist(), "scale": np.asarray(scale).tolist()}
clean = per_device(ours)(params, x, jnp.ones((4, 2)))
out["clean"] = {"finite": np.asarray(clean[0]).tolist(), "scale": np.asarray(clean[1]).tolist()}
print(json.dumps(out))
"""


def test_a_data_by_model_mesh_skips_the_same_steps_on_every_device() -> None:
    """A 4 x 2 (data x model) mesh, tensor-parallel weights, one model shard's gradient
    overflowing on one data row: with ``axis_name="data"`` the gradients are averaged over data
    and the flag is agreed over every axis they still vary over, so all eight devices skip the
    step and keep the same scale (flax's ``DynamicScale`` skips it on one model shard only).
    ``Scaler.unscale(axis_name="data")`` agrees over the model axis too. Under
    ``check_vma=False`` JAX records no varying axes: ``agree_axes="model"`` names them, for
    ``DynamicScale.value_and_grad`` and ``ampscale.jax.value_and_grad`` alike."""
    out = _run(MESH_2D)
    everywhere_skipped = {"finite": [[False, False]] * 4, "scale": [[512.0, 512.0]] * 4}
    for name in ("ours", "helper", "unscale", "no_vma_agree_axes", "helper_no_vma_agree_axes"):
        assert out[name] == everywhere_skipped, name
    assert out["flax"]["finite"] == [[False, True]] * 4  # the failure this fixes, shown on flax
    for name in ("no_vma", "helper_no_vma"):  # without vma nor agree_axes, as flax
        assert out[name]["finite"] == [[False, True]] * 4, name
    assert out["clean"] == {"finite": [[True, True]] * 4, "scale": [[1024.0, 1024.0]] * 4}
