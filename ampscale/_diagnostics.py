"""Diagnostics that cost nothing on good steps: an overflow report, counters, a doctor.

Diagnostics layer: above the scaler, whose counters it reads.

Nothing here runs unless called, and each function is a host read by design:

* :func:`diagnose` names the leaves that hold inf or nan (and says whether the scaled loss
  overflowed). Call it on a skipped step, and only then: ``if not scaler.outcome.applied``.
* :meth:`ampscale.Scaler.get_stats` returns the scaler's counters as plain values for logging.
* :func:`doctor` tells apart the causes of a scale that keeps falling or sits at its floor and
  says what to do about each.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from ampscale.backends import flatten_tree, get_backend
from ampscale.backends._base import name_leaves

if TYPE_CHECKING:
    from ampscale._scaler import Scaler

__all__ = ["Diagnosis", "LeafReport", "OverflowReport", "diagnose", "doctor"]


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One leaf that held non-finite values."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nan: int
    posinf: int
    neginf: int

    def __str__(self) -> str:
        kinds = [f"{n} {name}" for n, name in ((self.nan, "nan"), (self.posinf, "+inf"), (self.neginf, "-inf")) if n]
        return f"{self.path} ({self.dtype}{list(self.shape)}): {', '.join(kinds)}"


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Which leaves held inf or nan, and whether the scaled loss overflowed.

    Attributes:
        leaves: one entry per leaf with at least one non-finite value, in tree order.
        checked: the number of leaves examined.
        loss_finite: whether the scaled loss was finite (``None`` if no loss was given).
    """

    leaves: tuple[LeafReport, ...]
    checked: int
    loss_finite: bool | None

    @property
    def finite(self) -> bool:
        """Whether everything examined was finite."""
        return not self.leaves and self.loss_finite is not False

    def __str__(self) -> str:
        if self.finite:
            return f"all finite ({self.checked} leaves)"
        lines = []
        if self.loss_finite is False:
            lines.append("the scaled loss is not finite: the forward pass produced inf or nan")
        if self.leaves:
            lines.append(f"{len(self.leaves)} of {self.checked} leaves hold non-finite values:")
            lines += [f"  {leaf}" for leaf in self.leaves]
        return "\n".join(lines)


def diagnose(grads: Any, loss: Any = None, *, backend: Any = None) -> OverflowReport:
    """Report which leaves of ``grads`` hold inf or nan, and whether ``loss`` is finite.

    A host read over every leaf (a sync on GPUs). Call it only when a step was skipped, so
    good steps pay nothing::

        grads, finite = scaler.unscale(grads, loss=scaled_loss)
        if not bool(finite):
            print(ampscale.diagnose(grads, loss=scaled_loss))

    Example:
        >>> import numpy as np, ampscale
        >>> print(ampscale.diagnose({"w": np.array([1.0, np.nan]), "b": np.ones(2)}))
        1 of 2 leaves hold non-finite values:
          ['w'] (float64[2]): 1 nan
    """
    resolved, leaves, spec = flatten_tree(grads, None if backend is None else get_backend(backend))
    try:
        resolved.validate(leaves, spec)
        counts = resolved.count_nonfinite(leaves)
    except Exception as exc:  # an error naming leaves by index: name them by path too
        name_leaves(exc, lambda: resolved.leaf_paths(spec))
        raise
    paths = resolved.leaf_paths(spec)
    bad = tuple(
        LeafReport(paths[i], resolved.dtype_name(leaf), tuple(int(d) for d in leaf.shape), *counts[i])
        for i, leaf in enumerate(leaves)
        if any(counts[i])
    )
    loss_finite = None
    if loss is not None:
        resolved.validate((loss,), None, "loss")
        loss_finite = bool(resolved.all_finite([loss]))
    return OverflowReport(bad, len(leaves), loss_finite)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What :func:`doctor` concluded.

    Attributes:
        cause: ``"no steps"``, ``"healthy"``, ``"forward"`` (the scaled loss itself is not
            finite), ``"backward"`` (only gradients overflow), ``"floor"`` (the scale is at its
            floor and steps still overflow), or ``"underflow"`` (the scale is too low).
        advice: what to do, in a sentence or two.
        evidence: the numbers the conclusion rests on.
    """

    cause: str
    advice: str
    evidence: dict[str, Any]

    def __str__(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.evidence.items())
        return f"{self.cause}: {self.advice}\n  ({facts})"


def doctor(
    scaler: Scaler,
    report: OverflowReport | None = None,
    underflow: float | None = None,
    skip_rate_limit: float = 0.05,
) -> Diagnosis:
    """Explain why a scale keeps falling or sits at its floor, and what to do.

    Args:
        scaler: the scaler after some steps (its counters are read: a host read).
        report: optionally, a :func:`diagnose` report of a skipped step (names the leaves).
        underflow: optionally, an underflow fraction from ``unscale(..., underflow=True)``.
        skip_rate_limit: above this fraction of skipped steps, overflows are a problem rather
            than the scale calibrating itself.
    """
    stats = scaler.get_stats()
    evidence: dict[str, Any] = {
        key: stats[key]
        for key in ("steps", "skipped_steps", "loss_overflows", "grad_overflows", "scale", "floor_overflows")
    }
    if report is not None and report.leaves:
        evidence["non-finite leaves"] = [leaf.path for leaf in report.leaves[:5]]
    if underflow is not None:
        evidence["underflow"] = round(float(underflow), 4)
    if scaler.backend is not None and scaler.backend.name == "jax":  # the fast path in use, or why not
        evidence["jax custom call"] = str(importlib.import_module("ampscale.backends.jax").custom_call_status())
    steps, skipped = stats["steps"], stats["skipped_steps"]
    if steps == 0:
        return Diagnosis("no steps", "nothing to diagnose yet: call update() or step() first", evidence)
    loss_fault = stats["loss_overflows"] > 0 and stats["loss_overflows"] >= stats["grad_overflows"]
    if report is not None and report.loss_finite is False:
        loss_fault = True
    if stats["floor_overflows"] > 0:
        where = "the forward pass (the scaled loss is not finite)" if loss_fault else "the model's values"
        return Diagnosis(
            "floor",
            "the scale is at its floor and steps still overflow, so lowering it cannot help: the inf/nan come "
            f"from {where}, whatever the scale. Check for gradients that are never zeroed between steps, "
            "inputs with inf/nan, log/exp/division in the loss, and the learning rate; or train in bfloat16.",
            evidence,
        )
    if loss_fault:
        return Diagnosis(
            "forward",
            "the scaled loss itself is not finite: the forward pass produces inf or nan, which no scale fixes. "
            "Check the batch for inf/nan, log(0), division by zero and exp overflow in the loss, compute the "
            "loss in float32, or lower the learning rate.",
            evidence,
        )
    rate = skipped / steps
    evidence["skip_rate"] = round(rate, 4)
    if rate > skip_rate_limit:
        return Diagnosis(
            "backward",
            "only the gradients overflow, and often: a few skipped steps while the scale calibrates are normal, "
            f"a skip rate above {skip_rate_limit:.0%} is not. Find the layers (ampscale.diagnose), clip "
            "gradients, lower the learning rate, or cap the scale (max_scale) / grow it less often "
            "(growth_interval).",
            evidence,
        )
    if underflow is not None and underflow > 0.01:
        return Diagnosis(
            "underflow",
            f"{underflow:.1%} of the scaled gradient values are zero or subnormal: the scale is too low and "
            "small gradients are lost. Raise init_scale or min_scale, or grow more often (growth_interval).",
            evidence,
        )
    return Diagnosis("healthy", "overflows are rare and the scale is free to move: nothing to do.", evidence)
