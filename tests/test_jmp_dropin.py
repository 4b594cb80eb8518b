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

import contextlib
import dataclasses
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
SETTINGS = [(2, 2), (3, 3), (5.0, 2.0), (4, 1)]
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
    """The same comparison with ``adjust`` jitted: the loss scale crosses the ``jit`` boundary,
    so on both sides its floor is the default one inside (jmp's pytree drops it)."""
    adjust = {m: jax.jit(lambda s, f: s.adjust(f)) for m in (jmp, ours)}
    for combination in itertools.product(SCALES, FLOORS[:2], COUNTERS, SETTINGS):
        scale, floor, counter, (period, factor) = combination
        theirs = _run(jmp, scale, floor, counter, period, factor, adjust)
        assert _run(ours, scale, floor, counter, period, factor, adjust) == theirs, combination


def _floor_sig(loss_scale) -> tuple:
    return _sig(loss_scale.min_loss_scale)


def test_the_pytree_is_jmps_tree_flatten_and_tree_unflatten_included(mp) -> None:
    """jmp's ``register_pytree_node_class``: the methods exist and give jmp's parts, the leaves
    and ``(period, factor)``; ``min_loss_scale`` is in neither, so an unflatten (a ``jit``
    argument, ``tree_map``) gives the default floor back, ``np.ones([], np.float32)``."""
    loss_scale = mp.DynamicLossScale(
        jnp.float32(1.0), jnp.int32(3), period=7, factor=3, min_loss_scale=jnp.float32(0.25)
    )
    assert float(loss_scale.adjust(jnp.bool_(False)).loss_scale) == np.float32(1 / 3)  # its own floor
    data, meta = loss_scale.tree_flatten()
    assert meta == (7, 3)
    assert _tree_sig(data) == _tree_sig((jnp.float32(1.0), jnp.int32(3)))
    rebuilt = mp.DynamicLossScale.tree_unflatten(meta, data)
    assert type(rebuilt) is mp.DynamicLossScale
    assert (rebuilt.period, rebuilt.factor) == (7, 3)
    for back in (rebuilt, jax.jit(lambda s: s)(loss_scale), jax.tree_util.tree_map(lambda x: x, loss_scale)):
        assert _floor_sig(back) == _sig(np.ones([], np.float32))
        assert float(back.adjust(jnp.bool_(False)).loss_scale) == 1.0  # the default floor
    # the floor is no part of the structure: different floors, equal structures (jit's cache key)
    structure = jax.tree_util.tree_structure
    assert structure(loss_scale) == structure(mp.DynamicLossScale(jnp.float32(1.0), period=7, factor=3))
    assert structure(mp.DynamicLossScale(jnp.float32(1.0))) == structure(
        mp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=np.float32(1))
    )
    assert structure(loss_scale) != structure(mp.DynamicLossScale(jnp.float32(1.0), period=8, factor=3))


def _built_inside_traces(mod) -> list:
    """The programs jmp runs with a ``min_loss_scale`` made inside a trace, or with two floors
    meeting in one pytree operation; each one's result (or its error)."""
    ls = mod.DynamicLossScale

    def step(s):
        return ls(s, min_loss_scale=jnp.asarray(1.0)).adjust(jnp.bool_(False))

    def floor_within(s):  # the floor is used inside the trace that made it
        return ls(s, min_loss_scale=jnp.asarray(6.0)).adjust(jnp.bool_(False)).loss_scale

    def initial_state(s):  # Haiku's idiom: the state built by jax.pmap
        return ls(s, min_loss_scale=jnp.asarray(0.5), period=3)

    def branches(flag):
        return jax.lax.cond(
            flag,
            lambda: ls(jnp.float32(2), min_loss_scale=jnp.float32(1)),
            lambda: ls(jnp.float32(4), min_loss_scale=jnp.float32(0.5)),
        )

    def traced_floor_in_scan(floors):
        def body(carry, floor):
            new = dataclasses.replace(carry, min_loss_scale=floor).adjust(jnp.bool_(False))
            return new, new.loss_scale

        return jax.lax.scan(body, ls(jnp.float32(8.0)), floors)

    programs = [
        lambda: jax.jit(step)(jnp.float32(8)),
        lambda: jax.jit(floor_within)(jnp.float32(8)),
        lambda: jax.pmap(initial_state)(jnp.full(1, 1024.0)),
        lambda: jax.jit(branches)(jnp.bool_(False)),
        lambda: jax.tree_util.tree_map(
            lambda a, b: a + b,
            ls(jnp.float32(2), min_loss_scale=jnp.float32(1)),
            ls(jnp.float32(4), min_loss_scale=jnp.float32(0.5)),
        ),
        lambda: jax.jit(traced_floor_in_scan)(jnp.asarray([3.0, 0.5, 2.0, 0.25], jnp.float32)),
    ]
    out = []
    for program in programs:
        try:
            result = program()
        except Exception as exc:  # compared with jmp's
            out.append((type(exc).__name__, str(exc).split("\n")[0]))
            continue
        out.append(_tree_sig(result))
        out.append(
            [
                _floor_sig(x)
                for x in jax.tree_util.tree_leaves(result, is_leaf=lambda x: isinstance(x, ls))
                if isinstance(x, ls)
            ]
        )
    return out


def test_a_floor_made_in_a_trace_or_two_floors_in_one_tree_op_behave_as_in_jmp() -> None:
    """``min_loss_scale`` made inside ``jit``, ``pmap`` (Haiku's ``initial_state``), ``lax.cond``
    branches and ``lax.scan`` (traced), and ``tree_map`` over two loss scales with different
    floors: the same results, dtypes and floors as jmp's (a traced floor applies inside its
    trace; what comes out of one has the default floor)."""
    theirs = _built_inside_traces(jmp)
    assert not any(isinstance(x, tuple) and x and x[0].endswith("Error") for x in theirs), theirs
    assert _built_inside_traces(ours) == theirs


def test_a_floor_of_zero_stops_at_float32s_smallest_normal_value() -> None:
    """The documented difference: with ``min_loss_scale=0`` jmp's scale is flushed to 0 (after
    which every step overflows); ampscale's stops at float32's smallest normal value."""
    theirs = jmp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.0))
    mine = ours.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(0.0))
    for i in range(130):
        theirs = theirs.adjust(jnp.bool_(False))
        mine = mine.adjust(jnp.bool_(False))
        if i < 125:
            assert _sig(mine.loss_scale) == _sig(theirs.loss_scale)
    assert float(theirs.loss_scale) == 0.0
    assert float(mine.loss_scale) == float(np.finfo(np.float32).tiny)


def test_a_traced_floor_that_is_nan_or_inf_never_makes_the_scale_nan_or_inf() -> None:
    """A concrete nan or infinite floor is refused at construction (below); a traced one is
    known only on the device: nan is ignored and inf stops at float32's largest value (jmp's
    scale becomes nan and inf)."""

    def backoff(floor):
        return ours.DynamicLossScale(jnp.float32(8.0), min_loss_scale=floor).adjust(jnp.bool_(False)).loss_scale

    def theirs(floor):
        return jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=floor).adjust(jnp.bool_(False)).loss_scale

    assert float(jax.jit(backoff)(jnp.float32(np.nan))) == 4.0
    assert float(jax.jit(backoff)(jnp.float32(np.inf))) == float(np.finfo(np.float32).max)
    assert np.isnan(float(jax.jit(theirs)(jnp.float32(np.nan))))
    assert np.isinf(float(jax.jit(theirs)(jnp.float32(np.inf))))


@pytest.mark.parametrize("make", ["construct", "jit", "tree_map", "adjust"])
@pytest.mark.parametrize("which", ["loss_scale", "min_loss_scale"])
def test_a_value_that_is_not_floating_warns_as_often_as_in_jmp(make: str, which: str) -> None:
    """jmp warns in ``__post_init__``, so at construction, at every unflatten (a ``jit``
    argument and result, ``tree_map``) and in every ``adjust``: the same warnings, as many."""

    def run(mod):
        kwargs = {"loss_scale": jnp.float32(4.0)}
        kwargs[which] = jnp.int32(4) if which == "loss_scale" else np.ones([], np.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_scale = mod.DynamicLossScale(**kwargs)
        with warnings.catch_warnings(record=True) as logged:
            warnings.simplefilter("always")
            if make == "construct":
                mod.DynamicLossScale(**kwargs)
            elif make == "jit":
                jax.jit(lambda s: s)(loss_scale)
            elif make == "tree_map":
                jax.tree_util.tree_map(lambda x: x, loss_scale)
            else:
                # jmp's select of an int scale and a float one raises, on both sides
                with contextlib.suppress(TypeError):
                    loss_scale.adjust(jnp.bool_(True))
        return [(w.category, str(w.message)) for w in logged]

    theirs = run(jmp)
    assert run(ours) == theirs
    if make != "adjust" and not (which == "min_loss_scale" and make in ("jit", "tree_map")):
        assert theirs  # it warns at all


@pytest.mark.parametrize("flag", [jnp.ones([2], bool), jnp.ones([1, 1], bool), np.ones([3], bool)])
def test_adjust_rejects_a_flag_that_is_not_a_scalar(mp, flag) -> None:
    """jmp's ``assert grads_finite.ndim == 0, "Expected boolean scalar"``, on both."""
    loss_scale = mp.DynamicLossScale(jnp.float32(8.0))
    with pytest.raises(AssertionError, match=r"^Expected boolean scalar"):
        loss_scale.adjust(flag)
    with pytest.raises(AssertionError, match=r"^Expected boolean scalar"):
        jax.jit(lambda s, f: s.adjust(f))(loss_scale, flag)


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
        ({"period": -2}, "period"),
        ({"period": 2.5}, "period"),
        ({"factor": 0.5}, "factor"),
        ({"factor": 0}, "factor"),
        ({"factor": float("inf")}, "factor"),
        ({"min_loss_scale": float("nan")}, "min_loss_scale"),
        ({"min_loss_scale": np.float32(np.inf)}, "min_loss_scale"),
    ],
)
def test_settings_under_which_jmps_arithmetic_breaks_are_named(kwargs: dict, name: str) -> None:
    """The documented differences: jmp takes these and then never grows (``period`` 0, below
    0 or a fraction), grows on every overflow (``factor`` below 1) or makes the scale nan or
    inf (a nan or infinite floor); ampscale names them, at construction and at unflatten."""
    with pytest.raises(ValueError, match=f"^{name} must be"):
        ours.DynamicLossScale(jnp.float32(1.0), **kwargs)
    if name != "min_loss_scale":
        jmp.DynamicLossScale(jnp.float32(1.0), **kwargs)  # jmp takes it


def test_a_factor_of_one_is_taken_as_jmp_takes_it() -> None:
    """``factor=1`` never moves the scale (jmp's ``scale * 1`` and ``scale / 1``) but still
    counts, and lifts the scale to a floor above it on an overflow: as jmp does."""
    steps = [True, True, False, True, True, True, True]
    cases = [
        (jnp.float32(8.0), None),
        (jnp.float16(8.0), jnp.float16(1.0)),
        (jnp.float16(8.0), None),  # jmp's TypeError: a float16 scale, a float32 floor
        (jnp.float32(0.5), jnp.float32(2.0)),
    ]
    for scale, floor in cases:
        out = []
        for mod in (jmp, ours):
            kwargs = {} if floor is None else {"min_loss_scale": floor}
            loss_scale = mod.DynamicLossScale(scale, period=3, factor=1, **kwargs)
            trajectory = []
            try:
                for finite in steps:
                    loss_scale = loss_scale.adjust(jnp.bool_(finite))
                    trajectory.append((_sig(loss_scale.loss_scale), _sig(loss_scale.counter)))
            except TypeError as exc:
                trajectory.append(str(exc).split("\n")[0])
            out.append(trajectory)
        assert out[0] == out[1]
        assert len(out[0]) == (1 if floor is None and scale.dtype == jnp.float16 else len(steps))


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
