"""``ampscale.jax``'s jmp drop-in, run side by side with jmp itself.

The first part checks every behaviour jmp's own ``loss_scale_test.py`` checks, each test run
against ``jmp`` and against ``ampscale.jax`` (the same assertions on both: the drop-in must
pass whatever jmp passes). The rest compares the two directly: results, dtypes, weak types and
errors for every combination of scale, floor, counter, period and factor dtypes, eagerly and
under ``jit``; trajectories under ``jit`` and ``lax.scan``; ``unscale`` bit for bit (through
ampscale's kernel); pytree leaves, paths and order; checkpoints moved both ways; and the two
documented differences (the floor survives a ``jit`` round trip; a floor of 0 stops at float32's
smallest normal value).
"""

from __future__ import annotations

import itertools
import os
import pickle
import typing
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jmp = pytest.importorskip("jmp")

import ampscale  # noqa: E402
import ampscale.jax as ours  # noqa: E402
from ampscale.backends import jax as jax_backend  # noqa: E402

IMPLEMENTATIONS = {"jmp": jmp, "ampscale": ours}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def mp(request):
    return IMPLEMENTATIONS[request.param]


def _sig(x) -> tuple:
    """Everything about a value that a program can observe: kind, dtype, weak type, bits."""
    if isinstance(x, jax.Array):
        aval = jax.typeof(x)
        return ("jax", str(aval.dtype), aval.weak_type, aval.shape, np.asarray(x).tobytes())
    if isinstance(x, (np.ndarray, np.generic)):
        return ("numpy", str(x.dtype), np.shape(x), np.asarray(x).tobytes())
    return (type(x).__name__, x)


def _tree_sig(tree) -> list:
    return [_sig(x) for x in jax.tree_util.tree_leaves(tree)]


def _values(tree) -> list:
    """The leaves' dtypes and bits, whatever holds them (a restore may give NumPy arrays)."""
    return [(np.asarray(x).dtype.name, np.asarray(x).tobytes()) for x in jax.tree_util.tree_leaves(tree)]


# ------------------------------------------------------------------------------ what jmp's own tests check


def test_no_op_loss_scale_returns_its_argument_itself(mp) -> None:
    loss_scale = mp.NoOpLossScale()
    tree = {"a": jnp.ones([])}
    assert loss_scale.scale(tree) is tree
    assert loss_scale.unscale(tree) is tree
    assert loss_scale.adjust(jnp.bool_(False)) is loss_scale
    assert loss_scale.loss_scale == 1


@pytest.mark.parametrize(
    ("kind", "scale"), [("StaticLossScale", s) for s in (2, 3, 4)] + [("DynamicLossScale", s) for s in (2.0, 3.0, 4.0)]
)
def test_scale_then_unscale_gives_the_tree_back(mp, kind: str, scale: float) -> None:
    loss_scale = getattr(mp, kind)(scale)
    tree = {"a": jnp.array(1.0)}
    scaled_tree = {"a": jnp.array(1.0 * scale)}
    assert loss_scale.scale(tree) == scaled_tree
    assert loss_scale.unscale(scaled_tree) == tree


@pytest.mark.parametrize("make", [lambda m: m.NoOpLossScale(), lambda m: m.StaticLossScale(0)])
def test_no_op_and_static_loss_scales_have_no_leaves(mp, make) -> None:
    assert jax.tree_util.tree_leaves(make(mp)) == []


def test_a_python_float_loss_scale_does_not_warn(mp) -> None:
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        mp.DynamicLossScale(2.0**15)
    assert logged == []


def test_the_leaves_are_the_scale_and_the_counter_and_tree_map_keeps_it_equal(mp) -> None:
    scale = jnp.ones([])
    counter = jnp.zeros([], jnp.int32)
    loss_scale = mp.DynamicLossScale(scale, counter, 2000, 2)
    assert jax.tree_util.tree_leaves(loss_scale) == [scale, counter]
    assert jax.tree_util.tree_map(lambda x: x, loss_scale) == loss_scale


@pytest.mark.parametrize(("period", "factor"), [(20, 2), (30, 3)])
def test_adjust_grows_on_the_period_th_finite_step_and_the_counter_wraps(mp, period: int, factor: int) -> None:
    grads_finite = jnp.bool_(True)
    loss_scale = mp.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
    for i in range(1, period):
        loss_scale = loss_scale.adjust(grads_finite)
        assert loss_scale.loss_scale == 10
        assert loss_scale.counter == i
        assert (loss_scale.period, loss_scale.factor) == (period, factor)
    loss_scale = loss_scale.adjust(grads_finite)
    assert loss_scale.loss_scale == 10 * factor
    assert loss_scale.counter == 0
    assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize(
    ("period", "factor", "floor"), [(20, 2, None), (30, 3, None), (20, 2, 0.3125), (30, 3, 0.37), (5.0, 2.0, 0.0)]
)
def test_adjust_backs_off_on_every_non_finite_step_down_to_the_floor(mp, period, factor, floor) -> None:
    grads_finite = jnp.bool_(False)
    init = np.float32(10)
    extra = () if floor is None else (jnp.asarray(floor),)
    loss_scale = mp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), period, factor, *extra)
    assert float(init) / factor**100 < 1  # the floor is reached
    for i in range(100):
        loss_scale = loss_scale.adjust(grads_finite)
        expected = max(1 if floor is None else floor, float(init) / factor ** (i + 1))
        np.testing.assert_allclose(loss_scale.loss_scale, expected, rtol=1e-5)
        assert loss_scale.counter == 0
        assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize("name", ["loss_scale", "min_loss_scale"])
def test_a_loss_scale_or_floor_that_is_not_floating_warns(mp, name: str) -> None:
    args = {"loss_scale": jnp.asarray(1, jnp.int32)} if name == "loss_scale" else {
        "loss_scale": jnp.asarray(1, jnp.float32), "min_loss_scale": jnp.asarray(1, jnp.int32)
    }  # fmt: skip
    with pytest.warns(UserWarning, match=f"Expected floating type for {name}"):
        mp.DynamicLossScale(**args)


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(mp, non_finite: float) -> None:
    assert mp.all_finite(None)
    assert mp.all_finite({})
    assert not mp.all_finite({"a": jnp.array(non_finite)})
    assert not mp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not mp.all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert mp.all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_select_tree(mp) -> None:
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert mp.select_tree(jnp.bool_(True), None, None) is None
    assert mp.select_tree(jnp.bool_(False), None, None) is None
    assert mp.select_tree(jnp.bool_(True), a, b) == a
    assert mp.select_tree(jnp.bool_(False), a, b) == b


def test_select_tree_rejects_a_predicate_that_is_not_a_boolean_scalar(mp) -> None:
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        mp.select_tree(jnp.ones([1]), None, None)


# ------------------------------------------------------------------------------ side by side


SCALES = [
    2.0**15,
    10.0,
    jnp.float32(2**15),
    jnp.float32(10),
    np.float32(3.0),
    jnp.float16(1024),
    jnp.bfloat16(1024),
    jnp.float16(40000),
    3,
]
FLOORS = [None, jnp.float16(1), np.float32(0.37), 0.5]
COUNTERS = [None, jnp.int32(1), 0, jnp.int32(-3)]
SETTINGS = [(2, 2), (3, 3), (5.0, 2.0)]
STEPS = [True, True, False, True, True, True, False, False]


def _run(mod, scale, floor, counter, period, factor, adjust):
    """A trajectory of ``STEPS``, then ``unscale`` and ``scale`` of a tree of mixed leaves;
    ``(kind, message)`` where it raises."""
    kwargs = {"period": period, "factor": factor}
    if floor is not None:
        kwargs["min_loss_scale"] = floor
    if counter is not None:
        kwargs["counter"] = counter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an int scale warns on both sides (tested above)
        return _trajectory(mod, scale, kwargs, adjust)


def _trajectory(mod, scale, kwargs, adjust):
    try:
        loss_scale = mod.DynamicLossScale(scale, **kwargs)
        out = []
        for finite in STEPS:
            loss_scale = adjust[mod](loss_scale, jnp.bool_(finite))
            out.append((_sig(loss_scale.loss_scale), _sig(loss_scale.counter)))
        tree = {
            "f16": jnp.full(3, 7.0, jnp.float16),
            "f32": jnp.full(2, 3.0, jnp.float32),
            "weak": jnp.full(2, 3.0),
            "python": 5,
            "int": jnp.arange(3),
            "bf16": jnp.full(2, -0.0, jnp.bfloat16),
        }
        out.append(_tree_sig(loss_scale.unscale(tree)))
        out.append(_tree_sig(loss_scale.scale(tree)))
        return out
    except Exception as exc:
        return (type(exc).__name__, str(exc).split("\n")[0])


def test_the_same_values_dtypes_weak_types_and_errors_as_jmp_eagerly() -> None:
    """Every combination of scale (Python, NumPy, JAX, float16, bfloat16, int), floor,
    counter, period and factor: the same trajectory, the same dtypes and weak types, the same
    unscaled and scaled trees, and the same error where jmp raises one (a float16 floor under a
    float32 scale, ...). A factor of 3 covers the rounding of a division that is not exact."""
    adjust = {m: (lambda s, f: s.adjust(f)) for m in (jmp, ours)}
    compared = 0
    for combination in itertools.product(SCALES, FLOORS, COUNTERS, SETTINGS):
        scale, floor, counter, (period, factor) = combination
        theirs = _run(jmp, scale, floor, counter, period, factor, adjust)
        assert _run(ours, scale, floor, counter, period, factor, adjust) == theirs, combination
        compared += isinstance(theirs, list)
    assert compared > 200  # most combinations run; the others raise on both sides


def test_the_same_values_dtypes_and_weak_types_as_jmp_under_jit() -> None:
    """The same comparison with ``adjust`` jitted (jmp drops ``min_loss_scale`` in a jit round
    trip, so the default floor only; the floor is compared in the test after this one)."""
    adjust = {m: jax.jit(lambda s, f: s.adjust(f)) for m in (jmp, ours)}
    for combination in itertools.product(SCALES, [None], COUNTERS, SETTINGS):
        scale, floor, counter, (period, factor) = combination
        theirs = _run(jmp, scale, floor, counter, period, factor, adjust)
        assert _run(ours, scale, floor, counter, period, factor, adjust) == theirs, combination


def test_min_loss_scale_survives_jit_where_jmps_resets_to_one() -> None:
    """The first documented difference: jmp's pytree drops ``min_loss_scale`` (a ``jit``
    argument comes back with the default of 1); ampscale's keeps it in the static structure."""
    identity = jax.jit(lambda s: s)
    theirs = identity(jmp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.25)))
    mine = identity(ours.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.25)))
    assert float(theirs.min_loss_scale) == 1.0
    assert float(theirs.adjust(jnp.bool_(False)).loss_scale) == 1.0
    assert float(mine.min_loss_scale) == 0.25
    assert float(mine.adjust(jnp.bool_(False)).loss_scale) == 0.5
    # the same object comes back, and equal structures compare equal (jit's cache key)
    assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(
        ours.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(0.25))
    )
    assert jax.tree_util.tree_structure(mine) != jax.tree_util.tree_structure(
        ours.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.5))
    )
    with pytest.raises(TypeError, match="min_loss_scale is part of the loss scale's static structure"):
        jax.jit(lambda m: ours.DynamicLossScale(jnp.float32(1.0), min_loss_scale=m))(jnp.float32(0.5))


def test_a_floor_of_zero_stops_at_float32s_smallest_normal_value() -> None:
    """The second documented difference: with ``min_loss_scale=0`` jmp's scale is flushed to 0
    (after which every step overflows); ampscale's stops at float32's smallest normal value."""
    theirs = jmp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.0))
    mine = ours.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.0))
    step = jax.jit(lambda s: s.adjust(jnp.bool_(False)))  # jmp's eagerly: its jit drops the floor
    for i in range(130):
        theirs = theirs.adjust(jnp.bool_(False))
        mine = step(mine)
        if i < 125:
            assert _sig(mine.loss_scale) == _sig(theirs.loss_scale)
    assert float(theirs.loss_scale) == 0.0
    assert float(mine.loss_scale) == float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize("factor", [2, 3])
def test_random_trajectories_under_jit_and_scan_match_jmp_bit_for_bit(factor: int) -> None:
    rng = np.random.default_rng(factor)
    finite = jnp.asarray(rng.random(400) < 0.9)

    def run(mod):
        def body(loss_scale, f):
            loss_scale = loss_scale.adjust(f)
            return loss_scale, (loss_scale.loss_scale, loss_scale.counter)

        start = mod.DynamicLossScale(jnp.float32(2.0**15), period=5, factor=factor)
        final, trajectory = jax.jit(lambda s, f: jax.lax.scan(body, s, f))(start, finite)
        return _tree_sig((final, trajectory))

    assert run(ours) == run(jmp)


def test_unscale_runs_ampscales_check_and_unscale_and_gives_jmps_bits() -> None:
    """With a float32 scale the floating leaves go through the backend's check + unscale (the
    custom call, where the results are returned), float16 and bfloat16 ones promoted to float32
    as jmp's multiply promotes them: the same bits (specials, signed zeros, NaN payloads) and
    dtypes as jmp's, eagerly and under ``jit``; other leaves as jmp multiplies them."""
    rng = np.random.default_rng(0)
    specials = [np.inf, -np.inf, np.nan, -0.0, 0.0, 65504.0, 6e-8]
    tree = {}
    for dtype in (np.float16, jnp.bfloat16, np.float32):
        values = (rng.standard_normal(300) * 2.0 ** rng.integers(-12, 12, 300)).astype(np.float32)
        values[:7] = specials
        tree[np.dtype(dtype).name] = jnp.asarray(values.astype(dtype))
    tree["int"] = jnp.arange(4)
    for scale in (2.0**15, 3.0, 2.0**-3):
        theirs = jmp.DynamicLossScale(jnp.float32(scale))
        mine = ours.DynamicLossScale(jnp.float32(scale))
        assert _tree_sig(mine.unscale(tree)) == _tree_sig(theirs.unscale(tree))
        jitted = jax.jit(lambda s, t: s.unscale(t))
        assert _tree_sig(jitted(mine, tree)) == _tree_sig(jitted(theirs, tree))
    status = jax_backend.custom_call_status()
    if status.active:  # the returned leaves were unscaled by ampscale's kernel
        assert status.last_lowering == "custom call"


def test_pytree_leaves_paths_and_order_are_jmps() -> None:
    theirs = jmp.DynamicLossScale(jnp.float32(1024.0), jnp.int32(3), period=7)
    mine = ours.DynamicLossScale(jnp.float32(1024.0), jnp.int32(3), period=7)
    their_paths, _ = jax.tree_util.tree_flatten_with_path({"ls": theirs})
    my_paths, _ = jax.tree_util.tree_flatten_with_path({"ls": mine})
    assert [p for p, _ in my_paths] == [p for p, _ in their_paths]
    assert [jax.tree_util.keystr(p) for p, _ in my_paths] == ["['ls'][<flat index 0>]", "['ls'][<flat index 1>]"]
    assert _tree_sig(mine) == _tree_sig(theirs)
    for kind in ("NoOpLossScale", "StaticLossScale"):
        made = getattr(ours, kind)() if kind == "NoOpLossScale" else ours.StaticLossScale(jnp.float32(4))
        assert jax.tree_util.tree_flatten_with_path(made)[0] == []


def _haiku_style_state(mod, steps_done: int):
    """A train state of the shape Haiku programs keep: params, optimizer state, loss scale."""
    import optax

    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
    optimizer = optax.adam(1e-2)
    return {
        "params": params,
        "opt": optimizer.init(params),
        "loss_scale": mod.DynamicLossScale(jnp.float32(2.0**15), period=3),
    }, optimizer


def _train(mod, state, optimizer, poison):
    import optax

    def step(state, p):
        loss_scale = state["loss_scale"]

        def loss_fn(params):
            return loss_scale.scale(jnp.sum(jnp.tanh(params["w"]) ** 2) * p + jnp.sum(params["b"] ** 2))

        grads = loss_scale.unscale(jax.grad(loss_fn)(state["params"]))
        finite = mod.all_finite(grads)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        params, opt = mod.select_tree(finite, (params, opt), (state["params"], state["opt"]))
        return {"params": params, "opt": opt, "loss_scale": loss_scale.adjust(finite)}, loss_scale.loss_scale

    return jax.jit(lambda s, ps: jax.lax.scan(step, s, ps))(state, poison)


@pytest.mark.parametrize(("source", "target"), [("jmp", "ampscale"), ("ampscale", "jmp")])
def test_a_checkpoint_restores_into_the_other_and_training_resumes_bit_for_bit(
    tmp_path, source: str, target: str
) -> None:
    """A state saved by one (its leaves, in a ``.npz`` file, the way Haiku programs checkpoint
    with ``jax.tree_util.tree_leaves``) is restored into the other's template with
    ``tree_unflatten``; the resumed run equals the uninterrupted one, bit for bit (scales,
    counters, parameters, Adam's state)."""
    poison = jnp.asarray(np.where(np.arange(24) % 7 == 3, np.float32(np.inf), np.float32(1.0)))
    src, dst = IMPLEMENTATIONS[source], IMPLEMENTATIONS[target]
    state, optimizer = _haiku_style_state(src, 0)
    middle, first_scales = _train(src, state, optimizer, poison[:12])
    path = os.path.join(tmp_path, "ckpt.npz")
    np.savez(path, *[np.asarray(x) for x in jax.tree_util.tree_leaves(middle)])
    template, _ = _haiku_style_state(dst, 0)
    with np.load(path) as saved:
        leaves = [jnp.asarray(saved[f"arr_{i}"]) for i in range(len(saved.files))]
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
    assert type(restored["loss_scale"]) is dst.DynamicLossScale
    resumed, resumed_scales = _train(dst, restored, optimizer, poison[12:])
    straight, straight_scales = _train(src, state, optimizer, poison)
    assert _tree_sig(resumed) == _tree_sig(straight)
    assert (
        np.asarray(straight_scales).tobytes() == np.asarray(jnp.concatenate([first_scales, resumed_scales])).tobytes()
    )
    assert len(set(np.asarray(straight_scales).tolist())) > 2  # the scale moved both ways


def test_orbax_and_flax_serialization_take_the_drop_in(tmp_path) -> None:
    """jmp's own class cannot be saved by orbax (its ``__post_init__`` rejects orbax's
    placeholder leaves) nor by ``flax.serialization.to_bytes``; the drop-in can, and its saved
    leaves restore into a state holding jmp's class."""
    ocp = pytest.importorskip("orbax.checkpoint")
    serialization = pytest.importorskip("flax.serialization")

    state = {"w": jnp.ones(3), "ls": ours.DynamicLossScale(jnp.float32(1024.0), jnp.int32(5), period=9)}
    for checkpointer in (ocp.PyTreeCheckpointer(), ocp.StandardCheckpointer()):
        where = os.path.join(tmp_path, type(checkpointer).__name__)
        checkpointer.save(where, state)
        if hasattr(checkpointer, "wait_until_finished"):
            checkpointer.wait_until_finished()
        template = {"w": jnp.zeros(3), "ls": ours.DynamicLossScale(jnp.float32(1.0), period=9)}
        restored = (
            checkpointer.restore(where, template)
            if isinstance(checkpointer, ocp.StandardCheckpointer)
            else checkpointer.restore(where, item=template)
        )
        assert type(restored["ls"]) is ours.DynamicLossScale
        assert _values(restored) == _values(state)
        raw = ocp.PyTreeCheckpointer().restore(where)  # no template: the leaves by their paths
        into_jmp = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure({"w": 0, "ls": jmp.DynamicLossScale(jnp.float32(1.0), period=9)}),
            [raw["ls"][0], raw["ls"][1], raw["w"]],  # jax sorts the dict's keys: "ls" < "w"
        )
        assert float(into_jmp["ls"].loss_scale) == 1024.0
        assert int(into_jmp["ls"].counter) == 5
    with pytest.raises(Exception):  # noqa: B017 - jmp's own class: msgpack cannot encode it
        serialization.to_bytes({"ls": jmp.DynamicLossScale(jnp.float32(1024.0))})
    data = serialization.to_bytes(state)
    assert serialization.to_state_dict(state)["ls"].keys() == {"loss_scale", "counter"}
    template = {"w": jnp.zeros(3), "ls": ours.DynamicLossScale(jnp.float32(1.0), period=9)}
    assert _values(serialization.from_bytes(template, data)) == _values(state)
    assert pickle.loads(pickle.dumps(state["ls"])) == state["ls"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"period": 0}, "period"),
        ({"period": 2.5}, "period"),
        ({"factor": 1}, "factor"),
        ({"factor": float("inf")}, "factor"),
    ],
)
def test_a_period_or_factor_out_of_range_is_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be"):
        ours.DynamicLossScale(jnp.float32(1.0), **kwargs)


def test_one_import_line_ports_a_jmp_program_policies_included() -> None:
    """``import ampscale.jax as jmp``: the loss scales are ampscale's, the precision policies
    jmp's own."""
    for name in ("get_policy", "Policy", "cast_to_full", "cast_to_half", "half_dtype"):
        assert getattr(ours, name) is getattr(jmp, name)
    policy = ours.get_policy("params=float32,compute=float16,output=float32")
    assert policy.cast_to_compute(jnp.ones(2)).dtype == jnp.float16
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ours.nothing
    assert typing.get_args(ours.LossScale) == (ours.NoOpLossScale, ours.StaticLossScale, ours.DynamicLossScale)


def test_the_scaler_underneath_is_the_jmp_preset() -> None:
    """``adjust`` is the jmp preset's transition: the trajectory of ``create_scaler(preset="jmp")``
    with the same settings, step for step."""
    rng = np.random.default_rng(5)
    finite = rng.random(300) < 0.85
    loss_scale = ours.DynamicLossScale(jnp.float32(2.0**10), period=4, factor=2)
    scaler = ampscale.create_scaler(backend="jax", preset="jmp", init_scale=2.0**10, growth_interval=4)
    for f in finite:
        loss_scale = loss_scale.adjust(jnp.bool_(f))
        scaler = scaler.update(jnp.bool_(f))
        assert float(loss_scale.loss_scale) == scaler.get_scale()
        assert int(loss_scale.counter) == int(scaler.state.growth_tracker)
