"""The functional API: :func:`all_finite`, :func:`masked_add_` and :func:`masked_copy_` (scaler layer).

Functions over trees of arrays that need no scaler: the exact finiteness check of
:meth:`ampscale.Scaler.unscale` on its own, and the flag-aware in-place updates an ``update_fn``
of ``Scaler.step(..., in_place=True)`` writes with. Each finds its backend from the trees (or is
given one) and flattens each tree once (:func:`ampscale.backends.flatten_tree`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampscale._config import shown
from ampscale.backends import flatten_tree, get_backend
from ampscale.backends._base import check_flag, name_leaves

if TYPE_CHECKING:
    from ampscale.backends._base import Backend

__all__ = ["all_finite", "masked_add_", "masked_copy_"]


def all_finite(tree: Any, *, backend: Any = None) -> Any:
    """A 0-d bool array on the leaves' device: whether every element of every leaf is finite.

    Exact (inf, -inf and nan anywhere are found; no finite value is ever flagged) and fused
    like :meth:`Scaler.unscale`. An empty tree is finite.

    Example:
        >>> import numpy as np, ampscale
        >>> bool(ampscale.all_finite({"w": np.ones(3), "b": np.array([1.0, np.inf])}))
        False
    """
    resolved, leaves, spec = flatten_tree(tree, None if backend is None else get_backend(backend), what="leaves")
    try:
        resolved.validate(leaves, spec, "leaf")
        if not leaves:
            return resolved.as_bool(True)
        return resolved.all_finite(leaves)
    except Exception as exc:  # an error naming leaves by index: name them by path too
        name_leaves(exc, lambda: resolved.leaf_paths(spec))
        raise


def masked_add_(finite: Any, targets: Any, updates: Any, *, alpha: float = 1.0) -> Any:
    """``t += alpha * u`` in place for every pair of leaves, only where the 0-d flag ``finite``
    is true: the flag-aware in-place update (as torch's fused optimizers take ``found_inf``).

    Where ``finite`` is false every target keeps its bits, whatever ``updates`` hold (inf, nan).
    On a device (CuPy, torch on a GPU) it selects on the device: no host sync; on host backends
    an overflow costs nothing. With ``alpha=-lr`` this is SGD's ``p -= lr * g``, bit for bit.
    Use it inside an ``update_fn`` given to ``Scaler.step(..., in_place=True)``, or with the flag
    from :meth:`Scaler.unscale`.

    Args:
        finite: the step's 0-d bool flag (an array of the targets' framework, or a bool).
        targets: a tree of writable floating arrays, changed in place.
        updates: a tree of the same structure, with arrays of the same shapes.
        alpha: the factor of the updates (a real number).

    Returns:
        ``targets``.

    Raises:
        TypeError, ValueError: mismatched trees, shapes or frameworks, read-only targets, a flag
            that is not 0-d bool, or JAX arrays (immutable); nothing is changed.

    Example:
        >>> import numpy as np, ampscale
        >>> params, grads = [np.ones(3, np.float32)], [np.full(3, 2.0, np.float32)]
        >>> ampscale.masked_add_(np.bool_(True), params, grads, alpha=-0.5)[0]
        array([0., 0., 0.], dtype=float32)
        >>> ampscale.masked_add_(np.bool_(False), params, [np.full(3, np.inf, np.float32)])[0]
        array([0., 0., 0.], dtype=float32)
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a real number; got {type(alpha).__name__} {shown(alpha)}")
    try:
        factor = float(alpha)
    except OverflowError:
        raise ValueError(f"alpha must be a real number within the float range; got {shown(alpha)}") from None
    backend, target_leaves, update_leaves = _masked_arguments(finite, targets, updates, "updates")
    backend.masked_add_(finite, target_leaves, update_leaves, factor)
    return targets


def masked_copy_(finite: Any, targets: Any, values: Any) -> Any:
    """``t[...] = v`` in place for every pair of leaves, only where the 0-d flag ``finite`` is
    true (see :func:`masked_add_`): for optimizer state such as momentum, computed out of place
    and written back where the step is applied.

    Returns:
        ``targets``.

    Raises:
        TypeError, ValueError: as :func:`masked_add_`; nothing is changed.
    """
    backend, target_leaves, value_leaves = _masked_arguments(finite, targets, values, "values")
    backend.masked_copy_(finite, target_leaves, value_leaves)
    return targets


def _masked_arguments(finite: Any, targets: Any, others: Any, name: str) -> tuple[Backend, list[Any], list[Any]]:
    """Validate a masked update's arguments before anything changes."""
    check_flag(finite, "finite")
    backend, target_leaves, spec = flatten_tree(targets, what="targets")
    other_leaves, other_spec = backend.flatten(others)
    backend.validate(target_leaves, spec, "target")
    backend.validate(other_leaves, other_spec, name[:-1])
    if len(target_leaves) != len(other_leaves):
        raise ValueError(f"targets has {len(target_leaves)} leaves but {name} has {len(other_leaves)}; they must match")
    paths = backend.leaf_paths(spec) if target_leaves else []
    for path, target, other in zip(paths, target_leaves, other_leaves, strict=True):
        if tuple(target.shape) != tuple(other.shape):
            raise ValueError(
                f"target {path} has shape {tuple(target.shape)} but its {name[:-1]} has shape {tuple(other.shape)}"
            )
        flags = getattr(target, "flags", None)
        if flags is not None and getattr(flags, "writeable", True) is False:
            raise ValueError(f"target {path} is read-only; masked updates write into their targets")
    return backend, target_leaves, other_leaves
