"""The JAX backend: jit-native, sync-free, pytree-safe, sharded, with optax, against jmp and flax."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from typing import NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import ampscale  # noqa: E402
import ampscale.jax as ajax  # noqa: E402

# ------------------------------------------------------------------------------ pytree round trips

ODD_CONFIG = {
    "preset": "megatron",
    "init_scale": 2.0**20,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "hysteresis": 3,
    "min_scale": 0.25,
    "max_scale": 2.0**40,
    "hysteresis_mode": "consecutive",
    "counter_rule": "modulo",
    "ceiling": "skip",
    "floor_patience": 4,
}


def test_every_field_survives_jit_tree_util_and_pickle() -> None:
    scaler = ampscale.create_scaler(backend="jax", **ODD_CONFIG)
    scaler = scaler.update(False).update(True)
    through_jit = jax.jit(lambda s: s)(scaler)
    leaves, treedef = jax.tree_util.tree_flatten(scaler)
    through_tree = jax.tree_util.tree_unflatten(treedef, leaves)
    through_map = jax.tree_util.tree_map(lambda x: x, scaler)
    through_pickle = pickle.loads(pickle.dumps(scaler))
    for other in (through_jit, through_tree, through_map, through_pickle):
        assert other.config == scaler.config
        assert other.config.min_scale == 0.25  # the field jmp loses on a pytree round trip
        assert other.state_dict() == scaler.state_dict()
    assert len(leaves) == 2  # the packed state; settings are never leaves
    # and the floor keeps working after the round trip (jmp's resets to 1.0)
    low = ampscale.create_scaler(backend="jax", preset="jmp", init_scale=0.5, min_scale=0.25)
    assert jax.jit(lambda s: s.update(False))(low).get_scale() == 0.25


def test_key_paths_name_the_state() -> None:
    scaler = ampscale.create_scaler(backend="jax")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(scaler)[0]]
    assert paths == [".scales", ".counters"]


# ------------------------------------------------------------------------------ jit, scan, vmap


class Params(NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Module:  # an Equinox/flax-struct-style module
    layer: Params
    scale: jax.Array
    name: str = dataclasses.field(default="m", metadata={"static": True})


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params.layer.w + params.layer.b) * params.scale
    return jnp.mean((pred - y) ** 2)


def make_module(dtype=jnp.float32):
    k = jax.random.PRNGKey(0)
    return Module(Params(jax.random.normal(k, (4, 3), dtype), jnp.zeros(3, dtype)), jnp.ones((), dtype))


def sgd(params, grads, state):
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), state + 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_full_step_eager_and_jit(mode: str) -> None:
    params = make_module()
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 3))

    def step(scaler, params, count, poison):
        scaled_loss = scaler.scale(loss_fn(params, x, y) + poison)
        grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
        return scaler.step(sgd, params, grads, count, loss=scaled_loss)

    fn = jax.jit(step) if mode == "jit" else step
    scaler = ampscale.create_scaler(backend="jax", growth_interval=2)
    p1, c1, scaler = fn(scaler, params, jnp.int32(0), jnp.float32(0.0))
    assert int(c1) == 1
    assert bool(scaler.outcome.applied)
    p2, c2, scaler = fn(scaler, p1, c1, jnp.float32(jnp.inf))  # the scaled loss overflows
    assert int(c2) == 1
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2), strict=False)
    )
    assert scaler.outcome.to_dict()["reason"] == "loss"
    assert scaler.get_scale() == 2.0**15


def test_scan_training_loop_matches_python_loop() -> None:
    flags = jnp.array([True, True, False, True, True, True, False, False, True])

    def body(scaler, finite):
        scaler = scaler.update(finite)
        return scaler, scaler.state.scale

    scaler = ampscale.create_scaler(backend="jax", growth_interval=2)
    _, scales = jax.lax.scan(body, scaler, flags)
    host = ampscale.create_scaler(backend="numpy", growth_interval=2)
    expected = []
    for f in flags.tolist():
        host = host.update(f)
        expected.append(host.get_scale())
    assert np.asarray(scales).tolist() == expected


def test_vmap_over_independent_scalers() -> None:
    base = ampscale.create_scaler(backend="jax", growth_interval=1)
    batched = jax.tree_util.tree_map(lambda x: jnp.stack([x, x, x]), base)
    flags = jnp.array([True, False, True])
    updated = jax.vmap(lambda s, f: s.update(f))(batched, flags)
    assert np.asarray(updated.state.scale).tolist() == [2.0**17, 2.0**15, 2.0**17]
    assert np.asarray(updated.state.steps).tolist() == [1, 1, 1]


def test_any_pytree_none_leaves_and_dtypes_kept() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=4.0)
    tree = {
        "module": make_module(jnp.float16),
        "list": [jnp.full(3, 8.0, jnp.bfloat16), None],
        "tuple": (jnp.full(2, 4.0, jnp.float32),),
    }
    out, finite = jax.jit(scaler.unscale)(tree)
    assert bool(finite)
    assert out["list"][1] is None
    assert out["module"].layer.w.dtype == jnp.float16
    assert out["list"][0].dtype == jnp.bfloat16
    assert out["module"].name == "m"
    np.testing.assert_array_equal(np.asarray(out["list"][0], np.float32), [2.0, 2.0, 2.0])
    bad = jax.tree_util.tree_map(lambda x: x, tree)
    bad["list"][0] = bad["list"][0].at[1].set(jnp.nan)
    assert not bool(jax.jit(scaler.unscale)(bad)[1])


def test_donated_gradients_are_reused() -> None:
    scaler = ampscale.create_scaler(backend="jax")
    grads = [jnp.ones((256, 256)), jnp.ones(10, jnp.float16)]
    fn = jax.jit(lambda s, g: s.unscale(g), donate_argnums=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX warns when a donated buffer could not be used
        out, finite = fn(scaler, grads)
    assert grads[0].is_deleted()
    assert bool(finite)
    assert out[1].dtype == jnp.float16


def test_jitted_step_needs_no_host_transfer_and_never_retraces() -> None:
    traces = []
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 3))

    @jax.jit
    def train_step(scaler, params, count):
        traces.append(1)
        grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
        return scaler.step(sgd, params, grads, count)

    scaler = ampscale.create_scaler(backend="jax", growth_interval=3)
    params, count = make_module(), jnp.int32(0)
    params, count, scaler = train_step(scaler, params, count)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for _ in range(6):
            params, count, scaler = train_step(scaler, params, count)
    assert len(traces) == 1
    assert int(count) == 7
    assert scaler.get_scale() == 2.0**18


def test_eager_loop_compiles_nothing_after_the_first_steps() -> None:
    """Eagerly (no jit around the step), with a new update closure every step, the scaler adds
    no compilation per step: ``step`` selects leaf by leaf instead of tracing ``lax.cond``, and
    the transition, unpacking and selection are each one cached computation."""
    import jax.monitoring

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _seconds, **_kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 3))
    scaler = ampscale.create_scaler(backend="jax", growth_interval=2)
    params, count = make_module(), jnp.int32(0)

    def one_step(scaler, params, count, poison, lr):
        def update(p, g, s):  # a new closure each step, as in a plain Python training loop
            return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), s + 1

        grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
        scaled_loss = scaler.scale(loss_fn(params, x, y) + poison)
        params, count, scaler = scaler.step(update, params, grads, count, loss=scaled_loss)
        return scaler, params, count, bool(scaler.outcome.applied), scaler.get_scale()

    for poison in (0.0, jnp.inf, 0.0):  # warm-up: both outcomes once
        scaler, params, count, *_ = one_step(scaler, params, count, jnp.float32(poison), 0.1)
    compiles.clear()
    seen = []
    for i, poison in enumerate([0.0, 0.0, jnp.inf, 0.0, jnp.inf, 0.0]):
        before = params
        scaler, params, count, applied, scale = one_step(scaler, params, count, jnp.float32(poison), 0.1 / (i + 2))
        seen.append((applied, scale))
        if not applied:  # skipped: the inputs, bitwise
            for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(params), strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b))
    assert compiles == []
    assert [a for a, _ in seen] == [True, True, False, True, False, True]
    assert int(count) == 2 + 4


def test_scaler_without_backend_is_a_pytree_from_the_start() -> None:
    scaler = ampscale.create_scaler()  # jax is imported: registered, state created on flatten
    out = jax.jit(lambda s, g: s.unscale(g))(scaler, [jnp.full(2, 2.0**16)])
    assert np.asarray(out[0][0]).tolist() == [1.0, 1.0]


# ------------------------------------------------------------------------------ optax


def test_optax_wrapper_skips_without_touching_inner_state() -> None:
    import optax

    params = {"w": jnp.array([1.0, -0.0, 0.0, 2.0]), "b": jnp.array(3.0)}
    opt = ajax.loss_scaled(optax.chain(optax.clip(1.0), optax.adam(0.1)), ampscale.create_scaler(backend="jax"))
    state = opt.init(params)

    @jax.jit
    def step(params, state, poison):
        scaler = ajax.scaler_of(state)
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2) + p["b"] * poison))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params1, state1 = step(params, state, jnp.float32(1.0))
    count1 = state1.inner_state[1][0].count
    params2, state2 = step(params1, state1, jnp.float32(jnp.inf))
    for a, b in zip(jax.tree_util.tree_leaves(params1), jax.tree_util.tree_leaves(params2), strict=False):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # -0.0 stays -0.0
    assert int(state2.inner_state[1][0].count) == int(count1) == 1
    for a, b in zip(
        jax.tree_util.tree_leaves(state1.inner_state), jax.tree_util.tree_leaves(state2.inner_state), strict=False
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert ajax.scaler_of(state2).get_scale() == 2.0**15
    assert ajax.scaler_of(state2).outcome.to_dict()["skipped_steps"] == 1
    _params3, state3 = step(params2, state2, jnp.float32(1.0))
    assert int(state3.inner_state[1][0].count) == 2


def test_optax_wrapper_checks_the_scaled_loss() -> None:
    import optax

    opt = ajax.loss_scaled(optax.sgd(0.1), ampscale.create_scaler(backend="jax"))
    params = jnp.ones(3)
    state = opt.init(params)
    updates, state = opt.update(jnp.ones(3), state, params, scaled_loss=jnp.float32(jnp.nan))
    assert np.asarray(optax.apply_updates(params, updates)).tolist() == [1.0, 1.0, 1.0]
    assert ajax.scaler_of(state).outcome.to_dict()["reason"] == "loss"
    with pytest.raises(ValueError, match="LossScaleState"):
        ajax.scaler_of(optax.sgd(0.1).init(params))


def test_value_and_grad_helper() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**10)
    params = make_module()
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 3))
    grad_fn = jax.jit(ajax.value_and_grad(loss_fn))
    out = grad_fn(scaler, params, x, y)
    expected_loss, expected_grads = jax.value_and_grad(loss_fn)(params, x, y)
    np.testing.assert_allclose(out.loss, expected_loss, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(out.grads), jax.tree_util.tree_leaves(expected_grads), strict=False):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert bool(out.finite)
    assert bool(out.loss_finite)
    aux_fn = ajax.value_and_grad(lambda p, x, y: (loss_fn(p, x, y), "aux"), has_aux=True)
    assert aux_fn(scaler, params, x, y).aux == "aux"
    bad = ajax.value_and_grad(lambda p: loss_fn(p, x, y) * jnp.inf)(scaler, params)
    assert not bool(bad.finite)
    assert not bool(bad.loss_finite)


# ------------------------------------------------------------------------------ several devices


def _four_devices():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported")
    return devices[:4]


def test_shard_map_with_axis_name_all_devices_agree() -> None:
    from jax.sharding import Mesh, PartitionSpec

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older jax
        from jax.experimental.shard_map import shard_map

    mesh = Mesh(np.array(_four_devices()), ("data",))
    scaler = ampscale.create_scaler(backend="jax", axis_name="data", growth_interval=1)
    grads = jnp.ones((4, 8)).at[0, 3].set(jnp.inf)  # only device 0's shard overflows

    def per_device(scaler, g):
        g, finite = scaler.unscale(g)
        scaler = scaler.update(finite)
        return scaler.state.scale[None], finite[None]

    fn = shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec("data")),
        out_specs=(PartitionSpec("data"), PartitionSpec("data")),
    )
    scales, finites = jax.jit(fn)(scaler, grads)
    assert np.asarray(finites).tolist() == [False] * 4
    assert np.asarray(scales).tolist() == [2.0**15] * 4
    without = ampscale.create_scaler(backend="jax", growth_interval=1)
    scales, finites = jax.jit(fn)(without.replace(axis_name="data"), jnp.ones((4, 8)))
    assert np.asarray(scales).tolist() == [2.0**17] * 4


def test_sharded_arrays_under_jit_are_global_by_construction() -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(_four_devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    grads = jax.device_put(jnp.ones((8, 4)).at[7, 1].set(jnp.nan), sharding)  # in the last shard only
    scaler = ampscale.create_scaler(backend="jax")

    @jax.jit
    def step(scaler, g):
        g, finite = scaler.unscale(g)
        return g, scaler.update(finite)

    out, scaler = step(scaler, grads)
    assert scaler.get_scale() == 2.0**15
    assert out.sharding.is_equivalent_to(sharding, out.ndim)


# ------------------------------------------------------------------------------ the real jmp and flax


@pytest.mark.parametrize("seed", range(8))
def test_jmp_itself_gives_the_same_trajectory_under_jit(seed: int) -> None:
    jmp = pytest.importorskip("jmp")
    rng = np.random.default_rng(seed)
    flags = rng.random(300) < rng.choice([0.5, 0.9, 0.97])
    period, factor, start = (
        int(rng.integers(1, 6)),
        int(rng.choice([2, 3, 4])),
        float(rng.choice([1.0, 3.0, 2.0**15, 2.0**120])),
    )
    floor = None if seed < 3 else float(rng.choice([1.0, 0.25, 2.0**-10, 0.0]))
    extra = {} if floor is None else {"min_loss_scale": jnp.float32(floor)}
    theirs = jmp.DynamicLossScale(jnp.float32(start), period=period, factor=factor, **extra)
    ours = ampscale.create_scaler(
        backend="jax",
        preset="jmp",
        init_scale=start,
        growth_interval=period,
        growth_factor=factor,
        # jmp's floor of 0 lets its scale reach 0; ampscale's lowest floor is float32's smallest normal
        **({} if floor is None else {"min_scale": floor or None}),
    )
    # jmp loses min_loss_scale on a pytree round trip (jit resets it to 1): with a floor, run
    # jmp eagerly, so the comparison is with its documented behaviour rather than that bug.
    adjust = jax.jit(lambda ls, f: ls.adjust(f)) if floor is None else (lambda ls, f: ls.adjust(f))
    update = jax.jit(lambda s, f: s.update(f))
    for f in flags:
        theirs = adjust(theirs, jnp.bool_(f))
        ours = update(ours, jnp.bool_(f))
        if float(theirs.loss_scale) < float(np.finfo(np.float32).tiny):
            assert ours.get_scale() == float(np.finfo(np.float32).tiny)  # ampscale stops there
            break
        assert float(theirs.loss_scale) == ours.get_scale()
        assert int(theirs.counter) == int(ours.state.growth_tracker)


@pytest.mark.parametrize("seed", range(8))
def test_flax_dynamic_scale_itself_gives_the_same_trajectory(seed: int) -> None:
    dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
    rng = np.random.default_rng(seed)
    flags = rng.random(200) < rng.choice([0.5, 0.9, 0.97])
    interval = int(rng.integers(0, 5))
    settings = {"growth_interval": interval}
    if seed >= 3:  # flax's other settings too, drawn at random
        settings["growth_factor"] = float(rng.choice([2.0, 1.5, 3.0, 1.1]))
        settings["backoff_factor"] = float(rng.choice([0.5, 0.25, 0.9]))
        settings["minimum_scale"] = [None, 1.0, 0.5, float(np.finfo(np.float32).tiny)][int(rng.integers(0, 4))]
    start = float(rng.choice([65536.0, 1.0, 3.0, 2.0**120]))
    theirs = dynamic_scale.DynamicScale(scale=start, **settings)
    ours = ampscale.create_scaler(
        backend="jax",
        preset="flax",
        init_scale=start,
        growth_interval=interval,
        **{k: v for k, v in settings.items() if k in ("growth_factor", "backoff_factor")},
        **({"min_scale": settings["minimum_scale"]} if "minimum_scale" in settings else {}),
    )

    @jax.jit
    def flax_step(ds, poison):
        ds, _finite, _, _ = ds.value_and_grad(lambda p: p * poison)(jnp.float32(1.0))
        return ds

    update = jax.jit(lambda s, f: s.update(f))
    for f in flags:
        theirs = flax_step(theirs, jnp.float32(1.0 if f else jnp.inf))
        ours = update(ours, jnp.bool_(f))
        assert float(theirs.scale) == ours.get_scale()
        assert int(theirs.fin_steps) == int(ours.state.growth_tracker)


# ------------------------------------------------------------------------------ floors, precision, semantics


def test_floor_reaction_under_jit() -> None:
    scaler = ampscale.create_scaler(backend="jax", init_scale=1.0, min_scale=1.0, on_floor="raise")
    with pytest.raises(Exception, match="floor"):
        jax.block_until_ready(jax.jit(lambda s: s.update(False))(scaler))
    events = []
    scaler = scaler.replace(on_floor=events.append)
    jax.block_until_ready(jax.jit(lambda s: s.update(False))(scaler))
    jax.effects_barrier()
    assert len(events) == 1
    assert events[0].scale == 1.0


def test_float64_presets_without_x64_use_float32_only_where_it_is_exact() -> None:
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is enabled")
    # power-of-two factors and bounds: the float32 trajectory is the float64 one
    scaler = ampscale.create_scaler(backend="jax", preset="deepspeed")
    assert scaler.state.scale.dtype == jnp.float32
    # a factor that is no power of two would round differently in float32: refused, saying so
    with pytest.raises(ValueError, match="scale_dtype='float32'"):
        ampscale.create_scaler(backend="jax", preset="deepspeed", growth_factor=3.0)
    scaler = ampscale.create_scaler(backend="jax", preset="deepspeed", growth_factor=3.0, scale_dtype="float32")
    assert scaler.state.scale.dtype == jnp.float32


def test_below_one_scale_flags_gradients_whose_unscaled_value_overflows() -> None:
    """Documented JAX semantics: the unscaled values are checked (identical for scale >= 1)."""
    scaler = ampscale.create_scaler(backend="jax", init_scale=0.5)
    grads, finite = scaler.unscale([jnp.array([60000.0], jnp.float16)])
    assert bool(np.isinf(np.asarray(grads[0], np.float32))[0])
    assert not bool(finite)
    scaler = ampscale.create_scaler(backend="jax", init_scale=1.0)
    grads, finite = scaler.unscale([jnp.array([65504.0], jnp.float16)])
    assert bool(finite)
