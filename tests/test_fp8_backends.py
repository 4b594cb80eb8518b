"""The FP8 transition on every backend: JAX (jit, scan, vmap) and torch equal NumPy bit for bit.

The same drawn amax streams and skipped steps go through every preset on NumPy, JAX and torch;
the states must agree field by field, bit for bit. The JAX scaler is a pytree (the config is
static), so the update runs inside ``jax.jit`` and ``lax.scan`` with no host transfer.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale.fp8 as fp8
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config
from tests.test_fp8_presets import amax_value, normal

# XLA's CPU flushes subnormal operands and results (a == 0 for 1e-45, 1 / FLT_MAX -> 0), which
# NumPy and torch keep, intermediate ones included (1 / 2**126 -> 0): the JAX comparison draws
# amaxes that make no subnormal (docs/fp8.md)
jax_amax_value = st.one_of(
    normal,
    st.floats(16384.0, float(np.float32(1e30)), width=32),
    st.sampled_from([0.0, float(np.float32(1e-30)), np.inf, np.nan]),
)
jax_steps = st.lists(st.tuples(st.lists(jax_amax_value, min_size=3, max_size=3), st.booleans()), min_size=6, max_size=6)
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(PRESETS), length=st.sampled_from([1, 2, 16]), steps=steps_strategy)
def test_torch_equals_numpy(preset, length, steps):
    torch = pytest.importorskip("torch")
    config = make_fp8_config(preset, SLOTS, history_len=length)
    reference, state = fp8.init_state(config, "numpy"), fp8.init_state(config, "torch")
    for amax, ok in steps:
        reference, _ = fp8.update_state(config, reference, np.float32(amax), ok)
        state, _ = fp8.update_state(config, state, torch.tensor(amax, dtype=torch.float32), torch.tensor(ok))
    assert_same(state, reference, f"{preset} L={length} {steps}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
