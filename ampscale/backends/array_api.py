"""Generic backend for any namespace that follows the Python array API standard.

Adapters' layer.

Used for namespaces ampscale has no dedicated adapter for (proven with ``array_api_strict``,
the standard's reference implementation). Only standard functions are used: the unscale is an
out-of-place multiply in the array's own dtype, the check is ``all(isfinite(out))`` of each
array returned (exact, no sum that could overflow), and the state is 0-d arrays on the
gradients' device, updated by the shared transition with ``where``/``maximum``/``minimum``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ampscale.backends._base import Backend, ReadOnlyGuard, WriteGuard, read_only

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["ArrayApiBackend"]


class ArrayApiBackend(Backend):
    """Adapter for one array-API namespace ``xp``."""

    name: ClassVar[str] = "array_api"

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.name = getattr(xp, "__name__", "array_api")  # type: ignore[misc]
        self._types: set[type] = set()

    def owns(self, value: Any) -> bool:
        namespace = getattr(value, "__array_namespace__", None)
        if namespace is None:
            return False
        try:
            return namespace() is self.xp
        except Exception:
            return False

    def owns_type(self, kind: type) -> bool:
        return kind in self._types

    def validate(self, leaves: Sequence[Any], spec: Any, what: str = "gradient") -> set[Any] | None:
        for leaf in leaves:  # learn this namespace's array types from one instance each
            kind = type(leaf)
            if kind not in self._types and self.owns(leaf):
                self._types.add(kind)
        return super().validate(leaves, spec, what)

    def is_floating_dtype(self, dtype: Any) -> bool:
        xp = self.xp
        if hasattr(xp, "isdtype"):
            return bool(xp.isdtype(dtype, "real floating"))
        return dtype in (xp.float32, xp.float64)

    def namespace(self) -> Any:
        return self.xp

    def device_of(self, like: Any) -> Any:
        if like is None:
            return None
        return getattr(like, "device", None)

    @contextlib.contextmanager
    def guard_writes(self, arrays: Sequence[Any]) -> Iterator[WriteGuard]:
        # Namespaces whose arrays hold a NumPy array (array_api_strict's ``_array``) can be made
        # read-only for the call: a write raises before it changes anything. Others cannot say.
        held = [getattr(a, "_array", None) for a in arrays]
        if not arrays or not all(isinstance(h, np.ndarray) for h in held):
            yield WriteGuard(exact=False)
            return
        with read_only(arrays, lambda a: a._array):
            yield ReadOnlyGuard(exact=True)

    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        # NumPy-backed namespaces warn when a multiply overflows to inf (a scale below 1): that
        # inf is the arithmetic asked for, and the flag reports it.
        with np.errstate(over="ignore", invalid="ignore"):
            return self._check_and_unscale(leaves, inv_scale)

    def _check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        xp = self.xp
        finite = None
        out = []
        for leaf in leaves:
            unscaled = leaf if inv_scale is None else leaf * xp.astype(inv_scale, leaf.dtype)
            # the values returned are checked: below a scale of 1 a finite input may overflow
            leaf_finite = xp.all(xp.isfinite(unscaled))
            finite = leaf_finite if finite is None else xp.logical_and(finite, leaf_finite)
            out.append(unscaled)
        if finite is None:
            finite = xp.asarray(True)
        return out, finite
