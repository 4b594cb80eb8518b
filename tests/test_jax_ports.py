"""Scalers built inside one trace (jit, pmap, vmap, scan, shard_map) work in any other."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import ampscale  # noqa: E402

try:
    from jax import shard_map
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map

from jax.sharding import Mesh, PartitionSpec  # noqa: E402

P = PartitionSpec


def _four_devices() -> list:
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported")
    return devices[:4]


def _bits(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


# ------------------------------------------------------------------------------ trace hygiene

_SETTINGS = iter(range(3, 10_000))  # a new config per scaler: nothing cached by an earlier test


def _fresh_scaler():
    return ampscale.create_scaler(backend="jax", preset="jmp", init_scale=2.0**10, growth_interval=next(_SETTINGS))


def _stacked(tree):
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (4, *jnp.shape(x))), tree)


def _build(where: str, mesh: Mesh):
    """A scaler created inside a trace of kind ``where``, returned with a leading axis of 4."""
    if where == "jit":
        return jax.jit(lambda: _stacked(_fresh_scaler()))()
    if where == "pmap":  # Haiku's jax.pmap(initial_state) idiom
        return jax.pmap(lambda _: _fresh_scaler())(jnp.zeros(4))
    if where == "vmap":
        return jax.vmap(lambda _: _fresh_scaler())(jnp.zeros(4))
    if where == "scan":
        return jax.lax.scan(lambda carry, _: (carry, _fresh_scaler()), 0, None, length=4)[1]
    assert where == "shard_map"
    build = shard_map(
        lambda _: jax.tree_util.tree_map(lambda x: x[None], _fresh_scaler()),
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    return jax.jit(build)(jnp.zeros(4))


def _use(where: str, mesh: Mesh, scaler, grads):
    """One unscale and update per device (agreeing over the axis where there is one)."""

    def step(scaler, g, axis):
        g, finite = scaler.unscale(g, axis_name=axis)
        return scaler.update(finite).state.scale

    first = functools.partial(jax.tree_util.tree_map, lambda x: x[0])
    if where == "pmap":
        return jax.pmap(functools.partial(step, axis="i"), axis_name="i")(scaler, grads)
    if where == "shard_map":
        per_device = shard_map(
            lambda s, g: step(first(s), g[0], "i")[None], mesh=mesh, in_specs=P("i"), out_specs=P("i")
        )
        return jax.jit(per_device)(scaler, grads)
    if where == "vmap":
        return jax.jit(jax.vmap(functools.partial(step, axis=None)))(scaler, grads)
    if where == "scan":
        return jax.lax.scan(lambda c, sg: (c, step(*sg, None)), 0, (scaler, grads))[1]
    assert where == "jit"
    return jax.jit(lambda s, g: step(first(s), g[0], None))(scaler, grads)


FORMS = ["jit", "pmap", "vmap", "scan", "shard_map"]


@pytest.mark.parametrize("built_in", FORMS)
def test_a_scaler_built_inside_a_trace_works_in_any_other(built_in: str) -> None:
    """Nothing made inside a trace outlives it: a scaler created under pmap, jit, vmap, scan or
    shard_map (its settings seen there first) is used under each of them afterwards."""
    mesh = Mesh(np.array(_four_devices()), ("i",))
    grads = jnp.full((4, 3), 2.0**10).at[1, 2].set(jnp.inf)  # device 1 overflows
    for used_in in FORMS:
        scaler = _build(built_in, mesh)
        assert np.asarray(scaler.state.scale).tolist() == [2.0**10] * 4
        scales = np.asarray(_use(used_in, mesh, scaler, grads)).ravel().tolist()
        if used_in in ("pmap", "shard_map"):  # the devices agree
            assert scales == [2.0**9] * 4, (built_in, used_in)
        elif used_in == "jit":  # the first scaler, on the first gradients
            assert scales == [2.0**10], (built_in, used_in)
        else:
            assert scales == [2.0**10, 2.0**9, 2.0**10, 2.0**10], (built_in, used_in)


# ------------------------------------------------------------------------------ jmp's arithmetic


@pytest.mark.parametrize("start", [2.0**15, 1000.0, 0.5])
def test_grad_dtype_promote_unscales_as_jmp_does(start: float) -> None:
    """migration.md, jmp rows: ``loss_scale.unscale(grads)`` and ``jmp.all_finite`` equal
    ``scaler.unscale(grads)`` with ``grad_dtype="promote"`` bit for bit, dtypes included, for
    float16, bfloat16 and float32 gradients and any scale (below 1 too); the default keeps
    float16 (jmp's numbers differ then)."""
    jmp = pytest.importorskip("jmp")
    rng = np.random.default_rng(int(start))
    grads = {
        "h": jnp.asarray(np.append(np.clip(rng.normal(size=63) * 2e4, -6e4, 6e4), 6e4), jnp.float16),
        "b": jnp.asarray(rng.normal(size=64) * 1e3, jnp.bfloat16),
        "f": jnp.asarray(rng.normal(size=64) * 1e5, jnp.float32),
    }
    loss_scale = jmp.DynamicLossScale(jnp.float32(start), min_loss_scale=jnp.float32(0.25))
    scaler = ampscale.create_scaler(backend="jax", preset="jmp", init_scale=start, min_scale=0.25, grad_dtype="promote")
    theirs = jax.jit(lambda ls, g: ls.unscale(g))(loss_scale, grads)
    ours, finite = jax.jit(lambda s, g: s.unscale(g))(scaler, grads)
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
    assert _bits(ours) == _bits(theirs)
    assert bool(finite)
    assert bool(jmp.all_finite(theirs))
    kept, kept_finite = jax.jit(lambda s, g: s.unscale(g))(scaler.replace(grad_dtype="keep"), grads)
    assert kept["h"].dtype == jnp.float16
    assert bool(kept_finite) == (start >= 1.0)  # below 1: 60000 * 2 overflows float16, not float32
