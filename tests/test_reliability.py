"""Reliability: adversarial trees, bad input everywhere, faults in real training loops, diagnostics.

The counts of trees generated, bad inputs tried and faults injected are printed at the end of
the test session (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale
from tests.conftest import BF16, FRAMEWORKS, Framework

COUNTS = {"trees": 0, "bad inputs": 0, "faults": 0}

CPU = [f for f in FRAMEWORKS if not f.gpu]
NUMPY = next(f for f in FRAMEWORKS if f.name == "numpy")

EXTREMES = {
    "float16": [65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, -0.0, 0.0, 60000.0],
    "bfloat16": [3.3895314e38, -3.3895314e38, 9.2e-41, -0.0, 3e38],
    "float32": [3.4028235e38, -3.4028235e38, 1.4e-45, -1.4e-45, 1.1754944e-38, -0.0, 3e38],
    "float64": [1.7976931348623157e308, 5e-324, -0.0, 1e308],
}


def _np_dtype(name: str):
    return BF16 if name == "bfloat16" else np.dtype(name)


@st.composite
def leaf_specs(draw: st.DrawFn, dtypes: tuple[str, ...]):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(
        st.one_of(
            st.just(()),
            st.tuples(st.integers(0, 9)),
            st.tuples(st.integers(0, 6), st.integers(0, 7)),
            st.tuples(st.sampled_from([1023, 1024, 1025, 65535, 65536, 65537, 300_001])),
        )
    )
    view = draw(st.sampled_from(["plain", "strided", "transposed"]))
    extreme = draw(st.booleans())
    return dtype, shape, view, extreme


@st.composite
def trees(draw: st.DrawFn, dtypes: tuple[str, ...]):
    """A nested tree description (dicts, lists, tuples) of leaf specs, with planted faults."""
    specs = draw(st.lists(leaf_specs(dtypes), min_size=1, max_size=6))
    shape = draw(st.sampled_from(["list", "dict", "nested"]))
    plant = draw(
        st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1), st.sampled_from([np.inf, -np.inf, np.nan])), max_size=3)
    )
    return specs, shape, plant


def build(fw: Framework, description, rng: np.random.Generator):
    """Materialise a tree: NumPy values (for the reference) and framework arrays (to test)."""
    specs, shape, plant = description
    values = []
    for dtype, dims, _view, extreme in specs:
        size = math.prod(dims) if dims else 1
        base = rng.standard_normal(size) * rng.choice([1e-3, 1.0, 100.0])
        if extreme:
            base = rng.choice(EXTREMES[dtype], size=size)
        limit = {"float16": 60000.0, "bfloat16": 1e38, "float32": 3e38, "float64": 1e300}[dtype]
        base = np.clip(base, -limit, limit)
        values.append(np.asarray(base.reshape(dims), dtype=np.float64))
    planted = False
    for index, where, bad in plant:
        if index < len(values) and values[index].size:
            flat = values[index].reshape(-1)
            flat[int(where * (flat.size - 1))] = bad
            planted = True
    arrays = []
    for (dtype, _dims, view, _), v in zip(specs, values, strict=True):
        typed = v.astype(_np_dtype(dtype))
        if view == "strided" and typed.ndim == 1 and typed.size > 1:
            holder = np.zeros(typed.size * 2, dtype=typed.dtype)
            holder[::2] = typed
            arrays.append(("strided", holder, typed))
        elif view == "transposed" and typed.ndim == 2:
            arrays.append(("transposed", np.array(typed.T, order="C", copy=True), typed))
        else:
            arrays.append(("plain", typed, typed))
    leaves = []
    for kind, storage, typed in arrays:
        if fw.name == "numpy" and kind == "strided":
            leaves.append(storage[::2])
        elif fw.name == "numpy" and kind == "transposed":
            leaves.append(storage.T)
        elif fw.name.startswith("torch") and kind == "strided":
            leaves.append(fw.make(storage)[::2])
        elif fw.name.startswith("torch") and kind == "transposed":
            leaves.append(fw.make(storage).T)
        else:
            leaves.append(fw.make(typed))
    expected_values = [typed for _, _, typed in arrays]
    if shape == "list":
        tree = leaves
    elif shape == "dict":
        tree = {f"p{i}": leaf for i, leaf in enumerate(leaves)}
    else:
        tree = {"a": leaves[: len(leaves) // 2], "b": (leaves[len(leaves) // 2 :], None)}
    any_bad = planted or any(not np.isfinite(v.astype(np.float64)).all() for v in expected_values)
    return tree, leaves, expected_values, any_bad


def reference(x: np.ndarray, scale: float) -> np.ndarray:
    inv = np.float32(1.0 / scale)
    with np.errstate(all="ignore"):
        if x.dtype == np.float64:
            return x * np.float64(inv)
        return (x.astype(np.float32) * inv).astype(x.dtype)


def reference_xla_cpu(x: np.ndarray, scale: float) -> np.ndarray:
    """XLA's CPU arithmetic flushes float32 subnormals (inputs and results) to zero: float32 and
    bfloat16 values below float32's smallest normal count as zero. float16 is exact, since every
    float16 value is a normal float32."""
    if x.dtype == np.float16:
        return reference(x, scale)
    tiny = np.finfo(np.float32).tiny
    wide = x.astype(np.float32)
    wide = np.where(np.abs(wide) < tiny, np.copysign(np.float32(0), wide), wide)
    with np.errstate(all="ignore"):
        product = wide * np.float32(1.0 / scale)
    product = np.where(np.abs(product) < tiny, np.copysign(np.float32(0), product), product)
    return product.astype(x.dtype)


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_adversarial_trees_flag_is_exact_and_unscale_is_exact(fw: Framework, data: st.DataObject) -> None:
    description = data.draw(trees(fw.dtypes))
    # below a scale of 1 finite values may overflow when unscaled: the flag must say so
    scales = [2.0**k for k in (0, 4, 16, 30, -3)]
    scale = data.draw(st.sampled_from(scales))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tree, _leaves, values, any_bad = build(fw, description, rng)
    COUNTS["trees"] += 1
    assert bool(ampscale.all_finite(tree, backend=fw.backend)) is (not any_bad)
    expected_leaves = [reference_xla_cpu(v, scale) if fw.name == "jax" else reference(v, scale) for v in values]
    overflows = any(not np.isfinite(e.astype(np.float64)).all() for e in expected_leaves)
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=scale)
    out, finite = scaler.unscale(tree)
    assert bool(finite) is (not (any_bad or overflows))
    if any_bad:
        return
    out_leaves, _ = scaler.backend.flatten(out)
    for got, expected in zip(out_leaves, expected_leaves, strict=True):
        np.testing.assert_array_equal(
            np.asarray(fw.to_numpy(got)).astype(np.float64), np.asarray(expected).astype(np.float64)
        )


# ------------------------------------------------------------------------------ bad input everywhere


def _bad_inputs(fw: Framework):
    good = fw.array([1.0, 2.0])
    cases = [
        ("int gradients", lambda s: s.unscale([fw.array([1, 2], "int32")]), TypeError, "int32"),
        ("bool gradients", lambda s: s.unscale({"g": fw.array([True], "bool")}), TypeError, "bool"),
        ("non-array leaf", lambda s: s.unscale([good, 3.0]), TypeError, r"\[1\]"),
        ("string leaf", lambda s: s.unscale({"x": "grad"}), TypeError, "str"),
        ("integer loss", lambda s: s.unscale([good], loss=fw.array(3, "int32")), TypeError, "loss"),
        ("all_finite on ints", lambda s: ampscale.all_finite([fw.array([1], "int32")]), TypeError, "int32"),
        ("diagnose on ints", lambda s: ampscale.diagnose([fw.array([1], "int32")]), TypeError, "int32"),
        ("update with a string", lambda s: s.update("yes"), TypeError, "bool"),
        ("update with a vector", lambda s: s.update(np.array([True, False])), TypeError, "0-d"),
        ("update with an int", lambda s: s.update(np.int32(1)), TypeError, "boolean"),
        ("scale of a string", lambda s: s.scale("loss"), TypeError, "str"),
        (
            "step with ints",
            lambda s: s.step(lambda p, g, o: (p, o), [good], [fw.array([1], "int32")], ()),
            TypeError,
            "int32",
        ),
        ("state dict from the future", lambda s: s.load_state_dict(_future(s)), ampscale.StateDictError, "newer"),
        (
            "state dict with a negative scale",
            lambda s: s.load_state_dict(_negative(s)),
            ampscale.StateDictError,
            "scale",
        ),
        ("replace with a nan setting", lambda s: s.replace(growth_factor=float("nan")), ValueError, "growth_factor"),
        ("replace with a negative interval", lambda s: s.replace(growth_interval=-3), ValueError, "growth_interval"),
    ]
    others = [f for f in CPU if f.name.split("-")[0] != fw.name.split("-")[0]]
    if others:
        other = others[0]
        cases.append(("two frameworks", lambda s: s.unscale([good, other.array([1.0])]), TypeError, "framework"))
    return good, cases


def _future(s: ampscale.Scaler) -> dict:
    d = json.loads(json.dumps(s.state_dict()))
    d["ampscale"]["version"] = 999
    return d


def _negative(s: ampscale.Scaler) -> dict:
    d = json.loads(json.dumps(s.state_dict()))
    d["ampscale"]["state"]["scale"] = -1.0
    return d


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_bad_input_to_every_public_function_raises_and_changes_nothing(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=4.0).update(True)
    before = scaler.state_dict()
    good, cases = _bad_inputs(fw)
    for name, call, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            call(scaler)
        COUNTS["bad inputs"] += 1
        assert scaler.state_dict() == before, name
        np.testing.assert_array_equal(fw.to_numpy(good), [1.0, 2.0], err_msg=name)


def test_jax_arrays_committed_to_different_devices_are_refused() -> None:
    jax = pytest.importorskip("jax")
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs several CPU devices")
    a = jax.device_put(jax.numpy.ones(3), devices[0])
    b = jax.device_put(jax.numpy.ones(3), devices[1])
    scaler = ampscale.create_scaler(backend="jax")
    with pytest.raises(ValueError, match="devices"):
        scaler.unscale([a, b])
    COUNTS["bad inputs"] += 1


# ------------------------------------------------------------------------------ faults in training loops


class Loop:
    """A small regression MLP trained with ampscale in one framework (manual grads for NumPy)."""

    def __init__(self, framework: str, seed: int = 0) -> None:
        self.framework = framework
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((64, 8)).astype(np.float32)
        self.y = rng.standard_normal((64, 2)).astype(np.float32)
        self.init = [
            (rng.standard_normal((8, 16)) * 0.3).astype(np.float32),
            np.zeros(16, np.float32),
            (rng.standard_normal((16, 2)) * 0.3).astype(np.float32),
            np.zeros(2, np.float32),
        ]

    def arrays(self) -> tuple[list, list]:
        if self.framework == "numpy":
            params = [p.copy() for p in self.init]
        elif self.framework == "torch":
            import torch

            params = [torch.from_numpy(p.copy()) for p in self.init]
        else:
            import jax.numpy as jnp

            params = [jnp.asarray(p) for p in self.init]
        return params, [p * 0 for p in params]  # momentum buffers

    def data(self):
        if self.framework == "torch":
            import torch

            return torch.from_numpy(self.x), torch.from_numpy(self.y)
        if self.framework == "jax":
            import jax.numpy as jnp

            return jnp.asarray(self.x), jnp.asarray(self.y)
        return self.x, self.y

    def grads(self, params, scale: float, poison_loss: bool, poison_layer: int | None):
        """Scaled loss and scaled gradients (manual backprop, the same for every framework)."""
        w1, b1, w2, b2 = params
        x, y = self.data()
        pre = x @ w1 + b1
        hidden = pre * (pre > 0)
        out = hidden @ w2 + b2
        residual = out - y
        loss = (residual * residual).mean()
        if poison_loss:
            loss = loss * float("nan")
        seed = residual * (2.0 * scale / math.prod(residual.shape))
        g_w2 = hidden.T @ seed
        g_b2 = seed.sum(0)
        g_pre = (seed @ w2.T) * (pre > 0)
        grads = [x.T @ g_pre, g_pre.sum(0), g_w2, g_b2]
        if poison_layer is not None:
            grads[poison_layer] = grads[poison_layer] * float("inf")
        return loss * scale, grads


def sgd(params, grads, momentum):
    momentum = [0.9 * m + g for m, g in zip(momentum, grads, strict=True)]
    return [p - 0.05 * m for p, m in zip(params, momentum, strict=True)], momentum


def bitwise(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b, strict=True))


LOOP_FRAMEWORKS = [name for name in ("numpy", "torch", "jax") if any(f.name == name for f in FRAMEWORKS)]


def run_loop(loop: Loop, scaler, params, momentum, faults: dict[int, str], steps: range):
    history = []
    for step in steps:
        fault = faults.get(step)
        poisoned = {"layer": 2, "storm": 0}.get(fault or "")
        scaled_loss, grads = loop.grads(params, scaler.get_scale(), fault == "loss", poisoned)
        before = (list(params), list(momentum))
        params, momentum, scaler = scaler.step(sgd, params, grads, momentum, loss=scaled_loss)
        if fault in ("loss", "layer", "storm"):
            COUNTS["faults"] += 1
            assert not bool(scaler.outcome.applied), (step, fault)
            assert bitwise(params, before[0]), (step, fault)
            assert bitwise(momentum, before[1]), (step, fault)
        history.append(scaler.state_dict()["ampscale"]["state"])
    return scaler, params, momentum, history


@pytest.mark.parametrize("framework", LOOP_FRAMEWORKS)
def test_fault_injection_in_a_training_loop(framework: str) -> None:
    loop = Loop(framework)
    params, momentum = loop.arrays()
    scaler = ampscale.create_scaler(backend=framework, init_scale=2.0**10, growth_interval=20)
    faults = {3: "loss", 7: "layer", 8: "layer"}
    faults.update(dict.fromkeys(range(20, 120), "storm"))  # every step overflows for 100 steps
    scaler, params, momentum, _ = run_loop(loop, scaler, params, momentum, faults, range(160))
    stats = scaler.get_stats()
    assert stats["skipped_steps"] == 103
    assert stats["loss_overflows"] == 1
    assert stats["grad_overflows"] == 102
    assert all(np.isfinite(np.asarray(p)).all() for p in params)
    assert stats["applied_steps"] == 57  # and training went on after the storm


@pytest.mark.parametrize("framework", LOOP_FRAMEWORKS)
@pytest.mark.parametrize("target", LOOP_FRAMEWORKS)
def test_checkpoint_mid_run_continues_the_uninterrupted_trajectory(framework: str, target: str) -> None:
    faults = {4: "layer", 11: "loss", 12: "layer", 30: "layer"}
    settings_ = {"init_scale": 2.0**12, "growth_interval": 5, "hysteresis": 2, "preset": "megatron"}
    whole_loop = Loop(framework)
    params, momentum = whole_loop.arrays()
    _, full_params, _, full_history = run_loop(
        whole_loop, ampscale.create_scaler(backend=framework, **settings_), params, momentum, faults, range(40)
    )
    first = Loop(framework)
    params, momentum = first.arrays()
    scaler, params, momentum, history = run_loop(
        first, ampscale.create_scaler(backend=framework, **settings_), params, momentum, faults, range(20)
    )
    saved = json.loads(json.dumps(scaler.state_dict()))  # to disk and back
    COUNTS["faults"] += 1  # the interruption itself
    second = Loop(target)
    restored = ampscale.create_scaler(backend=target).load_state_dict(saved)
    moved = [np.asarray(p) for p in params], [np.asarray(m) for m in momentum]
    params2, momentum2 = second.arrays()
    if target == "torch":
        import torch

        params2, momentum2 = (
            [torch.from_numpy(p.copy()) for p in moved[0]],
            [torch.from_numpy(m.copy()) for m in moved[1]],
        )
    elif target == "jax":
        import jax.numpy as jnp

        params2, momentum2 = [jnp.asarray(p) for p in moved[0]], [jnp.asarray(m) for m in moved[1]]
    else:
        params2, momentum2 = [p.copy() for p in moved[0]], [m.copy() for m in moved[1]]
    _, resumed_params, _, rest = run_loop(second, restored, params2, momentum2, faults, range(20, 40))
    assert history + rest == full_history  # the scaler's whole trajectory, every field
    if target == framework:
        assert bitwise(resumed_params, full_params)
    else:
        for a, b in zip(resumed_params, full_params, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reaction", ["raise", "warn", "callback"])
def test_scale_pinned_at_the_floor_triggers_each_reaction(reaction: str) -> None:
    events = []
    on_floor = events.append if reaction == "callback" else reaction
    loop = Loop("numpy")
    params, momentum = loop.arrays()
    scaler = ampscale.create_scaler(init_scale=4.0, min_scale=1.0, on_floor=on_floor)
    storm = dict.fromkeys(range(10), "layer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if reaction == "raise":
            with pytest.raises(ampscale.ScaleAtFloorError):
                run_loop(loop, scaler, params, momentum, storm, range(10))
        else:
            scaler, *_ = run_loop(loop, scaler, params, momentum, storm, range(10))
    COUNTS["faults"] += 1
    if reaction == "warn":
        assert any(issubclass(w.category, ampscale.ScaleAtFloorWarning) for w in caught)
    if reaction == "callback":
        assert [e.consecutive for e in events] == list(range(1, 9))
        assert ampscale.doctor(scaler).cause == "floor"


# ------------------------------------------------------------------------------ diagnostics


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_diagnose_names_the_leaves_and_the_loss(fw: Framework) -> None:
    tree = {"encoder": [fw.array([1.0, 2.0]), fw.array([np.nan, 1.0, np.inf])], "head": fw.array([-np.inf])}
    report = ampscale.diagnose(tree, loss=fw.array(np.inf))
    paths = [leaf.path for leaf in report.leaves]
    assert paths == ["['encoder'][1]", "['head']"] or set(paths) == {"['encoder'][1]", "['head']"}
    encoder = next(leaf for leaf in report.leaves if "encoder" in leaf.path)
    assert (encoder.nan, encoder.posinf, encoder.neginf) == (1, 1, 0)
    assert report.loss_finite is False
    assert not report.finite
    assert "forward pass" in str(report)
    clean = ampscale.diagnose({"a": fw.array([1.0])})
    assert clean.finite
    assert str(clean) == "all finite (1 leaves)"


def test_doctor_tells_the_causes_apart() -> None:
    base = ampscale.create_scaler(backend="numpy", init_scale=2.0**16)
    assert ampscale.doctor(base).cause == "no steps"
    healthy = base
    for _ in range(100):
        healthy = healthy.update(True)
    assert ampscale.doctor(healthy.update(False)).cause == "healthy"
    forward = base
    for _ in range(5):
        forward = forward.update(False, loss_finite=False)
    assert ampscale.doctor(forward).cause == "forward"
    backward = base
    for i in range(40):
        backward = backward.update(i % 3 != 0)
    diagnosis = ampscale.doctor(backward)
    assert diagnosis.cause == "backward"
    assert diagnosis.evidence["skip_rate"] > 0.05
    floor = ampscale.create_scaler(backend="numpy", init_scale=2.0, min_scale=1.0)
    for _ in range(4):
        floor = floor.update(False)
    assert ampscale.doctor(floor).cause == "floor"
    assert ampscale.doctor(healthy, underflow=0.2).cause == "underflow"
    assert "init_scale" in ampscale.doctor(healthy, underflow=0.2).advice


@pytest.mark.parametrize("fw", CPU, ids=[f.name for f in CPU])
def test_underflow_fraction_counts_zeros_and_subnormals(fw: Framework) -> None:
    smallest = {"float16": 2.0**-24, "bfloat16": 9.2e-41, "float32": 1.4e-45, "float64": 5e-324}
    for dtype in fw.dtypes:
        values = np.array([0.0, -0.0, smallest[dtype], 1.0, 2.0, -3.0, 4.0, 5.0])
        scaler = ampscale.create_scaler(backend=fw.backend, init_scale=2.0)
        out, finite, fraction = scaler.unscale([fw.array(values, dtype)], underflow=True)
        assert bool(finite)
        assert float(fraction) == pytest.approx(3 / 8), dtype
        np.testing.assert_array_equal(
            fw.to_numpy(out[0]).astype(np.float64), reference(values.astype(_np_dtype(dtype)), 2.0).astype(np.float64)
        )
    _, finite = ampscale.create_scaler(backend=fw.backend).unscale([fw.array([1.0])])  # off: the plain pair
    assert bool(finite)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_underflow_count_is_exact_through_the_vector_loops_and_threads(dtype: str) -> None:
    """The NumPy kernel's count, over arrays long enough for its widest vector loops (64
    elements an iteration), with odd tails, and a total large enough to split across threads:
    exactly the number of zero or subnormal inputs, wherever they sit."""
    rng = np.random.default_rng(7)
    kind = _np_dtype(dtype)
    tiny_value = {"float16": 2.0**-20, "bfloat16": 1e-39, "float32": 1e-40, "float64": 1e-310}[dtype]
    arrays, expected = [], 0
    for size in (63, 64, 65, 1000, 4099, (1 << 19) + 77):
        values = rng.standard_normal(size).astype(np.float32).astype(kind)
        where = rng.random(size) < rng.choice([0.01, 0.3, 0.9])
        values[where] = np.where(rng.random(where.sum()) < 0.5, 0.0, tiny_value * rng.choice([-1, 1]))
        arrays.append(values)
        magnitude = np.abs(values.astype(np.float64))
        smallest_normal = 2.0**-126 if dtype == "bfloat16" else float(np.finfo(kind).smallest_normal)
        expected += int(np.count_nonzero(magnitude < smallest_normal))
    total = sum(a.size for a in arrays)
    scaler = ampscale.create_scaler(backend="numpy", init_scale=1.0)
    _, finite, fraction = scaler.unscale(arrays, underflow=True)
    assert bool(finite)
    assert round(float(fraction) * total) == expected


def test_get_stats_is_plain_and_complete() -> None:
    scaler = ampscale.create_scaler(backend="numpy", init_scale=8.0, growth_interval=2)
    for finite in [True, True, False, True]:
        scaler = scaler.update(finite)
    stats = scaler.get_stats()
    assert json.loads(json.dumps(stats)) == stats
    assert stats["steps"] == 4
    assert stats["skipped_steps"] == 1
    assert stats["growths"] == 1
    assert stats["backoffs"] == 1
    assert stats["scale"] == 8.0
    assert stats["scale_change"] == 1.0
    assert stats["last_step"] == "applied"
