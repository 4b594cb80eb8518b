"""Exceptions and warnings raised by ampscale.

Foundation layer: it imports nothing of ampscale.
"""

from __future__ import annotations

__all__ = [
    "AliasedGradientsError",
    "AmpscaleError",
    "AmpscaleWarning",
    "InPlaceUpdateError",
    "PerformanceWarning",
    "ScaleAtFloorError",
    "ScaleAtFloorWarning",
    "StateDictError",
]


class AmpscaleError(Exception):
    """Base class of the errors ampscale raises on purpose (bad settings raise ``ValueError``)."""


class ScaleAtFloorError(AmpscaleError):
    """The loss scale is at its floor and the steps keep overflowing.

    Raised by :meth:`ampscale.Scaler.update` when the scaler's ``on_floor`` reaction is
    ``"raise"`` (the default of the ``deepspeed`` preset, as DeepSpeed's ZeRO optimizers do).
    Lowering the scale cannot help any more: the forward pass itself is probably producing
    inf or nan (see :func:`ampscale.diagnose`).

    Attributes:
        scale: the scale (a Python float) when the overflow happened.
        consecutive: how many overflowing steps in a row happened at the floor.
        step: the number of ``update`` calls made before this one.
    """

    def __init__(self, message: str, *, scale: float, consecutive: int, step: int) -> None:
        super().__init__(message)
        self.scale = scale
        self.consecutive = consecutive
        self.step = step


class AliasedGradientsError(AmpscaleError, ValueError):
    """Two gradients share memory in part, so no unscale can change each value exactly once.

    Raised before anything changes. The same buffer given twice (the same array, or views of
    exactly the same elements with the same dtype) is not an error: it is unscaled once, and
    every place in the tree shows the result. Partial overlap (``[g, g[2:]]``), the same bytes
    seen as two dtypes, a read-only view of a gradient that is unscaled in place, or one array
    whose elements share memory with each other (a stride of 0) is refused.
    """


class InPlaceUpdateError(AmpscaleError, ValueError):
    """``Scaler.step``'s ``update_fn`` wrote into the arrays it was given, or returned them.

    On a device (CuPy, torch on a GPU, array-API namespaces) ``step`` computes the update before
    the overflow flag is known and keeps the old values leaf by leaf where the step overflowed,
    so an update written in place would already hold the overflowed step. It is refused on
    every backend whose arrays can be written (so a test on the CPU finds it). The first time
    ``step`` sees an ``update_fn`` it runs it once on copies and watches them (NumPy: made
    read-only, the write itself raises; torch: version counters; CuPy and other namespaces: the
    copies compared bit for bit afterwards, and returning a copy refused, since later calls
    cannot be watched there): a refusal then comes before anything changes. Every real call is
    watched too, where a write found has already happened. For an update in place, pass
    ``in_place=True`` and apply it with :func:`ampscale.masked_add_`.
    """


class StateDictError(AmpscaleError, ValueError):
    """A state dict given to ``load_state_dict`` is missing keys, ill-typed, or too new."""


class AmpscaleWarning(UserWarning):
    """Base class of the warnings ampscale emits."""


class ScaleAtFloorWarning(AmpscaleWarning):
    """The loss scale is at its floor and the steps keep overflowing (``on_floor="warn"``)."""


class PerformanceWarning(AmpscaleWarning):
    """A fast path is unavailable and a slower, still exact, path is used instead."""
