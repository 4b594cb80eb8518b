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
