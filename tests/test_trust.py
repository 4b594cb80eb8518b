"""Trust: the behaviours a hostile review found (issue 14), and a test per class behind them.

Classes, each with a property or table test of its own: what ``finite`` means, aliasing,
validate-before-mutate, per-thread and keyed caches, value ranges after rounding, checkpoint
validation, import-order independence. ``docs/reliability.md`` states the rules.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ampscale
from ampscale._config import FLOAT32_MAX, FLOAT32_TINY, PRESETS
from tests.conftest import FRAMEWORKS, Framework, without_native_numpy_kernel

CPU = [f for f in FRAMEWORKS if not f.gpu]
IN_PLACE = [f for f in CPU if f.in_place]  # numpy, torch: the backends that write gradients
CHEAP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

torch_only = pytest.mark.skipif(not any(f.name == "torch" for f in CPU), reason="torch not installed")
jax_only = pytest.mark.skipif(not any(f.name == "jax" for f in CPU), reason="jax not installed")


def _bits(fw: Framework, leaf: Any) -> bytes:
    return np.asarray(fw.to_numpy(leaf)).tobytes()


# ------------------------------------------------------------ 1. finite means every unscaled value is finite


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_finite_means_every_unscaled_value_is_finite(fw: Framework) -> None:
    """A scale below 1 (the torch preset gets there after 17 overflows in a row): a finite
    gradient whose unscaled value overflows makes the step non-finite, on every backend."""
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=0.125)
    for dtype, big in (("float16", 60000.0), ("float32", 3e38)):
        if dtype not in fw.dtypes:
            continue
        grads = [fw.array([1.0, 2.0], dtype), fw.array([big, 1.0], dtype)]
        _, finite = scaler.unscale(grads)
        assert not bool(finite), dtype
        _, finite = scaler.unscale([fw.array([1.0, 2.0], dtype)])
        assert bool(finite), dtype
    # step() applies nothing then: the update function never sees an inf
    params = [fw.array([1.0], "float32")]
    grads = [fw.array([3e38], "float32")]
    new_params, _, after = scaler.step(
        lambda p, g, o: ([x - y for x, y in zip(p, g, strict=True)], o), params, grads, ()
    )
    assert not bool(after.outcome.applied)
    assert np.isfinite(np.asarray(fw.to_numpy(new_params[0]))).all()


@torch_only
def test_torch_checks_the_values_written_on_every_path() -> None:
    """One group, mixed dtypes (several groups) and the threaded split of long CPU lists."""
    import torch

    scaler = ampscale.create_scaler(backend="torch", init_scale=0.125)
    many = [torch.ones(64) for _ in range(600)]
    many[-1][5] = 3e38
    assert not bool(scaler.unscale(many)[1])
    mixed = [torch.ones(3, dtype=torch.float16), torch.tensor([60000.0], dtype=torch.float16), torch.ones(2)]
    assert not bool(scaler.unscale(mixed)[1])
    fine = [torch.ones(64) for _ in range(600)]
    assert bool(scaler.unscale(fine)[1])


@torch_only
def test_a_device_scale_is_checked_on_outputs_unless_a_host_bound_says_it_is_at_least_one() -> None:
    """On a device the scale is not read: a lower bound kept on the host decides (CUDA itself
    is not available here; the rule is tested where it is made)."""
    import torch

    from ampscale.backends import torch as backend

    inverse = torch.tensor(0.5)
    assert backend._may_overflow(inverse, None) is True  # unknown: check the values written
    assert backend._may_overflow(inverse, 0.5) is True
    assert backend._may_overflow(inverse, 1.0) is False
    assert backend._may_overflow(0.5, None) is False  # a host inverse is known
    assert backend._may_overflow(2.0, None) is True
    assert backend._may_overflow(math.inf, None) is True


@jax_only
def test_the_scalers_host_bound_of_a_device_scale_is_a_true_lower_bound() -> None:
    """JAX keeps its state on the device like torch on CUDA: the bound the scaler keeps on the
    host falls by one backoff per update, is never above the scale, and is exact after a read."""
    rng = np.random.default_rng(3)
    for preset in ("torch", "megatron", "jmp"):
        scaler = ampscale.create_scaler(backend="jax", preset=preset, init_scale=8.0, growth_interval=1)
        assert scaler._floor_hint() == 8.0
        for finite in rng.random(40) < 0.4:
            scaler = scaler.update(bool(finite))
            bound = scaler._floor_hint()
            assert bound is not None
            assert bound <= float(np.asarray(scaler.state.scale))
        exact = scaler.get_scale()
        assert scaler._floor_hint() == exact


# ------------------------------------------------------------ 2. aliasing: each memory location once


def _views(fw: Framework, base: Any, spec: tuple[int, int, int]) -> Any:
    start, stop, step = spec
    return base[start:stop:step]


#: the in-place backends, and NumPy without its native kernel (which finds aliasing in C itself)
ALIASING = [pytest.param(f, True, id=f.name) for f in IN_PLACE] + [
    pytest.param(f, False, id=f"{f.name}-without-kernel") for f in IN_PLACE if f.name == "numpy"
]


@pytest.mark.parametrize(("fw", "native"), ALIASING)
def test_aliasing_table(fw: Framework, native: bool) -> None:
    with without_native_numpy_kernel(not native):
        _aliasing_table(fw)


def _aliasing_table(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=4.0)

    def fresh() -> Any:
        return fw.array(np.arange(1, 13, dtype=np.float64), "float32")

    # the same object twice: unscaled once, returned in both places
    g = fresh()
    out, finite = scaler.unscale({"a": g, "b": g})
    assert bool(finite)
    assert out["a"] is out["b"] is g
    np.testing.assert_array_equal(fw.to_numpy(g), np.arange(1, 13) / 4)
    # two views of exactly the same elements: once
    g = fresh()
    scaler.unscale([g, g.reshape(3, 4), g[:]])
    np.testing.assert_array_equal(fw.to_numpy(g), np.arange(1, 13) / 4)
    # interleaved views share no element: each unscaled once
    g = fresh()
    scaler.unscale([g[::2], g[1::2]])
    np.testing.assert_array_equal(fw.to_numpy(g), np.arange(1, 13) / 4)
    refused = {
        "overlap": lambda g: [g, g[2:]],
        "overlap, reversed order": lambda g: [g[2:], g],
        "overlapping strided views": lambda g: [g[::2], g[::3]],
        "overlap among others": lambda g: [fresh(), g[:6], fresh(), g[5:]],
        "overlap across dtypes": lambda g: [fw.array([1.0], "float16"), g[:4], g[3:]],
    }
    for name, make in refused.items():
        g = fresh()
        before = _bits(fw, g)
        with pytest.raises(ampscale.AliasedGradientsError, match="share memory"):
            scaler.unscale(make(g))
        assert _bits(fw, g) == before, name


@pytest.mark.parametrize(("fw", "native"), ALIASING)
@CHEAP
@given(specs=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12), st.integers(1, 4)), min_size=1, max_size=5))
def test_aliasing_property_every_element_once_or_refused_untouched(fw: Framework, native: bool, specs: list) -> None:
    """Any set of slices of one buffer: either each element is unscaled exactly once, or the
    call is refused (slices that share some but not all elements) and nothing changed."""
    with without_native_numpy_kernel(not native):
        _every_element_once_or_refused_untouched(fw, specs)


def _every_element_once_or_refused_untouched(fw: Framework, specs: list) -> None:
    base_values = np.arange(1, 13, dtype=np.float64)
    base = fw.array(base_values, "float32")
    sets = []
    for start, stop, step in specs:
        sets.append(frozenset(range(12)[start:stop:step]))
    nonempty = [s for s in sets if s]
    conflict = any(a != b and a & b for i, a in enumerate(nonempty) for b in nonempty[i + 1 :])
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=2.0)
    tree = [_views(fw, base, spec) for spec in specs]
    if conflict:
        with pytest.raises(ampscale.AliasedGradientsError):
            scaler.unscale(tree)
        np.testing.assert_array_equal(fw.to_numpy(base), base_values)
        return
    scaler.unscale(tree)
    touched = frozenset().union(*sets)
    expected = np.array([v / 2 if i in touched else v for i, v in enumerate(base_values)])
    np.testing.assert_array_equal(fw.to_numpy(base), expected)


@pytest.mark.parametrize("short", [True, False], ids=["short list", "long list"])
@CHEAP
@given(
    specs=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12), st.integers(1, 4)), min_size=1, max_size=4),
    where=st.integers(0, 400),
    empty=st.booleans(),
)
@example(specs=[(0, 6, 1), (5, 12, 1)], where=7, empty=True)  # one element shared: refused
@example(specs=[(0, 6, 1), (6, 12, 1)], where=3, empty=False)  # touching, not sharing: once each
@example(specs=[(0, 12, 1), (0, 12, 1), (4, 5, 1)], where=0, empty=True)  # a repeat, and a part of it
def test_torch_shared_memory_check_is_the_same_for_short_and_long_lists(
    short: bool, specs: list, where: int, empty: bool
) -> None:
    """The torch backend checks lists of up to ``_SMALL_LIST`` tensors in plain Python and
    longer ones with NumPy: slices of one buffer, put among 300 unrelated tensors (and an
    empty one), are unscaled once each or refused untouched, whichever way is taken."""
    torch = pytest.importorskip("torch")
    import ampscale.backends._torch_overlap as torch_overlap

    others = [torch.full((3,), 8.0) for _ in range(300 if not short else 20)]
    if empty:
        others.append(torch.empty(0))
    base = torch.arange(1, 13, dtype=torch.float32)
    views = [base[start:stop:step] for start, stop, step in specs]
    where %= len(others) + 1
    tree = others[:where] + views + others[where:]
    sets = [frozenset(range(12)[start:stop:step]) for start, stop, step in specs]
    nonempty = [s for s in sets if s]
    conflict = any(a != b and a & b for i, a in enumerate(nonempty) for b in nonempty[i + 1 :])
    assert (len(tree) <= torch_overlap._SMALL_LIST) == short
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    if conflict:
        with pytest.raises(ampscale.AliasedGradientsError):
            scaler.unscale(tree)
        assert torch.equal(base, torch.arange(1, 13, dtype=torch.float32))
        assert all(torch.equal(t, torch.full((3,), 8.0)) for t in others if t.numel() == 3)
        return
    scaler.unscale(tree)
    touched = frozenset().union(*sets)
    expected = [v / 2 if i in touched else float(v) for i, v in enumerate(range(1, 13))]
    assert base.tolist() == expected
    assert all(t.tolist() == [4.0] * 3 for t in others if t.numel() == 3)


def test_numpy_same_bytes_as_two_dtypes_or_read_only_beside_writable_are_refused() -> None:
    scaler = ampscale.create_scaler(init_scale=2.0)
    g = np.ones(8, np.float32)
    with pytest.raises(ampscale.AliasedGradientsError):
        scaler.unscale([g, g.view(np.float16)])
    view = g[:]
    view.setflags(write=False)
    with pytest.raises(ampscale.AliasedGradientsError):
        scaler.unscale([g, view])
    np.testing.assert_array_equal(g, np.ones(8, np.float32))


# ------------------------------------------------------------ 3. every refusal before the first byte changes


def _refusals(fw: Framework) -> list[tuple[str, Any, type[BaseException]]]:
    """(name, the bad last leaf, the error): each comes after good leaves in the tree."""
    cases: list[tuple[str, Any, type[BaseException]]] = [
        ("integer gradient", fw.array([1, 2], "int32"), TypeError),
        ("boolean gradient", fw.array([True], "bool"), TypeError),
        ("a Python number", 3.0, TypeError),
    ]
    if fw.name == "numpy":
        holder = np.ones(4, np.float32)
        cases.append(
            (
                "stride 0, writable",
                np.lib.stride_tricks.as_strided(holder, shape=(4,), strides=(0,), writeable=True),
                ampscale.AliasedGradientsError,
            )
        )
    if fw.name == "torch":
        import torch

        cases += [
            ("stride 0 (autograd.grad of a broadcast bias)", torch.ones(1).expand(5), ampscale.AliasedGradientsError),
            ("float8", torch.ones(3).to(torch.float8_e4m3fn), TypeError),
            ("complex", torch.ones(3, dtype=torch.complex64), TypeError),
        ]
        bad = torch.sparse_coo_tensor(
            [[0, 0]], torch.tensor([1.0, 2.0], dtype=torch.float16), (3,), check_invariants=True
        )
        from ampscale.backends.torch import UncoalescedSparseError

        cases.append(("uncoalesced float16 sparse", bad, UncoalescedSparseError))
    return cases


@pytest.mark.parametrize("fw", IN_PLACE, ids=[f.name for f in IN_PLACE])
@pytest.mark.parametrize("count", [2, 300])  # one group; a list long enough for torch's CPU split
def test_validate_before_mutate_table(fw: Framework, count: int) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=4.0)
    for name, bad, error in _refusals(fw):
        good = [fw.array(np.full(8, 8.0), "float32") for _ in range(count)]
        with pytest.raises(error):
            scaler.unscale([*good, bad])
        for leaf in good:
            np.testing.assert_array_equal(fw.to_numpy(leaf), np.full(8, 8.0, np.float32), err_msg=name)
        with pytest.raises(error):
            scaler.step(lambda p, g, o: (p, o), [], {"g": [*good, bad]}, ())
        np.testing.assert_array_equal(fw.to_numpy(good[0]), np.full(8, 8.0, np.float32), err_msg=name)


@torch_only
def test_check_only_calls_read_tensors_that_overlap_themselves() -> None:
    import torch

    assert bool(ampscale.all_finite([torch.ones(1).expand(4)]))
    assert not bool(ampscale.all_finite([torch.tensor([math.inf]).expand(4)]))


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_an_update_fn_that_raises_says_what_state_the_gradients_are_in(fw: Framework) -> None:
    """Where arrays can be written, a new ``update_fn`` first runs once on copies: raising
    there, nothing has changed. Raising on a real call, the gradients had been unscaled (in
    place where the backend does that) and the note says so. The scaler is never updated."""
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=4.0)
    grads = [fw.array([8.0], "float32")]
    checked_on_copies = fw.name != "jax"  # JAX arrays cannot be written: no check

    def broken(params: Any, grads: Any, opt_state: Any) -> Any:
        raise RuntimeError("optimizer bug")

    with pytest.raises(RuntimeError, match="optimizer bug") as info:
        scaler.step(broken, [fw.array([1.0], "float32")], grads, ())
    notes = " ".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert ("nothing was changed" if checked_on_copies else "unchanged") in notes
    assert float(np.asarray(fw.to_numpy(grads[0]))[0]) == 8.0

    calls = []

    def broken_on_its_real_call(params: Any, grads: Any, opt_state: Any) -> Any:
        calls.append(1)
        if len(calls) > int(checked_on_copies):
            raise RuntimeError("optimizer bug")
        return [p * 1 for p in params], opt_state

    with pytest.raises(RuntimeError, match="optimizer bug") as info:
        scaler.step(broken_on_its_real_call, [fw.array([1.0], "float32")], grads, ())
    notes = " ".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert ("already been unscaled in place" if fw.in_place else "unchanged") in notes
    expected = 2.0 if fw.in_place else 8.0
    assert float(np.asarray(fw.to_numpy(grads[0]))[0]) == expected
    assert scaler.get_stats()["steps"] == 0  # the scaler was not updated


# ------------------------------------------------------------ 4. caches keyed by something ambiguous


@torch_only
def test_one_meta_call_does_not_poison_the_thread() -> None:
    import torch

    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    seen: list[Any] = []

    def fresh_thread() -> None:  # its per-thread caches start empty
        try:
            scaler.unscale([torch.ones(3, device="meta")])
        except ValueError as exc:  # a meta tensor has no values: refused (issue 24)
            seen.append("meta tensor" in str(exc))
        grads, finite = scaler.unscale([torch.full((3,), 4.0)])
        seen.extend([finite.device.type, bool(finite), grads[0].tolist()])

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen == [True, "cpu", True, [2.0, 2.0, 2.0]]


@torch_only
@CHEAP
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["cpu", "meta"]), st.sampled_from(["float32", "float16"]), st.booleans()), max_size=12
    )
)
def test_cache_property_interleaved_devices_dtypes_and_threads(calls: list) -> None:
    """Any interleaving of devices, dtypes and threads: CPU results are always exact and the
    flag is always on the gradients' own device."""
    import torch

    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    failures: list[str] = []

    def one(device: str, dtype: str) -> None:
        grads = [torch.full((5,), 4.0, dtype=getattr(torch, dtype), device=device) for _ in range(2)]
        if device == "meta":  # no values: refused, and nothing cached for the next call
            try:
                scaler.unscale(grads)
            except ValueError:
                return
            failures.append("a meta tensor was not refused")
            return
        out, finite = scaler.unscale(grads)
        if finite.device.type != device:
            failures.append(f"flag on {finite.device} for {device}")
        if device == "cpu" and (not bool(finite) or out[0].tolist() != [2.0] * 5):
            failures.append(f"cpu result {out[0].tolist()} {bool(finite)}")

    for device, dtype, in_thread in calls:
        if in_thread:
            worker = threading.Thread(target=one, args=(device, dtype))
            worker.start()
            worker.join()
        else:
            one(device, dtype)
    assert not failures, failures


def test_namespace_backends_are_keyed_by_the_namespace_itself() -> None:
    xp = pytest.importorskip("array_api_strict")
    from ampscale.backends import _namespaces, get_backend

    backend = get_backend(xp)
    assert get_backend(xp) is backend
    assert _namespaces[xp] is backend
    assert all(not isinstance(key, int) for key in _namespaces)


# ------------------------------------------------------------ 5. a non-finite loss is an overflow


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_update_true_with_a_non_finite_loss_is_an_overflow(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=8.0)
    after = scaler.update(True, loss_finite=False)
    stats = after.get_stats()
    assert stats["scale"] == 4.0
    assert (stats["skipped_steps"], stats["loss_overflows"], stats["grad_overflows"]) == (1, 1, 0)
    assert stats["last_step"] == "loss"
    assert not bool(after.outcome.applied)


# ------------------------------------------------------------ 6. the scale is never 0, inf or nan


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_long_nan_storm_never_kills_training(preset: str) -> None:
    events: list[Any] = []
    scaler = ampscale.create_scaler(preset=preset, on_floor=events.append)
    grads = [np.ones(4, np.float32)]
    for _ in range(1200):
        scaler = scaler.update(False)
        grads[0][:] = 1.0
        scaler.unscale(grads)  # no ZeroDivisionError, ever
    scale = scaler.get_scale()
    low = scaler.config.min_value
    assert scale == low > 0
    assert math.isfinite(1.0 / scale)
    assert events
    assert events[-1].scale == low


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_the_bottom_and_the_top_on_every_backend(fw: Framework) -> None:
    bottom = ampscale.create_scaler(backend=fw.backend, init_scale=2.0**-120)
    top = ampscale.create_scaler(backend=fw.backend, preset="keras", init_scale=2.0**120, growth_interval=1)
    for _ in range(20):
        bottom = bottom.update(False)
        top = top.update(True)
    assert bottom.get_scale() == FLOAT32_TINY
    assert bottom.get_stats()["floor_overflows"] > 0
    assert top.get_scale() == FLOAT32_MAX


@torch_only
def test_grad_scaler_survives_a_long_storm() -> None:
    import torch

    from ampscale.torch import GradScaler

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    for _ in range(200):
        optimizer.zero_grad()
        loss = model(torch.ones(1, 2)).sum() * math.nan
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == FLOAT32_TINY


def test_host_and_array_operations_agree_bit_for_bit_at_the_edges() -> None:
    xp = pytest.importorskip("array_api_strict")
    for preset in sorted(PRESETS):
        defaults = PRESETS[preset].defaults
        for edge, finite in ((2.0**-124, False), (2.0**125, True)):
            kwargs = {"growth_interval": 0} if preset == "flax" else {"growth_interval": 1, "hysteresis": 1}
            kwargs["on_floor"] = "ignore"
            init = min(max(edge, defaults["min_scale"] or 0.0), defaults["max_scale"] or math.inf)
            host = ampscale.create_scaler(backend="numpy", preset=preset, init_scale=init, **kwargs)
            array = ampscale.create_scaler(backend=xp, preset=preset, init_scale=init, **kwargs)
            for _ in range(8):
                host = host.update(finite)
                array = array.update(xp.asarray(finite))
                assert host.get_scale() == array.get_scale(), (preset, init)


# ------------------------------------------------------------ 7. checkpoints: every value, nothing half-loaded


def _bad_dicts() -> list[tuple[str, Any, str]]:
    good = ampscale.create_scaler(init_scale=1024.0).update(True).state_dict()

    def edit(path: str, value: Any) -> dict:
        d = json.loads(json.dumps(good))
        node = d
        *parents, last = path.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
        if path == "ampscale.state.scale" and isinstance(value, (int, float)):
            d["scale"] = value  # torch's copy says the same
        return d

    def drop(path: str) -> dict:
        d = json.loads(json.dumps(good))
        node = d
        *parents, last = path.split(".")
        for key in parents:
            node = node[key]
        del node[last]
        return d

    torch_dict = {
        k: good[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    }
    return [
        ("scale inf", edit("ampscale.state.scale", math.inf), "ampscale.state.scale"),
        ("scale 0", edit("ampscale.state.scale", 0.0), "ampscale.state.scale"),
        ("scale nan", edit("ampscale.state.scale", math.nan), "ampscale.state.scale"),
        ("scale negative", edit("ampscale.state.scale", -1.0), "ampscale.state.scale"),
        ("scale past float32", edit("ampscale.state.scale", 1e39), "ampscale.state.scale"),
        ("scale subnormal", edit("ampscale.state.scale", 1e-40), "ampscale.state.scale"),
        ("scale a string", edit("ampscale.state.scale", "1024"), "ampscale.state.scale"),
        ("scale a bool", edit("ampscale.state.scale", True), "ampscale.state.scale"),
        ("last_scale inf", edit("ampscale.state.last_scale", math.inf), "last_scale"),
        ("last_reason 7", edit("ampscale.state.last_reason", 7), "last_reason"),
        ("last_reason a float", edit("ampscale.state.last_reason", 0.0), "last_reason"),
        ("negative steps", edit("ampscale.state.steps", -1), "steps"),
        ("steps past int32", edit("ampscale.state.steps", 2**40), "steps"),
        ("skipped past steps", edit("ampscale.state.skipped_steps", 5), "skipped_steps"),
        ("reasons not adding up", edit("ampscale.state.grad_overflows", 1), "grad_overflows"),
        ("hysteresis tracker past hysteresis", edit("ampscale.state.hysteresis_tracker", 5), "hysteresis_tracker"),
        ("growth tracker below the delay", edit("ampscale.state.growth_tracker", -3), "growth_tracker"),
        ("unknown state key", edit("ampscale.state.scael", 1.0), "scael"),
        ("missing scale", drop("ampscale.state.scale"), "ampscale.state.scale"),
        ("unhashable preset", edit("ampscale.preset", ["torch"]), "ampscale.preset"),
        ("unknown preset", edit("ampscale.preset", "tensorflow"), "ampscale.preset"),
        ("version 0", edit("ampscale.version", 0), "ampscale.version"),
        ("version a string", edit("ampscale.version", "1"), "ampscale.version"),
        ("version from the future", edit("ampscale.version", 99), "newer"),
        ("unknown setting", edit("ampscale.settings.speed", 1), "speed"),
        ("setting out of range", edit("ampscale.settings.backoff_factor", 0.99999999), "backoff_factor"),
        ("setting of the wrong type", edit("ampscale.settings.growth_interval", "2000"), "growth_interval"),
        ("unknown top-level key", edit("extra", 1), "extra"),
        ("torch key disagrees", edit("scale", 2048.0), "'scale'"),
        ("payload not a dict", edit("ampscale", [1]), "ampscale"),
        ("torch format, scale inf", {**torch_dict, "scale": math.inf}, "'scale'"),
        ("torch format, unknown key", {**torch_dict, "_scale": 1.0}, "_scale"),
        ("torch format, negative tracker", {**torch_dict, "_growth_tracker": -5}, "_growth_tracker"),
        ("torch format, factor 1", {**torch_dict, "growth_factor": 1.0}, "growth_factor"),
        ("not a dict", [("scale", 1.0)], "dict"),
        ("empty", {}, "empty"),
    ]


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_checkpoint_validation_table(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=64.0).update(False)
    before = scaler.state_dict()
    for name, bad, key in _bad_dicts():
        with pytest.raises(ampscale.StateDictError, match=key.replace(".", r"\.").replace("[", r"\[")) as info:
            scaler.load_state_dict(bad)
        assert str(info.value), name
        assert scaler.state_dict() == before, name
    lazy = ampscale.create_scaler()  # no backend yet: the same checks
    for name, bad, _key in _bad_dicts():
        with pytest.raises(ampscale.StateDictError):
            lazy.load_state_dict(bad)
        assert lazy.get_scale() == 2.0**16, name


@torch_only
def test_grad_scaler_refuses_bad_checkpoints_and_keeps_its_state() -> None:
    from ampscale.torch import GradScaler

    scaler = GradScaler("cpu", init_scale=256.0)
    for name, bad, _key in _bad_dicts():
        if not isinstance(bad, dict) or not bad:
            continue  # as torch's: an empty dict is a RuntimeError, and a non-dict is not looked at
        with pytest.raises(ampscale.StateDictError):
            scaler.load_state_dict(bad)
        assert scaler.get_scale() == 256.0, name


@CHEAP
@given(
    scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.none(), st.text(max_size=3)),
    reason=st.one_of(st.integers(-3, 5), st.floats(-2, 3), st.none()),
)
def test_checkpoint_property_a_load_is_valid_or_refused(scale: Any, reason: Any) -> None:
    scaler = ampscale.create_scaler(init_scale=8.0)
    d = scaler.state_dict()
    d["scale"] = d["ampscale"]["state"]["scale"] = scale
    d["ampscale"]["state"]["last_reason"] = reason
    try:
        loaded = scaler.load_state_dict(d)
    except ampscale.StateDictError:
        return
    value = loaded.get_scale()
    assert FLOAT32_TINY <= value <= FLOAT32_MAX
    assert loaded.get_stats()["last_step"] in ("no step yet", "applied", "loss", "gradients")


# ------------------------------------------------------------ 8. settings as they will be used


@pytest.mark.parametrize(
    ("settings_", "name"),
    [
        ({"init_scale": 0.5, "min_scale": 1.0}, "init_scale"),
        ({"init_scale": 4.0, "max_scale": 2.0}, "init_scale"),
        ({"preset": "apex", "init_scale": 2.0**30}, "init_scale"),
        ({"preset": "keras", "backoff_factor": 0.99999999}, "backoff_factor"),
        ({"preset": "keras", "backoff_factor": 1e-46}, "backoff_factor"),
        ({"preset": "keras", "growth_factor": 1e39}, "growth_factor"),
        ({"growth_factor": 1.0 + 2.0**-30}, "growth_factor"),
        ({"max_scale": 1e39}, "max_scale"),
        ({"min_scale": 1e-40}, "min_scale"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"init_scale": 1e-40}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),
        ({"mode": "static", "init_scale": 1e-45}, "init_scale"),
    ],
)
def test_contradicting_settings_are_refused(settings_: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ampscale.create_scaler(**settings_)


@CHEAP
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    init=st.floats(1e-45, 1e40),
    low=st.one_of(st.none(), st.floats(1e-45, 1e40)),
    high=st.one_of(st.none(), st.floats(1e-45, 1e40)),
    growth=st.floats(1.0, 1e40),
)
def test_settings_property_created_means_usable(preset: str, init: float, low: Any, high: Any, growth: float) -> None:
    try:
        config = ampscale.create_scaler(
            preset=preset, init_scale=init, min_scale=low, max_scale=high, growth_factor=growth
        ).config
    except ValueError:
        return
    assert config.growth_value > 1
    assert math.isfinite(config.growth_value)
    assert 0 < config.backoff_value < 1 or config.backoff_rule == "divide"
    assert 0 < config.min_value <= config.initial_scale <= config.max_value < math.inf


# ------------------------------------------------------------ 9, 11. the torch drop-in and restores


@torch_only
def test_grad_scaler_goes_on_after_a_caught_scale_at_floor_error() -> None:
    import torch

    from ampscale.torch import GradScaler

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_floor="raise")
    caught = 0
    for poison in (math.nan, math.nan, 1.0):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum() * poison).backward()
        scaler.step(optimizer)  # "step() has already been called" before the fix
        try:
            scaler.update()
        except ampscale.ScaleAtFloorError:
            caught += 1
    assert caught == 2


@pytest.mark.parametrize("target", ["torch", None], ids=["torch", "undetected"])
def test_stats_right_after_a_restore(target: Any) -> None:
    if target == "torch":
        pytest.importorskip("torch")
    source = ampscale.create_scaler(init_scale=64.0)
    for finite in (True, False, False, True):
        source = source.update(finite)
    restored = ampscale.create_scaler(backend=target).load_state_dict(source.state_dict())
    assert restored.get_stats() == source.get_stats()
    assert restored.get_scale() == source.get_scale() == 16.0
    assert ampscale.doctor(restored).evidence == ampscale.doctor(source).evidence


# ------------------------------------------------------------ 10. on_floor="raise" under jit


@jax_only
def test_scale_at_floor_error_reaches_the_user_under_jit() -> None:
    import jax
    import jax.numpy as jnp

    import ampscale.jax as ajax

    scaler = ampscale.create_scaler(backend="jax", init_scale=1.0, min_scale=1.0, on_floor="raise")
    step = jax.jit(lambda s: s.update(jnp.asarray(False)))
    with pytest.raises(ampscale.ScaleAtFloorError) as info, ajax.floor_errors():
        jax.block_until_ready(step(scaler))
    assert info.value.scale == 1.0
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
    # without the context manager: JAX's own error, whose message holds ours
    with pytest.raises(jax.errors.JaxRuntimeError, match="floor"):
        jax.block_until_ready(step(scaler))
    with pytest.raises(ValueError, match="other"), ajax.floor_errors():  # other errors pass through
        raise ValueError("other")


# ------------------------------------------------------------ 12, 13. the environment and names


def test_results_do_not_depend_on_whether_jax_was_imported() -> None:
    pytest.importorskip("jax")
    script = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "jax-first":
            import jax
        import numpy as np, ampscale
        scaler = ampscale.create_scaler()
        grads, finite = scaler.unscale({1: np.full(2, 4.0, np.float32), "b": np.ones(2, np.float32)})
        print(scaler.backend, sorted(map(str, grads)), bool(finite))
        print(bool(ampscale.all_finite({1: np.ones(1), "b": np.ones(1)})))
        import jax, jax.numpy as jnp
        before = ampscale.create_scaler(init_scale=8.0)
        print(jax.jit(lambda s: s.update(jnp.asarray(False)))(before).get_scale())
        """
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", script, order], capture_output=True, text=True, check=True, timeout=300
        ).stdout
        for order in ("jax-first", "jax-later")
    ]
    assert outputs[0] == outputs[1]
    assert outputs[0].splitlines()[-1] == "4.0"


def test_a_backend_name_is_looked_up_never_imported(capsys: pytest.CaptureFixture[str]) -> None:
    sys.modules.pop("this", None)
    for name in ("this", "antigravity", "os.path", "numpy.random"):
        with pytest.raises(ValueError, match="backend"):
            ampscale.create_scaler(backend=name)
    assert "this" not in sys.modules
    assert "Zen of Python" not in capsys.readouterr().out
    xp = pytest.importorskip("array_api_strict")  # an imported namespace is found by its name
    assert ampscale.create_scaler(backend=xp.__name__).backend is ampscale.get_backend(xp)


# ------------------------------------------------------------ 14. float64 presets on JAX without x64


@jax_only
@pytest.mark.parametrize("preset", ["apex", "deepspeed"])
def test_float64_presets_run_on_jax_without_x64(preset: str) -> None:
    import jax

    if jax.config.jax_enable_x64:
        pytest.skip("x64 is enabled")
    steps = [False, True, True, False, False, True] * 5
    numpy_scaler = ampscale.create_scaler(backend="numpy", preset=preset, growth_interval=2, on_floor="ignore")
    jax_scaler = ampscale.create_scaler(backend="jax", preset=preset, growth_interval=2, on_floor="ignore")
    for finite in steps:
        numpy_scaler = numpy_scaler.update(finite)
        jax_scaler = jax_scaler.update(finite)
        assert jax_scaler.get_scale() == numpy_scaler.get_scale()
    loaded = ampscale.create_scaler(backend="jax", preset=preset).load_state_dict(numpy_scaler.state_dict())
    assert loaded.get_stats() == numpy_scaler.get_stats()
    odd = ampscale.create_scaler(backend="numpy", preset=preset, init_scale=3.3, on_floor="ignore")
    with pytest.raises(ValueError, match="float32"):
        ampscale.create_scaler(backend="jax", preset=preset).load_state_dict(odd.state_dict())


def test_warnings_stay_quiet_on_the_paths_above() -> None:
    """The storm and the edges raise no warning by themselves (on_floor='ignore')."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = ampscale.create_scaler(init_scale=2.0**-125)
        for _ in range(5):
            scaler = scaler.update(False)
            scaler.unscale([np.ones(3, np.float32)])
