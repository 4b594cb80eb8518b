"""The JAX backend's check + unscale as plain XLA operations (no custom call).

Adapters' layer: the JAX adapter and the custom call's fallback both use it.

The pure-XLA path of :mod:`ampscale.backends.jax`, and the lowering the fused custom call
(:mod:`ampscale.backends._jax_custom_call`) falls back to where it cannot run: both import it from
here, so neither reaches into the other.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["all_finite", "check_and_unscale_xla", "unscale"]


def unscale(x: Any, inv_scale: Any) -> Any:
    """``x * inv_scale`` in float32 opmath (float64 for float64), back in ``x``'s dtype."""
    if x.dtype == jnp.float64:
        return x * inv_scale.astype(jnp.float64)
    return (x.astype(jnp.float32) * inv_scale).astype(x.dtype)


def check_and_unscale_xla(leaves: list[Any], inv_scale: Any) -> tuple[list[Any], Any]:
    """The pure-XLA path: each leaf unscaled by XLA, and the exact flag of the unscaled values."""
    outs = [unscale(x, inv_scale) for x in leaves]
    return outs, all_finite(outs)


def all_finite(leaves: list[Any]) -> Any:
    """Exact and overflow-proof: sum(x * 0) is 0 when every x is finite, nan otherwise.

    Same-shaped leaves are added elementwise in a balanced tree (XLA fuses it into one pass over
    them) before a single reduction per shape, which keeps thousands of leaves to a handful of
    reductions: fast to compile and to run.
    """
    if not leaves:
        return jnp.asarray(True)
    by_shape: dict[tuple[int, ...], list[Any]] = {}
    for x in leaves:
        zero = (x * 0).astype(jnp.float32) if x.dtype != jnp.float64 else x * 0
        by_shape.setdefault(tuple(x.shape), []).append(zero)
    totals = []
    for zeros in by_shape.values():
        while len(zeros) > 1:
            zeros = [zeros[i] + zeros[i + 1] if i + 1 < len(zeros) else zeros[i] for i in range(0, len(zeros), 2)]
        totals.append(jnp.sum(zeros[0]).astype(jnp.float32))
    total = totals[0]
    for t in totals[1:]:
        total = total + t
    return jnp.logical_not(jnp.isnan(total))
