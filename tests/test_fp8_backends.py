"""The FP8 transition on every backend: JAX (jit, scan, vmap) and torch equal NumPy bit for bit.

The same drawn amax streams and skipped steps go through every preset on NumPy, JAX and torch;
the states must agree field by field, bit for bit. The JAX scaler is a pytree (the config is
static), so the update runs inside ``jax.jit`` and ``lax.scan`` with no host transfer.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale.fp8 as fp8
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config
from tests.test_fp8_presets import amax_value

# the JAX comparison draws the same amaxes as the others, subnormals and FLT_MAX / 2 included:
# XLA's CPU flushes subnormal operands and results, so the JAX backend computes the transition's
# float32 arithmetic on the bits (ampscale/fp8/_exact.py) and must still equal NumPy bit for bit
jax_steps = st.lists(st.tuples(st.lists(amax_value, min_size=3, max_size=3), st.booleans()), min_size=6, max_size=6)
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}
EXAMPLES = int(os.environ.get("AMPSCALE_FP8_EXAMPLES", "10"))
PRESETS = sorted(FP8_PRESETS)
steps_strategy = st.lists(
    st.tuples(st.lists(amax_value, min_size=3, max_size=3), st.booleans()), min_size=1, max_size=6
)


def host(state):
    return [np.asarray(f.detach().cpu().numpy() if hasattr(f, "detach") else f) for f in state]


def assert_same(a, b, where):
    for name, x, y in zip(fp8.Fp8State._fields, host(a), host(b), strict=True):
        if x.dtype.kind == "f":
            assert (x.view(np.uint32) == y.view(np.uint32)).all(), f"{name}: {x} != {y} ({where})"
        else:
            assert (x == y).all(), f"{name}: {x} != {y} ({where})"


@settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(PRESETS), length=st.sampled_from([1, 2, 16]), steps=steps_strategy)
def test_torch_equals_numpy(preset, length, steps):
    torch = pytest.importorskip("torch")
    config = make_fp8_config(preset, SLOTS, history_len=length)
    reference, state = fp8.init_state(config, "numpy"), fp8.init_state(config, "torch")
    for amax, ok in steps:
        reference, _ = fp8.update_state(config, reference, np.float32(amax), ok)
        state, _ = fp8.update_state(config, state, torch.tensor(amax, dtype=torch.float32), torch.tensor(ok))
    assert_same(state, reference, f"{preset} L={length} {steps}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(PRESETS), length=st.sampled_from([1, 16]), steps=jax_steps)
def test_jax_scan_equals_numpy(preset, length, steps):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    config = make_fp8_config(preset, SLOTS, history_len=length)
    reference = fp8.init_state(config, "numpy")
    for amax, ok in steps:
        reference, _ = fp8.update_state(config, reference, np.float32(amax), ok)

    def body(state, xs):
        amax, ok = xs
        return fp8.update_state(config, state, amax, ok)[0], None

    amaxes = jnp.asarray([a for a, _ in steps], jnp.float32)
    oks = jnp.asarray([ok for _, ok in steps])
    final, _ = jax.jit(lambda s, a, o: jax.lax.scan(body, s, (a, o)))(fp8.init_state(config, "jax"), amaxes, oks)
    assert_same(final, reference, f"{preset} L={length} {steps}")


def test_jax_scaler_is_a_pytree_under_jit_and_vmap():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="jax", history_len=4)
    step = jax.jit(lambda scaler, amax: scaler.update(amax))
    f8 = step(f8, jnp.asarray([1.0, 2.0, 4.0], jnp.float32))
    assert isinstance(f8, fp8.Fp8Scaler)
    assert f8.scales_sync() == {"x": 448.0, "w": 224.0, "dy": 14336.0}
    config = f8.config
    batched = jax.vmap(lambda state, amax: fp8.update_state(config, state, amax)[0])(
        jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), f8.state), jnp.asarray([[2.0, 2.0, 2.0], [8.0, 8.0, 8.0]])
    )
    # window max with the first update's amaxes [1, 2, 4]: x 2, w 2, dy 4; then x 8, w 8, dy 8
    assert np.asarray(batched.scale).tolist() == [[224.0, 224.0, 14336.0], [56.0, 56.0, 7168.0]]


FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("preset", "amax", "scale"),
    [
        # TE's reciprocal(3e38) is the subnormal 3.33e-39; times 448 it is 1.4933e-36 (TE's own functions)
        ("te_delayed_unfused", 3e38, float(np.float32(np.float32(1.0) / np.float32(3e38)) * np.float32(448.0))),
        ("te_delayed_unfused", FLT_MAX / 2, None),
        # a subnormal amax is not 0: 448 / 1e-40 overflows, TE's kernel gives FLT_MAX (scale_inv subnormal)
        ("te_delayed", 1e-40, FLT_MAX),
        ("te_current", 1e-40, FLT_MAX),
        ("te_block", 1e-45, float.fromhex("0x1p+127")),
        ("ampscale", 1e-45, FLT_MAX),
        ("msamp", 1e-40, float("inf")),
    ],
)
def test_jax_keeps_subnormals_as_numpy_and_the_anchors_do(preset, amax, scale):
    """XLA's CPU flushes subnormals; the JAX backend must not: eager, jitted and in a scan, its
    state equals NumPy's bit for bit, and the scale is the anchor's."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    config = make_fp8_config(preset, SLOTS, history_len=4)
    amaxes = np.float32([amax, 1.0, amax])
    reference, _ = fp8.update_state(config, fp8.init_state(config, "numpy"), amaxes)
    if scale is not None:
        assert np.float32(reference.scale[0]) == np.float32(scale)
    eager, _ = fp8.update_state(config, fp8.init_state(config, "jax"), jnp.asarray(amaxes))
    assert_same(eager, reference, f"{preset} eager")
    jitted = jax.jit(lambda s, a: fp8.update_state(config, s, a)[0])(fp8.init_state(config, "jax"), jnp.asarray(amaxes))
    assert_same(jitted, reference, f"{preset} jit")

    def body(state, amax_row):
        return fp8.update_state(config, state, amax_row, jnp.asarray(True))[0], None

    rows = jnp.asarray(np.stack([amaxes, amaxes[::-1]]))
    scanned, _ = jax.jit(lambda s, a: jax.lax.scan(body, s, a))(fp8.init_state(config, "jax"), rows)
    for row in np.stack([amaxes, amaxes[::-1]])[1:]:
        reference, _ = fp8.update_state(config, reference, row)
    assert_same(scanned, reference, f"{preset} scan")


def test_exact_arithmetic_equals_numpy_on_every_kind_of_operand():
    """ampscale/fp8/_exact.py: JAX's bit-level float32 multiply and divide equal NumPy's IEEE
    results over random bit patterns, subnormals, huge values, zeros, infs and nans, jitted."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ampscale.fp8 import _exact

    rng = np.random.default_rng(28)
    n = 50_000
    special = np.uint32([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF])
    parts = [
        rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
        rng.integers(0, 2**23, n, dtype=np.uint32),  # subnormals
        (rng.integers(240, 255, n, dtype=np.uint32) << 23) | rng.integers(0, 2**23, n, dtype=np.uint32),
        np.tile(special, 100),
    ]
    a = np.concatenate(parts).view(np.float32)
    b = rng.permutation(a)
    both = jax.jit(lambda x, y: (_exact.exact_mul(x, y, jax.lax, jnp), _exact.exact_div(x, y, jax.lax, jnp)))
    product, quotient = (np.asarray(v) for v in both(jnp.asarray(a), jnp.asarray(b)))
    with np.errstate(all="ignore"):
        for got, expected, name in ((product, a * b, "a * b"), (quotient, a / b, "a / b")):
            nan = np.isnan(expected)
            wrong = np.flatnonzero((got.view(np.uint32) != expected.view(np.uint32)) & ~nan | (np.isnan(got) != nan))
            assert wrong.size == 0, [(name, a[i], b[i], got[i], expected[i]) for i in wrong[:3]]


SHARDED = r"""
import json
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ampscale.fp8 as fp8
from ampscale.fp8._config import make_fp8_config

assert len(jax.devices()) == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("slots",))
names = {f"t{k}": "forward" if k % 2 else "backward" for k in range(8)}
results = {}
for preset in ("te_delayed", "flax", "msamp", "torchao_delayed"):
    config = make_fp8_config(preset, names, history_len=16)
    rows = P("slots", None)
    spec = fp8.Fp8State(P("slots"), P("slots"), rows, P("slots"), P("slots"), P("slots"), P(), P("slots"))
    shard = lambda state: jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, spec)
    state = shard(fp8.init_state(config, "jax"))
    # XLA's propagation through the ring's one-element scatter may replicate the history: the
    # caller's out_shardings keeps the slots where they were (the state is donated, so in place)
    placed = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec)
    step = jax.jit(lambda s, a, ok: fp8.update_state(config, s, a, ok)[0], donate_argnums=0, out_shardings=placed)
    reference = fp8.init_state(config, "numpy")
    rng = np.random.default_rng(4)
    special = np.float32([0.0, 1e-40, 3e38, np.inf, np.nan])
    for t in range(24):
        normal = rng.uniform(0.01, 1000, 8)
        amax = np.where(rng.random(8) < 0.8, normal, special[rng.integers(0, 5, 8)]).astype(np.float32)
        ok = bool(t % 7)
        state = step(state, jax.device_put(amax, NamedSharding(mesh, P("slots"))), jnp.asarray(ok))
        reference, _ = fp8.update_state(config, reference, amax, ok)
    same = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(state, reference, strict=True)
    )
    kept = state.history.sharding.spec == rows and state.scale.sharding.spec == P("slots")
    scaler = fp8.Fp8Scaler(config, state)
    saved = scaler.state_dict() == fp8.Fp8Scaler(config, reference).state_dict()
    results[preset] = [same, bool(kept), saved]
print(json.dumps(results))
"""


def test_sharded_jax_state_updates_as_numpy_does():
    """8 slots sharded over 4 CPU devices (a subprocess: the device count is set before JAX
    starts): the jitted update, the state donated and its shardings as out_shardings, equals
    NumPy bit for bit and keeps the slots on their devices; its checkpoint is NumPy's."""
    pytest.importorskip("jax")
    import json
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {p: [True, True, True] for p in ("te_delayed", "flax", "msamp", "torchao_delayed")}


@pytest.mark.parametrize(
    ("step_ok", "error", "message"),
    [
        ("yes", TypeError, r"step_ok must be a bool or a 0-d bool array.*got str 'yes'"),
        (1, TypeError, "step_ok must be a bool.*got int 1"),
        (np.array([True, False]), ValueError, r"step_ok must be .*got shape \(2,\)"),
        (np.float32(1.0), TypeError, "got an array of dtype float32"),
    ],
)
def test_a_bad_step_ok_is_refused_before_anything_changes(step_ok, error, message):
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=2)
    before = [np.asarray(x).copy() for x in f8.state]
    with pytest.raises(error, match=message):
        f8.update(np.float32([1.0, 2.0, 3.0]), step_ok=step_ok)
    assert all(a.tobytes() == np.asarray(b).tobytes() for a, b in zip(before, f8.state, strict=True))


def test_a_torch_step_ok_of_the_wrong_shape_is_refused():
    torch = pytest.importorskip("torch")
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="torch", history_len=2)
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        f8.update(torch.ones(3), step_ok=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got an array of dtype torch\.float32"):
        f8.update(torch.ones(3), step_ok=torch.ones((), dtype=torch.float32))


def test_msamp_in_its_warm_up_keeps_the_in_time_scale_of_a_skipped_step():
    """MS-AMP's cast runs even when the loss scaler skips the optimizer step: in the warm-up its
    in-time scale replaces the scale, and the skipped update changes nothing else."""
    f8 = fp8.create_fp8_scaler("msamp", {"x": "forward"}, history_len=4)
    f8 = f8.update(np.float32([1.0]))  # 448 / 1 -> 256
    skipped = f8.update(np.float32([3.0]), step_ok=False)  # in time: 448 / 3 -> 128
    assert skipped.scales_sync() == {"x": 128.0}
    assert np.asarray(skipped.history(0)).tolist() == np.asarray(f8.history(0)).tolist()
    assert int(skipped.state.filled[0]) == 1
    warm = fp8.create_fp8_scaler("msamp", {"x": "forward"}, history_len=1).update(np.float32([1.0]))
    assert warm.update(np.float32([3.0]), step_ok=False).scales_sync() == {"x": 128.0}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_donated_updates_write_one_value_per_slot_into_the_same_buffer(backend):
    """``update(donate=True)`` gives the same state as the pure update, and writes the ring in
    place: the history buffer is the old one, and only the slots' head positions changed."""
    torch = pytest.importorskip("torch") if backend == "torch" else None
    pure = fp8.create_fp8_scaler("te_delayed", SLOTS, backend=backend, history_len=8)
    donated = fp8.create_fp8_scaler("te_delayed", SLOTS, backend=backend, history_len=8)
    rng = np.random.default_rng(5)
    for t in range(20):
        amax = np.where(rng.random(3) < 0.3, 0.0, rng.uniform(0.1, 10, 3)).astype(np.float32)
        vector = torch.from_numpy(amax) if torch else amax
        before = np.array(host([donated.state.history])[0])
        buffer = donated.state.history
        heads = np.asarray(host([donated.state.head])[0]).copy()
        pure = pure.update(vector)
        donated = donated.update(vector, donate=True)
        assert donated.state.history is buffer, f"step {t}: a new history buffer"
        after = np.asarray(host([donated.state.history])[0])
        changed = np.argwhere(after.view(np.uint32) != before.view(np.uint32))
        assert all(column == heads[row] for row, column in changed), f"step {t}: wrote {changed} (heads {heads})"
        assert_same(donated.state, pure.state, f"step {t}")


@pytest.mark.parametrize("nan_rule", ["drop", "propagate"])
def test_jax_window_max_equals_the_bit_rule_on_both_of_its_paths(nan_rule):
    """JAX takes the window max with XLA's float ``max`` where every row's result is a positive
    normal, inf or nan, and with the bit rule otherwise: both must equal NumPy's bits, under
    ``jit`` and ``vmap`` (where ``lax.cond`` runs both), whatever the row holds."""
    jax = pytest.importorskip("jax")
    from ampscale.fp8._ops import make_ops

    special = np.float32(
        [0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 3e-38, 1.0, 448.0, np.inf, -np.inf, -1.0, -1e-40]
    )
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345], np.uint32).view(np.float32)
    rng = np.random.default_rng(7)
    pool = np.concatenate([special, nans])
    unsure = rng.choice(pool, size=(64, 5))  # zeros, subnormals, negatives: the bit rule
    unsure[:4] = np.float32(
        [
            [3e-39, 1e-45, 0.0, -1.0, 1e-40],
            [1e-40, 3e-39, -0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, -0.0, 1e-45],
            [-1.0, -2.0, 3e-39, 1.1754942e-38, 1e-40],
        ]
    )
    sure = unsure.copy()
    sure[:, 0] = rng.choice(np.concatenate([np.float32([1.5, 3e-38, 2.0**-126, np.inf]), nans]), size=64)
    numpy_ops, jax_ops = make_ops("numpy"), make_ops("jax")
    jitted = jax.jit(lambda bits: jax_ops.window_max(bits, nan_rule))
    mapped = jax.jit(jax.vmap(lambda row: jax_ops.window_max(row[None], nan_rule)[0]))
    for history in (sure, unsure, np.concatenate([sure, unsure[:1]])):
        want = numpy_ops.window_max(history, nan_rule).view(np.uint32)
        bits = jax_ops.enter(history)
        for got in (jitted(bits), mapped(bits)):
            assert (np.asarray(jax_ops.leave(got)).view(np.uint32) == want).all(), history


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_python_bool_step_flag_updates_as_on_numpy(preset, backend):
    """``step_ok`` as a Python ``True`` or ``False`` (the usual form outside a compiled step) on
    every preset: torch's operations take no Python bool where they want a tensor, so a
    ``False`` reached them and raised on three presets."""
    framework = pytest.importorskip(backend)
    config = make_fp8_config(preset, SLOTS, history_len=4)
    reference, state = fp8.init_state(config, "numpy"), fp8.init_state(config, backend)
    to_array = framework.tensor if backend == "torch" else framework.numpy.asarray
    for amax, ok in [([2.0, 0.5, 40.0], True), ([3.0, 0.0, 60.0], False), ([np.inf, 1.0, 7.0], False)]:
        reference, _ = fp8.update_state(config, reference, np.float32(amax), ok)
        state, _ = fp8.update_state(config, state, to_array(np.float32(amax)), ok)
        assert_same(state, reference, f"{preset} on {backend}, step_ok={ok}")
