"""The combination of amaxes across micro-batches (and ranks, and uses of a tensor).

:func:`combine_amax` merges two amaxes (arrays of any framework, numbers, or trees of them) by
a max that keeps nan: under gradient accumulation each micro-batch's amaxes are merged into a
running value and the FP8 history is written once per optimizer step, so no micro-batch's
amax is lost and none "wins" by being the last (marin-community/marin#7659).

The amaxes of many tensors are taken in one pass by :func:`ampscale.fp8.amax`
(:mod:`ampscale.fp8._fused`).
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ampscale.fp8._ops import framework_of

__all__ = ["combine_amax"]


def _is_leaf(value: Any) -> bool:
    return hasattr(value, "shape") or isinstance(value, numbers.Real)


def _max_keep_nan(a: Any, b: Any, where: str) -> Any:
    """The elementwise max of two amaxes of one framework, nan if either is nan."""
    if isinstance(a, numbers.Real) and isinstance(b, numbers.Real):
        if isinstance(a, bool) or isinstance(b, bool):
            raise TypeError(f"combine_amax: amaxes must be numbers or float arrays; got a bool at {where}")
        a, b = float(a), float(b)
        return math.nan if a != a or b != b else max(a, b)
    if isinstance(a, numbers.Real):
        a, b = b, a  # the array first: the number joins its framework
    framework = framework_of(a)
    if not isinstance(b, numbers.Real):
        if framework_of(b) != framework:
            raise TypeError(
                f"combine_amax: both amaxes must be arrays of one framework; got {type(a).__name__} and "
                f"{type(b).__name__} at {where}"
            )
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(
                f"combine_amax: the amaxes must have one shape (one value per slot); got {tuple(a.shape)} and "
                f"{tuple(b.shape)} at {where}"
            )
    elif isinstance(b, bool):
        raise TypeError(f"combine_amax: amaxes must be numbers or float arrays; got a bool at {where}")
    if framework == "torch":
        import torch

        other = b if not isinstance(b, numbers.Real) else torch.full_like(a, float(b))
        return torch.maximum(a, other)  # propagates nan
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.maximum(a, b)  # propagates nan
    if framework == "array_api":
        xp = a.__array_namespace__()
        other = b if not isinstance(b, numbers.Real) else xp.asarray(float(b), dtype=a.dtype)
        either_nan = xp.logical_or(xp.isnan(a), xp.isnan(other))
        return xp.where(either_nan, xp.asarray(math.nan, dtype=a.dtype), xp.maximum(a, other))
    xp = np if framework == "numpy" else sys.modules["cupy"]
    return xp.maximum(a, b)  # propagates nan


def combine_amax(a: Any, b: Any) -> Any:
    """Merge two amaxes by a max that keeps nan: arrays, numbers, or trees of them.

    Use it to accumulate the amaxes of micro-batches (or of ranks, or of the uses of a tensor
    inside one step) so that the FP8 history is written once per optimizer step with the
    largest of them. ``None`` is the identity (start an accumulation with ``acc = None``).

    Args:
        a, b: ``[N]`` (or any shape) float arrays of one framework, Python numbers, or trees
            (dicts, lists, tuples, named tuples; any pytree under JAX) of them with one structure.

    Returns:
        The elementwise max, with the structure and framework of the inputs: nan where either
        holds a nan (a micro-batch whose amax was nan stays visible to the update), inf where
        either holds an inf.

    Raises:
        TypeError: arrays of two frameworks, or bool values.
        ValueError: two structures or two shapes.

    Example:
        >>> import numpy as np, ampscale.fp8 as fp8
        >>> acc = None
        >>> for micro_batch_amax in (np.float32([3.0, 1.0]), np.float32([2.0, np.nan])):
        ...     acc = fp8.combine_amax(acc, micro_batch_amax)
        >>> acc
        array([ 3., nan], dtype=float32)
    """
    return _combine(a, b, "the root")


def _combine(a: Any, b: Any, where: str) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if _is_leaf(a) and _is_leaf(b):
        return _max_keep_nan(a, b, where)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            raise ValueError(f"combine_amax: the trees differ at {where}: keys {sorted(a)} and {sorted(b)}")
        merged = {key: _combine(a[key], b[key], f"{where}[{key!r}]") for key in a}
        return type(a)(merged) if type(a) is not dict else merged  # type: ignore[call-arg]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            raise ValueError(f"combine_amax: the trees differ at {where}: lengths {len(a)} and {len(b)}")
        items = [_combine(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))]
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            return type(a)(*items)
        return type(a)(items)
    if "jax" in sys.modules:  # a registered pytree (a flax FrozenDict, a dataclass, ...)
        import jax

        leaves_a, tree_a = jax.tree_util.tree_flatten(a)
        leaves_b, tree_b = jax.tree_util.tree_flatten(b)
        if tree_a != tree_b:
            raise ValueError(f"combine_amax: the trees differ at {where}: {tree_a} and {tree_b}")
        if not (len(leaves_a) == 1 and leaves_a[0] is a):
            pairs = enumerate(zip(leaves_a, leaves_b, strict=True))
            leaves = [_combine(x, y, f"{where} leaf {i}") for i, (x, y) in pairs]
            return jax.tree_util.tree_unflatten(tree_a, leaves)
    raise TypeError(
        f"combine_amax: amaxes must be float arrays, numbers, or trees of them (dicts, lists, tuples) with one "
        f"structure; got {type(a).__name__} and {type(b).__name__} at {where}"
    )
