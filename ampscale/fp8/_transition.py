"""The FP8 scaling state machine: one pure transition per slot, written once for every backend.

The state is an :class:`Fp8State` of arrays over ``N`` slots (a pytree under JAX). The history
of each slot is a ring buffer of its last ``history_len`` amaxes: an update writes one value at
the slot's ``head`` and moves the head on, so no backend ever rolls an ``[N, L]`` array; the
canonical order (oldest first, newest last) appears only in checkpoints and in the accessors
that return a history (:func:`canonical_history`). :func:`slot_transition` maps one slot's
values, its amax, its format's largest value and the step's flag to its next values, with the
operations of an ``ops`` object only (``where``, ``div``, ``push``, ``window_max``, ...): no
Python branch on a value, so the same code runs vectorised over ``[N]`` arrays (NumPy, JAX,
torch, CuPy) and traces into one straight-line function (:mod:`ampscale.fp8._codegen`) that is
emitted as Python and as C. Python ``if`` runs on the static config only.

The algorithm, for one slot and one call of ``update(amax, step_ok)``::

    a      = inf if a is nan and amax_nan == "inf"                     (MS-AMP)
    record = step_ok or on_skipped_step == "record"
    write  = record and not (zero_amax == "skip" and a == 0)
                    and not (nonfinite_amax == "skip" and a is inf or nan)
    v      = 0 if nonfinite_amax == "zero" and a is inf or nan else a  (MS-AMP)
    h[head] = v; head = (head + 1) % L           if write             # the ring: one write
    h[old head - 1] = v                          if write and warmup == "first_amax" and filled == 0
    m      = v                        if amax_algo in ("current", "most_recent")
             window_max(h')           if timing == "after_write"   (drop or propagate nan)
             window_max(h)            if timing == "before_write"  (Keras)
    m      = 0 if m is subnormal and (subnormals == "flush"              (XLA on the CPU, eager)
                or subnormals == "flush_window" and m is a window's max)   (XLA's reduction, jitted)
    m      = eps if m < eps (scale_rule != "float64")
    s      = scale_rule(m)            # f32(f32(fp8_max * 2**-margin) / m), ...
    s      = s if m is finite and > 0 else {keep: old scale, one: 1, formula: s}
    s      = {flt_max, bf16_max, fp16_max}[inf_scale] if s is inf and inf_scale != "none"
    s      = pow2(s)                  # mask | floor_log2 | none
    if storage == "scale":   scale, scale_inv = s, 1/s
    else:                    scale_inv = 1/s; scale = 1/scale_inv     (flax, Keras)
    updated = write if timing == "after_write" and amax_algo != "current" else record
    filled = 0 if write and nonfinite_amax == "zero" and a is inf or nan else filled + write
    keep everything but the history, the head and the counters when not updated

With ``warmup="window"`` (MS-AMP) a slot still in its warm-up first takes the scale of its own
amax (the cast ran in time and replaced the scale), which the window's rule then falls back to,
and which a skipped step keeps.

Every division is one correctly rounded float32 division (``"float64"``: float64, rounded
once to float32), so NumPy, JAX, torch, the emitted Python and the emitted C agree bit for bit.
Casts in a warm-up (``warmup != "none"``) scale by the tensor's own amax with the same rule
(:func:`warmup_scale`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from ampscale.fp8._config import INF_SCALE_VALUES

if TYPE_CHECKING:
    from ampscale.fp8._config import Fp8Config

__all__ = ["Fp8Slot", "Fp8State", "canonical_order", "initial_state_values", "slot_transition", "warmup_scale"]


class Fp8State(NamedTuple):
    """The dynamic state of an FP8 scaler over ``N`` slots (a pytree of arrays under JAX).

    Attributes:
        scale: ``[N]`` float32, the quantization scale: ``q = saturate(x * scale)``.
        scale_inv: ``[N]`` float32, the dequantization scale: ``x ~ q * scale_inv``.
        history: ``[N, history_len]`` float32, the last amaxes of each slot as a ring buffer:
            the oldest at ``head``, the newest just before it (see :func:`canonical_order`).
        filled: ``[N]`` int32, amaxes written into the history so far (saturating; MS-AMP's
            preset restarts it at a non-finite amax, as its warm-up counter does).
        zero_amax: ``[N]`` int32, updates whose amax was 0 (a tensor that did not run).
        nonfinite: ``[N]`` int32, updates whose amax was inf or nan.
        steps: 0-d int32, ``update`` calls so far (saturating).
        head: ``[N]`` int32, where each slot's ring writes next. ``None`` (a state built by hand
            in canonical order) reads as 0.
    """

    scale: Any
    scale_inv: Any
    history: Any
    filled: Any
    zero_amax: Any
    nonfinite: Any
    steps: Any
    head: Any = None


class Fp8Slot(NamedTuple):
    """One slot's values (or ``[N]`` arrays of them): the per-slot fields of :class:`Fp8State`."""

    scale: Any
    scale_inv: Any
    history: Any
    filled: Any
    zero_amax: Any
    nonfinite: Any
    head: Any


#: fields of a slot that are counters (int32); scale and scale_inv are float32
SLOT_INT_FIELDS = ("filled", "zero_amax", "nonfinite", "head")


def initial_state_values(config: Fp8Config) -> dict[str, Any]:
    """The initial value of every slot field, as Python scalars (history: its fill value)."""
    return {"scale": 1.0, "scale_inv": 1.0, "history": 0.0, "filled": 0, "zero_amax": 0, "nonfinite": 0, "head": 0}


def canonical_order(head: int, length: int) -> list[int]:
    """The positions of a ring's values, oldest first: ``head, head + 1, ..., head - 1`` (mod L)."""
    return [(head + i) % length for i in range(length)]


def _scale_rule(config: Fp8Config, m: Any, scale: Any, fp8_max: Any, ops: Any, margin: int | None = None) -> Any:
    """The new scale for the window's amax ``m`` (its bad values included), before storage."""
    c = config
    margin = c.margin if margin is None else margin
    zero = ops.f32(0.0)
    one = ops.f32(1.0)
    if c.scale_rule != "float64" and c.eps_value > 0.0:
        eps = ops.f32(c.eps_value)
        m = ops.where(ops.less(m, eps), eps, m)  # nan compares false and stays nan

    if c.scale_rule == "divide":
        # TE: scaled_max = fp8_max * std::pow(2.f, -margin) in float, exact for integer margins
        candidate = ops.div(ops.mul(fp8_max, ops.f32(2.0**-margin)), m)
    elif c.scale_rule == "reciprocal":
        # torch's float / tensor is tensor.reciprocal() * float: two roundings
        candidate = ops.div(ops.mul(ops.div(one, m), fp8_max), ops.f32(2.0**margin))
    elif c.scale_rule == "divide_then_margin":
        candidate = ops.div(ops.div(fp8_max, m), ops.f32(2.0**margin))
    elif c.scale_rule == "msamp":
        # ScalingMeta.compute_scaling_factor, as TorchScript runs it: fp_max / amax is
        # reciprocal(amax) * fp_max; a bad amax keeps the scale, and the inversion for e < 0
        # applies to the kept scale too (an inf amax, e = -inf, gives 1 / scale)
        exponent = ops.sub(ops.floor_log2(ops.mul(ops.div(one, m), fp8_max)), ops.f32(float(margin)))
        factor = ops.exp2_abs(exponent)
        factor = ops.where(ops.positive(m), factor, scale)
        factor = ops.where(ops.isfinite(m), factor, scale)
        candidate = ops.where(ops.less(exponent, zero), ops.div(one, factor), factor)
    else:  # float64: torchao's amax_to_scale
        candidate = ops.div_wide(fp8_max, m, c.eps_value)

    if c.bad_amax != "formula":
        m_ok = ops.logical_and(ops.isfinite(m), ops.positive(m))
        fallback = scale if c.bad_amax == "keep" else one
        candidate = ops.where(m_ok, candidate, fallback)
    if c.inf_scale != "none":
        candidate = ops.where(ops.isinf(candidate), ops.f32(INF_SCALE_VALUES[c.inf_scale]), candidate)
    if c.pow2 == "mask":
        candidate = ops.pow2_mask(candidate)
    elif c.pow2 == "floor_log2":
        candidate = ops.pow2_floor_log2(candidate)
    return candidate


def _stored(config: Fp8Config, candidate: Any, ops: Any) -> tuple[Any, Any]:
    """``(scale, scale_inv)`` as the preset stores them: the scale, or its inverse (flax, Keras)."""
    one = ops.f32(1.0)
    flush = config.subnormals == "flush"
    if config.storage == "scale":
        scale = ops.flush(candidate) if flush else candidate
        inverse = ops.div(one, scale)
        return scale, (ops.flush(inverse) if flush else inverse)
    inverse = ops.div(one, candidate)
    if flush:
        inverse = ops.flush(inverse)
    return ops.div(one, inverse), inverse


def warmup_scale(config: Fp8Config, scale: Any, amax: Any, fp8_max: Any, ops: Any) -> tuple[Any, Any]:
    """``(scale, scale_inv)`` a cast uses in a warm-up: the rule applied to the tensor's own amax.

    torchao's removed delayed scaling computes the first cast's scale from the tensor
    (``_maybe_initialize_amaxes_scales_for_float8_cast``); MS-AMP casts "in time" until its
    window is full (``ScalingMeta.reset_scaling_factor`` from ``cast_to_fp8``, after turning a
    nan amax into inf, and with a margin of 0: ``reset_scaling_factor`` passes 0, whatever the
    margin of the window's rule).
    """
    a = amax
    if config.amax_nan == "inf":
        a = ops.where(ops.isnan(a), ops.f32(float("inf")), a)
    if config.subnormals == "flush":
        a = ops.flush(a)
    margin = 0 if config.warmup == "window" else None
    return _stored(config, _scale_rule(config, a, scale, fp8_max, ops, margin), ops)


def in_warmup(config: Fp8Config, filled: Any, ops: Any) -> Any:
    """Whether a slot's casts are still in their warm-up (a bool, or a bool array)."""
    if config.warmup == "first_amax":
        return filled == ops.int32(0)
    if config.warmup == "window":
        if config.history_len == 1:
            return ops.true()
        return filled < ops.int32(config.history_len)
    return False


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
    if c.amax_nan == "inf":
        a = ops.where(ops.isnan(a), ops.f32(float("inf")), a)
    finite_a = ops.isfinite(a)
    zero_a = ops.is_zero(a)  # +0 or -0 by their bits: a subnormal amax is not 0 on any backend

    if c.on_skipped_step == "record":
        record = ops.true()
    else:
        record = ops.as_bool(step_ok)
    write = record
    if c.zero_amax == "skip":
        write = ops.logical_and(write, ops.logical_not(zero_a))
    if c.nonfinite_amax == "skip":
        write = ops.logical_and(write, finite_a)
    value = ops.where(finite_a, a, zero) if c.nonfinite_amax == "zero" else a
    if c.warmup == "first_amax":
        # torchao's initialisation puts the first amax at the newest position, then its sync
        # rolls and writes it again: the first update writes it twice
        twice = ops.logical_and(write, slot.filled == ops.int32(0))
    else:
        twice = False
    history = ops.push(slot.history, slot.head, value, write, twice)
    head = ops.where(write, ops.ring_next(slot.head, c.history_len), slot.head)

    if c.amax_algo in ("current", "most_recent"):
        m = value
    elif c.timing == "after_write":
        m = ops.window_max(history, c.history_nan)
    else:
        m = ops.window_max(slot.history, c.history_nan)
    window = c.amax_algo == "max" and c.history_len > 1
    if c.subnormals == "flush" or (c.subnormals == "flush_window" and window):
        m = ops.flush(m)

    old_scale, old_inv = slot.scale, slot.scale_inv
    if c.warmup == "window":
        # MS-AMP's cast in the warm-up already replaced the scale by the in-time one (from this
        # same amax) before the optimizer's update, which falls back to it
        early, early_inv = _stored(c, _scale_rule(c, a, slot.scale, fp8_max, ops, margin=0), ops)
        warm = in_warmup(c, slot.filled, ops)
        old_scale, old_inv = ops.where(warm, early, old_scale), ops.where(warm, early_inv, old_inv)
    new_scale, new_inv = _stored(c, _scale_rule(c, m, old_scale, fp8_max, ops), ops)

    if c.amax_algo == "current" or c.timing == "before_write":
        updated = record
    else:
        updated = write
    nonfinite_a = ops.logical_not(finite_a)
    filled = ops.saturating_add(slot.filled, write)
    if c.nonfinite_amax == "zero":
        # MS-AMP: amax_counters += 1, then amax_counters[mask_inf_nan] = 0
        filled = ops.where(ops.logical_and(write, nonfinite_a), ops.int32(0), filled)
    next_slot = Fp8Slot(
        scale=ops.where(updated, new_scale, old_scale),
        scale_inv=ops.where(updated, new_inv, old_inv),
        history=history,
        filled=filled,
        zero_amax=ops.saturating_add(slot.zero_amax, zero_a),
        nonfinite=ops.saturating_add(slot.nonfinite, nonfinite_a),
        head=head,
    )
    return next_slot, updated
