"""The loss scaler and the FP8 scaler in one step: fp16 + FP8, bf16 + FP8.

:func:`unscale_and_update` runs, for one optimizer step::

    check amax (shape, framework, slots)                   # before any gradient changes
    grads, finite, loss_finite = scaler.unscale(grads, loss)    # this rank's flags
    amax[k] /= loss_scale for gradient slots               # opt-in, exact (a power of two)
    amax, finite, loss_finite = one_collective(amax, flags, group)   # max, nan kept; OR
    scaler = scaler.update(finite, loss_finite)
    fp8    = fp8.update(amax, step_ok=finite)              # the preset's on_skipped_step

so that the gradients' and the loss's overflow flags and every slot's amax agree across the
ranks in one collective (two or more in Transformer Engine: one for the amaxes, one per
flag), and a step the loss scaler skips is handled by the FP8 preset's own rule: TE records
the step's amaxes (one inf then sits in a ``max`` window for ``history_len - 1`` steps), Keras
freezes every slot, ampscale's default freezes and never lets a non-finite amax into a history.

**Loss-scale-invariant gradient amaxes** (``loss_scale_invariant=True``). A gradient slot's
tensors carry the loss scale ``S`` (the backward pass ran on ``S * loss``), so its amax moves
with ``S`` and a change of ``S`` (a backoff, a growth) reads as a change of the data. Dividing
the gradient slots' amaxes by ``S`` records the amax of the unscaled gradient; the division by
a power of two is exact (short of a subnormal result), which is why the loss scaler's settings
must keep its scale a power of two. The scaled gradient is then cast with ``scale / S``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ampscale._scaler import Scaler, _probe_leaves
from ampscale.backends import backend_of_leaves, get_backend
from ampscale.fp8._distributed import UNSET, check_group, reduce_with_flags, resolve_group
from ampscale.fp8._ops import framework_of, namespace_of
from ampscale.fp8._scaler import Fp8Scaler, update_state
from ampscale.fp8._update import ops_of

__all__ = ["Fp8Step", "unscale_and_update"]


class Fp8Step(NamedTuple):
    """What :func:`unscale_and_update` returns.

    Attributes:
        scaler: the loss scaler for the next step.
        fp8_scaler: the FP8 scaler for the next step.
        grads: the unscaled gradients (in place where the arrays are writable).
        finite: 0-d bool on the device: the step's gradients and loss were finite on every
            rank of the group; apply the optimizer's update only where it is true.
    """

    scaler: Scaler
    fp8_scaler: Fp8Scaler
    grads: Any
    finite: Any


def _is_power_of_two(value: float) -> bool:
    return math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5


def _check_power_of_two_scale(scaler: Scaler) -> None:
    """Refuse settings under which the loss scale can leave the powers of two."""
    c = scaler.config
    if not c.scales:
        return  # guard mode: the scale is 1
    settings = {
        "init_scale": c.initial_scale,
        "growth_factor": c.growth_value,
        "backoff_factor": c.backoff_value,
        "min_scale": c.min_value,
    }
    if c.max_scale is not None:  # None: the scale's range, reached only past 2**127 (float32)
        settings["max_scale"] = c.max_value
    for name, value in settings.items():
        if not _is_power_of_two(value):
            raise ValueError(
                f"loss_scale_invariant=True divides the gradient slots' amaxes by the loss scale, which is exact "
                f"only while the scale is a power of two; the loss scaler's {name} is {value!r}: create it with "
                "powers of two (every preset's defaults are), or leave loss_scale_invariant False"
            )


def _loss_scale_divisor(scaler: Scaler, fp8: Fp8Scaler, vector: Any) -> Any:
    """``[N]`` float32 of ``vector``'s framework: the loss scale for gradient slots, 1 elsewhere."""
    config = fp8.config
    ops = ops_of(config, vector)
    state = scaler.state
    if state is None:
        scale = ops.f32(scaler.config.initial_scale)
    elif hasattr(state.scale, "shape"):
        scale = fp8._as_f32(state.scale, framework_of(vector))
    else:  # a host number (the torch CPU and NumPy host paths)
        scale = ops.f32(float(state.scale))
    gradient_slot = ops.array([int(role == "backward") for role in config.roles], "int32") > 0
    return ops.where(gradient_slot, scale, ops.f32(1.0))


def _backend_name(fp8: Fp8Scaler) -> str:
    framework = fp8.framework
    if framework == "array_api":
        return str(getattr(namespace_of(fp8.state.scale), "__name__", "array_api"))
    return framework


def unscale_and_update(
    scaler: Scaler,
    fp8_scaler: Fp8Scaler,
    grads: Any,
    amax: Any,
    *,
    loss: Any = None,
    group: Any = UNSET,
    loss_scale_invariant: bool = False,
) -> Fp8Step:
    """Unscale and check the gradients, agree across ranks, and update both scalers: one step.

    Args:
        scaler: the loss scaler (``ampscale.create_scaler(...)``; ``mode="guard"`` for bf16 +
            FP8, where nothing is scaled and only non-finite steps are skipped).
        fp8_scaler: the FP8 scaler whose slots ``amax`` describes.
        grads: the (scaled) gradients, any tree the loss scaler takes.
        amax: this step's amaxes, one per FP8 slot (already max-combined over micro-batches:
            :func:`ampscale.fp8.combine_amax`): an ``[N]`` float32 array of the FP8 state's
            framework, a list, or a dict slot -> value.
        loss: the scaled loss (its overflow skips the step too).
        group: the ranks whose amaxes and flags agree, in ONE collective per step: a torch
            process group or ``"world"``, JAX axis name(s), a CuPy NCCL communicator, a callable
            ``buffer -> buffer``, or ``None`` (this rank alone). Left out: the loss scaler's
            ``axis_name`` setting; required while ``torch.distributed`` runs with several
            ranks or the amaxes vary over mapped JAX axes.
        loss_scale_invariant: record the gradient slots' amaxes divided by the loss scale the
            step ran with (exact: the scale must be a power of two), so that a change of the
            loss scale is not read as a change of the gradients. Off by default, and off in
            every anchor (TE records the scaled amaxes).

    Returns:
        :class:`Fp8Step` ``(scaler, fp8_scaler, grads, finite)``.

    Raises:
        TypeError, ValueError, KeyError: a bad argument (named with its value and what is
            accepted), before any gradient or state changes.

    Example:
        >>> import numpy as np, ampscale, ampscale.fp8 as fp8
        >>> scaler = ampscale.create_scaler(init_scale=2.0**4)
        >>> f8 = fp8.create_fp8_scaler("ampscale", {"x": "forward", "dy": "backward"}, history_len=4)
        >>> grads = [np.full(3, 32.0, np.float32)]
        >>> step = fp8.unscale_and_update(scaler, f8, grads, [2.0, 64.0], loss_scale_invariant=True)
        >>> step.grads[0], bool(step.finite), step.fp8_scaler.scales_sync()
        (array([2., 2., 2.], dtype=float32), True, {'x': 224.0, 'dy': 14336.0})
    """
    if not isinstance(scaler, Scaler):
        raise TypeError(f"scaler must be an ampscale Scaler (ampscale.create_scaler); got {type(scaler).__name__}")
    if not isinstance(fp8_scaler, Fp8Scaler):
        raise TypeError(
            f"fp8_scaler must be an Fp8Scaler (ampscale.fp8.create_fp8_scaler); got {type(fp8_scaler).__name__}"
        )
    if not isinstance(loss_scale_invariant, bool):
        raise TypeError(f"loss_scale_invariant must be True or False; got {loss_scale_invariant!r}")
    # every refusal before the first gradient is unscaled in place
    if loss_scale_invariant:
        _check_power_of_two_scale(scaler)
    vector = fp8_scaler._amax_vector(amax)
    if group is UNSET and scaler.config.axis_name is not None:
        group = scaler.config.axis_name
    group = resolve_group(group, vector)
    check_group(group, fp8_scaler.framework)
    backend = scaler.backend
    if backend is None:
        probe = _probe_leaves(grads)
        backend = backend_of_leaves(probe if loss is None else [*probe, loss], "gradients") or get_backend("numpy")
    if backend.name != _backend_name(fp8_scaler):
        raise TypeError(
            f"the gradients are {backend.name} arrays and the FP8 state holds {_backend_name(fp8_scaler)} arrays: "
            "both scalers must live in one framework (their flags and amaxes go in one collective)"
        )

    if loss_scale_invariant:
        vector = vector / _loss_scale_divisor(scaler, fp8_scaler, vector)
    tree, finite, loss_finite, backend = scaler._unscale(grads, loss, None)
    if group is not None:
        ops = ops_of(fp8_scaler.config, vector)
        bad = [ops.logical_not(finite)] + ([] if loss_finite is None else [ops.logical_not(loss_finite)])
        vector, agreed = reduce_with_flags(vector, bad, group)
        finite = ops.logical_not(agreed[0])
        loss_finite = None if loss_finite is None else ops.logical_not(agreed[1])
    next_scaler = scaler._update(backend, finite, loss_finite)
    state, _updated = update_state(fp8_scaler.config, fp8_scaler.state, vector, finite)
    return Fp8Step(next_scaler, Fp8Scaler(fp8_scaler.config, state), tree, finite)
