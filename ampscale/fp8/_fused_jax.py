"""The fused FP8 pass on JAX arrays (see :mod:`ampscale.fp8._fused`), traceable under ``jit``.

The amax is the kernels' bit arithmetic in XLA operations: each leaf bitcast to unsigned
integers, its sign bit cleared, reduced with an integer max, converted to float32 once (a NaN made
canonical). No float compare is involved, so XLA's flushing of subnormals on the CPU changes
nothing: the amax of a leaf of subnormals is its largest subnormal. The cast is
:func:`ampscale.fp8.quantize` itself (XLA's own multiply, clip and convert).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ampscale.fp8._cast import quantize
from ampscale.fp8._config import FORMATS
from ampscale.fp8._fused import check_scales

__all__ = ["all_finite", "amax", "amax_cast", "xla_amax"]

#: itemsize -> (the unsigned type of that size, the mask that clears the sign bit)
_BITS = {2: (jnp.uint16, 0x7FFF), 4: (jnp.uint32, 0x7FFFFFFF), 8: (jnp.uint64, (1 << 63) - 1)}


def _xla_amax_one(x: Any) -> Any:
    dtype = np.dtype(x.dtype)
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    unsigned, mask = _BITS[dtype.itemsize]
    top = jnp.max(lax.bitcast_convert_type(x, unsigned) & unsigned(mask))
    if dtype.itemsize == 8:
        value = lax.bitcast_convert_type(top, jnp.float64).astype(jnp.float32)
    else:
        value = lax.bitcast_convert_type(top, dtype).astype(jnp.float32)
    return jnp.where(jnp.isnan(value), jnp.float32(np.nan), value)  # the canonical quiet NaN


def xla_amax(leaves: Sequence[Any]) -> Any:
    """The ``[N]`` float32 amaxes of ``leaves`` in XLA operations (one reduction per leaf)."""
    return jnp.stack([_xla_amax_one(x) for x in leaves])


def amax(leaves: Sequence[Any]) -> Any:
    """The ``[N]`` float32 amaxes of JAX ``leaves``."""
    return xla_amax(leaves)


def all_finite(amaxes: Any) -> Any:
    """True (0-d bool) when every amax is finite."""
    return jnp.all(jnp.isfinite(amaxes))


def amax_cast(leaves: Sequence[Any], scales: Any, fmt: str, divide: bool) -> tuple[list[Any], Any, Any]:
    """``(payloads, amaxes, clipped)`` of JAX ``leaves``; clipped counts are int32 without x64."""
    check_scales(scales, len(leaves), "jax")
    bound = jnp.float32(FORMATS[fmt])
    payloads, counts = [], []
    for k, x in enumerate(leaves):
        payloads.append(quantize(x, scales[k], fmt, divide=divide))
        wide = x.astype(jnp.float32)
        product = wide / scales[k] if divide else wide * scales[k]
        counts.append(jnp.sum(jnp.abs(product) > bound))
    return payloads, amax(leaves), jnp.stack(counts)

