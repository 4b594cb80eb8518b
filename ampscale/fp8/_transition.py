"""The FP8 scaling state machine: one pure transition per slot, written once for every backend.

The state is an :class:`Fp8State` of arrays over ``N`` slots (a pytree under JAX). The history
holds the last ``history_len`` amaxes of each slot in canonical order, oldest first, newest
last; a later ring buffer changes only where they live, never what a checkpoint holds.
:func:`slot_transition` maps one slot's values, its amax, its format's largest value and the
step's flag to its next values, with the operations of an ``ops`` object only (``where``,
``div``, ``push``, ``window_max``, ...): no Python branch on a value, so the same code runs
vectorised over ``[N]`` arrays (NumPy, JAX, torch, CuPy) and traces into one straight-line
function (:mod:`ampscale.fp8._codegen`) that is emitted as Python and as C. Python ``if`` runs
on the static config only.

The algorithm, for one slot and one call of ``update(amax, step_ok)``::

    record = step_ok or on_skipped_step == "record"
    write  = record and not (zero_amax == "skip" and a == 0)
                    and not (nonfinite_amax == "skip" and a is inf or nan)
    h'     = h[1:] + [a] if write else h               # oldest out, newest in
    m      = a                        if amax_algo in ("current", "most_recent")
             window_max(h')           if timing == "after_write"   (drop or propagate nan)
             window_max(h)            if timing == "before_write"  (Keras)
    m      = 0 if m is subnormal and (subnormals == "flush"              (XLA on the CPU, eager)
                or subnormals == "flush_window" and m is a window's max)   (XLA's reduction, jitted)
    m      = eps if m < eps (scale_rule != "float64")
    s      = scale_rule(m)            # f32(f32(fp8_max * 2**-margin) / m), ...
    s      = s if m is finite and > 0 else {keep: old scale, one: 1, formula: s}
    s      = FLT_MAX if s is inf and inf_scale == "flt_max"
    s      = pow2(s)                  # mask | floor_log2 | none
    if storage == "scale":   scale, scale_inv = s, 1/s
    else:                    scale_inv = 1/s; scale = 1/scale_inv     (flax, Keras)
    updated = write if timing == "after_write" and amax_algo != "current" else record
    keep everything but h' and the counters when not updated

Every division is one correctly rounded float32 division (``"float64"``: float64, rounded
once to float32), so NumPy, JAX, torch, the emitted Python and the emitted C agree bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from ampscale._config import FLOAT32_MAX

if TYPE_CHECKING:
    from ampscale.fp8._config import Fp8Config

__all__ = ["Fp8Slot", "Fp8State", "initial_state_values", "slot_transition"]


class Fp8State(NamedTuple):
    """The dynamic state of an FP8 scaler over ``N`` slots (a pytree of arrays under JAX).

    Attributes:
        scale: ``[N]`` float32, the quantization scale: ``q = saturate(x * scale)``.
        scale_inv: ``[N]`` float32, the dequantization scale: ``x ~ q * scale_inv``.
        history: ``[N, history_len]`` float32, the last amaxes, oldest first.
        filled: ``[N]`` int32, amaxes written into the history so far (saturating).
        zero_amax: ``[N]`` int32, updates whose amax was 0 (a tensor that did not run).
        nonfinite: ``[N]`` int32, updates whose amax was inf or nan.
        steps: 0-d int32, ``update`` calls so far (saturating).
    """

    scale: Any
    scale_inv: Any
    history: Any
    filled: Any
    zero_amax: Any
    nonfinite: Any
    steps: Any


class Fp8Slot(NamedTuple):
    """One slot's values (or ``[N]`` arrays of them): the per-slot fields of :class:`Fp8State`."""

    scale: Any
    scale_inv: Any
    history: Any
    filled: Any
    zero_amax: Any
    nonfinite: Any


#: fields of a slot that are counters (int32); scale and scale_inv are float32
SLOT_INT_FIELDS = ("filled", "zero_amax", "nonfinite")


def initial_state_values(config: Fp8Config) -> dict[str, Any]:
    """The initial value of every slot field, as Python scalars (history: its fill value)."""
    return {"scale": 1.0, "scale_inv": 1.0, "history": 0.0, "filled": 0, "zero_amax": 0, "nonfinite": 0}


def slot_transition(
    config: Fp8Config, slot: Fp8Slot, amax: Any, fp8_max: Any, step_ok: Any, ops: Any
) -> tuple[Fp8Slot, Any]:
    """Return one slot's values after an update, and whether its scale was recomputed.

    Args:
        config: the static settings.
        slot: the slot's values, in ``ops``'s value type.
        amax: the slot's amax for this step (float32; max over micro-batches and ranks).
        fp8_max: the largest finite value of the slot's format (float32).
        step_ok: true when the loss scaler applies this step (its gradients were finite).
        ops: the operations of the backend holding the values.

    Returns:
        ``(next_slot, updated)``.
    """
    c = config
    zero = ops.f32(0.0)
    a = amax
    finite_a = ops.isfinite(a)
    zero_a = a == zero

    if c.on_skipped_step == "record":
        record = ops.true()
    else:
        record = ops.as_bool(step_ok)
    write = record
    if c.zero_amax == "skip":
        write = ops.logical_and(write, ops.logical_not(zero_a))
    if c.nonfinite_amax == "skip":
        write = ops.logical_and(write, finite_a)
    history = ops.push(slot.history, a, write)

    if c.amax_algo in ("current", "most_recent"):
        m = a
    elif c.timing == "after_write":
        m = ops.window_max(history, c.history_nan)
    else:
        m = ops.window_max(slot.history, c.history_nan)
    window = c.amax_algo == "max" and c.history_len > 1
    if c.subnormals == "flush" or (c.subnormals == "flush_window" and window):
        m = ops.flush(m)
    if c.scale_rule != "float64" and c.eps_value > 0.0:
        eps = ops.f32(c.eps_value)
        m = ops.where(m < eps, eps, m)  # nan compares false and stays nan

    if c.scale_rule == "divide":
        # TE: scaled_max = fp8_max * std::pow(2.f, -margin) in float, exact for integer margins
        candidate = ops.div(ops.mul(fp8_max, ops.f32(2.0**-c.margin)), m)
    elif c.scale_rule == "reciprocal":
        # torch's float / tensor is tensor.reciprocal() * float: two roundings
        candidate = ops.div(ops.mul(ops.div(ops.f32(1.0), m), fp8_max), ops.f32(2.0**c.margin))
    elif c.scale_rule == "divide_then_margin":
        candidate = ops.div(ops.div(fp8_max, m), ops.f32(2.0**c.margin))
    else:  # float64: torchao's amax_to_scale
        candidate = ops.div_wide(fp8_max, m, c.eps_value)

    if c.bad_amax != "formula":
        m_ok = ops.logical_and(ops.isfinite(m), m > zero)
        fallback = slot.scale if c.bad_amax == "keep" else ops.f32(1.0)
        candidate = ops.where(m_ok, candidate, fallback)
    if c.inf_scale == "flt_max":
        candidate = ops.where(ops.isinf(candidate), ops.f32(FLOAT32_MAX), candidate)
    if c.pow2 == "mask":
        candidate = ops.pow2_mask(candidate)
    elif c.pow2 == "floor_log2":
        candidate = ops.pow2_floor_log2(candidate)

    one = ops.f32(1.0)
    if c.storage == "scale":
        new_scale = ops.flush(candidate) if c.subnormals == "flush" else candidate
        new_inv = ops.div(one, new_scale)
        if c.subnormals == "flush":
            new_inv = ops.flush(new_inv)
    else:
        new_inv = ops.div(one, candidate)
        if c.subnormals == "flush":
            new_inv = ops.flush(new_inv)
        new_scale = ops.div(one, new_inv)

    if c.amax_algo == "current" or c.timing == "before_write":
        updated = record
    else:
        updated = write
    nonfinite_a = ops.logical_not(finite_a)
    next_slot = Fp8Slot(
        scale=ops.where(updated, new_scale, slot.scale),
        scale_inv=ops.where(updated, new_inv, slot.scale_inv),
        history=history,
        filled=ops.saturating_add(slot.filled, write),
        zero_amax=ops.saturating_add(slot.zero_amax, zero_a),
        nonfinite=ops.saturating_add(slot.nonfinite, nonfinite_a),
    )
    return next_slot, updated
