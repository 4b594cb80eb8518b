"""The scaler state machine: one pure transition, written once for every backend.

State machine layer: it imports only the foundation, and declares the small ``Ops`` interface it
runs on.

The state is a :class:`ScalerState` of 0-d values (arrays on the device of the gradients, or
host scalars for host-resident backends). :func:`transition` maps ``(config, state, finite,
loss_finite)`` to the next state with array-API operations only (``where``, ``maximum``,
``minimum``, ``isfinite``): no Python branch on a value, no host transfer, so it traces under
``jax.jit`` and runs asynchronously on GPUs. Python ``if`` appears only on the static config.

The algorithm, for one call of ``update(finite, loss_finite=...)`` in ``mode="dynamic"``::

    finite = finite and loss_finite          # a non-finite scaled loss is an overflow
    t, h, s = growth_tracker, hysteresis_tracker, scale
    if finite:
        t = t + 1
        reached = (t == interval)            # "equal"; "at_least": t >= interval
        if reached:
            s = grow(s)                      # s * growth_factor, guarded by the ceiling rule
            t = 0                            # "modulo": t = t % interval in every case
            h = hysteresis                   # the overflow budget refills when the scale grows
        elif hysteresis_mode in ("consecutive", "every_n"):
            h = hysteresis                   # ... or on every finite step
    else:
        t = -first_growth_delay              # an overflow restarts the growth count
        h = h - 1
        if h <= 0:                           # the budget is spent: back off
            s = max(s * backoff_factor, min_scale)    # or s / growth_factor ("divide")
            if hysteresis_mode == "every_n":
                h = hysteresis

``grow(s)`` computes ``s * growth_factor`` (in float64 where the backend has it, then rounded
to the scale dtype). With ``ceiling="skip"`` a result that is not finite or exceeds
``max_scale`` leaves ``s`` unchanged; with ``ceiling="clamp"`` it is clamped to ``max_scale``.
``mode="static"`` and ``mode="guard"`` never move the scale; every mode counts steps, skipped
steps and their reasons, and records the scale before the step for the step outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from ampscale._config import ScalerConfig

__all__ = ["REASONS", "Ops", "ScalerState", "initial_values", "transition"]

#: ``last_reason`` codes: why the last step was applied or skipped.
NO_STEP, APPLIED, LOSS_OVERFLOW, GRADIENT_OVERFLOW = -1, 0, 1, 2
REASONS = {NO_STEP: "no step yet", APPLIED: "applied", LOSS_OVERFLOW: "loss", GRADIENT_OVERFLOW: "gradients"}


class ScalerState(NamedTuple):
    """The dynamic state of a scaler: 0-d values only (a pytree of leaves under JAX).

    Attributes:
        scale: the current loss scale (float32, or float64 for the float64 presets).
        growth_tracker: finite steps counted towards the next growth (int32).
        hysteresis_tracker: overflows still absorbed before the next backoff (int32).
        steps: ``update`` calls so far (int32, saturating).
        skipped_steps: steps skipped because something was not finite.
        loss_overflows: skipped steps whose scaled loss was not finite.
        grad_overflows: skipped steps whose loss was finite but some gradient was not.
        growths: times the growth interval was reached on a finite step.
        backoffs: times the scale was backed off (overflows absorbed by hysteresis excluded).
        floor_overflows: backoffs in a row that happened with the scale already at its floor.
        last_scale: the scale the last step ran with (before its update).
        last_reason: -1 no step yet, 0 applied, 1 loss overflow, 2 gradient overflow.
    """

    scale: Any
    growth_tracker: Any
    hysteresis_tracker: Any
    steps: Any
    skipped_steps: Any
    loss_overflows: Any
    grad_overflows: Any
    growths: Any
    backoffs: Any
    floor_overflows: Any
    last_scale: Any
    last_reason: Any


#: Fields stored as integers; the others are scales. (Host backends rely on this field order.)
INT_FIELDS = frozenset(ScalerState._fields) - {"scale", "last_scale"}
assert ScalerState._fields.index("scale") == 0
assert ScalerState._fields.index("last_scale") == 10


class Ops(Protocol):
    """The operations :func:`transition` is written against, on 0-d values of one backend.

    :class:`ampscale._ops.HostOps` implements them on Python scalars, :class:`ampscale._ops.ArrayOps`
    on any array-API namespace, and :mod:`ampscale._codegen` on symbols it traces (to emit the
    transition as straight-line Python and C). Comparisons and ``%`` are the values' own operators.
    """

    def as_bool(self, value: Any) -> Any:
        """``value`` (a flag) as a 0-d bool."""
        ...

    def logical_and(self, a: Any, b: Any) -> Any: ...

    def logical_or(self, a: Any, b: Any) -> Any: ...

    def logical_not(self, a: Any) -> Any: ...

    def where(self, condition: Any, a: Any, b: Any) -> Any:
        """``a`` where ``condition`` is true, else ``b`` (both computed: no branch on a value)."""
        ...

    def false(self) -> Any:
        """A 0-d false."""
        ...

    def int32(self, value: int) -> Any:
        """A 0-d int32 constant."""
        ...

    def scale_constant(self, value: float) -> Any:
        """A 0-d constant of the scale's dtype."""
        ...

    def saturating_increment(self, value: Any) -> Any:
        """``value + 1`` for an int32, staying at the int32 maximum."""
        ...

    def saturating_decrement(self, value: Any) -> Any:
        """``value - 1`` for an int32, staying at the int32 minimum."""
        ...

    def saturating_add(self, value: Any, flag: Any) -> Any:
        """``value + flag`` (a bool counted as 0 or 1) for an int32, saturating."""
        ...

    def grow(self, scale: Any) -> Any:
        """The grown scale (the growth factor and the ceiling rule of the config)."""
        ...

    def shrink(self, scale: Any) -> Any:
        """The backed-off scale (the backoff factor, never below the floor)."""
        ...


def initial_values(config: ScalerConfig) -> ScalerState:
    """The initial state as Python scalars (backends turn them into their 0-d arrays)."""
    scale = config.initial_scale
    return ScalerState(
        scale=scale,
        growth_tracker=-config.first_growth_delay,
        hysteresis_tracker=config.hysteresis,
        steps=0,
        skipped_steps=0,
        loss_overflows=0,
        grad_overflows=0,
        growths=0,
        backoffs=0,
        floor_overflows=0,
        last_scale=scale,
        last_reason=NO_STEP,
    )


def transition(
    config: ScalerConfig, state: ScalerState, finite: Any, loss_finite: Any, ops: Ops
) -> tuple[ScalerState, Any]:
    """Return the state after one step, and whether that step overflowed at the scale's floor.

    Args:
        config: the static settings.
        state: the current state, in ``ops``'s value type.
        finite: 0-d bool, true when the step's gradients were all finite.
        loss_finite: 0-d bool, true when the scaled loss was finite (``True`` when unchecked);
            false makes the step an overflow (reason "loss") even if ``finite`` is true.
        ops: the operations of the backend holding ``state``.

    Returns:
        ``(next_state, floor_event)``; ``floor_event`` is a 0-d bool that is true when the step
        backed off (or would have) with the scale already at its floor.
    """
    loss_ok = ops.as_bool(loss_finite)
    # a scaled loss that is not finite makes the step an overflow, whatever the gradients said
    ok = ops.logical_and(ops.as_bool(finite), loss_ok)
    bad = ops.logical_not(ok)
    scale = state.scale
    tracker = state.growth_tracker
    budget = state.hysteresis_tracker

    if config.dynamic:
        counted = ops.saturating_increment(tracker)
        if config.counter_rule == "at_least":
            reached = counted >= config.interval
        else:
            reached = counted == config.interval
        grow = ops.logical_and(ok, reached)
        if config.counter_rule == "modulo":
            tracker_if_ok = counted % config.interval
        else:
            tracker_if_ok = ops.where(reached, ops.int32(0), counted)
        new_tracker = ops.where(ok, tracker_if_ok, ops.int32(-config.first_growth_delay))

        spent = ops.saturating_decrement(budget)
        backoff = ops.logical_and(bad, spent <= 0)
        full = ops.int32(config.hysteresis)
        if config.hysteresis_mode == "cumulative":
            new_budget = ops.where(grow, full, ops.where(bad, spent, budget))
        elif config.hysteresis_mode == "consecutive":
            new_budget = ops.where(ok, full, spent)
        else:  # every_n
            new_budget = ops.where(ops.logical_or(ok, backoff), full, spent)

        grown = ops.grow(scale)
        shrunk = ops.shrink(scale)
        new_scale = ops.where(grow, grown, ops.where(backoff, shrunk, scale))
    else:
        grow = ops.false()
        backoff = ops.false()
        new_tracker, new_budget, new_scale = tracker, budget, scale

    at_floor = scale == ops.scale_constant(config.floor_value)
    if config.dynamic:
        # An overflow with the scale at its floor, that the hysteresis budget did not absorb.
        floor_event = ops.logical_and(backoff, at_floor)
    else:
        floor_event = ops.false()
    floor_overflows = ops.where(
        ok,
        ops.int32(0),
        ops.where(floor_event, ops.saturating_increment(state.floor_overflows), state.floor_overflows),
    )
    loss_bad = ops.logical_and(bad, ops.logical_not(loss_ok))
    grad_bad = ops.logical_and(bad, loss_ok)
    reason = ops.where(ok, ops.int32(0), ops.where(loss_ok, ops.int32(2), ops.int32(1)))
    next_state = ScalerState(
        scale=new_scale,
        growth_tracker=new_tracker,
        hysteresis_tracker=new_budget,
        steps=ops.saturating_increment(state.steps),
        skipped_steps=ops.saturating_add(state.skipped_steps, bad),
        loss_overflows=ops.saturating_add(state.loss_overflows, loss_bad),
        grad_overflows=ops.saturating_add(state.grad_overflows, grad_bad),
        growths=ops.saturating_add(state.growths, grow),
        backoffs=ops.saturating_add(state.backoffs, backoff),
        floor_overflows=floor_overflows,
        last_scale=scale,
        last_reason=reason,
    )
    return next_state, floor_event
