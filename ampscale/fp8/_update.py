"""The FP8 state's pure update over every slot, with the operations of the framework holding it.

Below both the scaler (:mod:`ampscale.fp8._scaler`) and the checkpoint importers
(:mod:`ampscale.fp8._state_dict`), which recompute scales from imported histories with it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ampscale._config import INT32_MAX, shown
from ampscale.fp8._config import Fp8Config
from ampscale.fp8._ops import Fp8ArrayOps, framework_of, make_ops, namespace_of
from ampscale.fp8._transition import Fp8Slot, Fp8State, slot_transition

__all__ = ["canonical_history", "check_step_ok", "device_of", "ops_for", "update_state"]


@functools.lru_cache(maxsize=64)
def ops_for(config: Fp8Config, framework: str, device: Any, xp: Any = None, donate: bool = False) -> Fp8ArrayOps:
    """The operations of ``framework`` on ``device`` for ``config`` (made once per key);
    ``xp``: the namespace of an ``"array_api"`` framework."""
    return make_ops(framework, device=device, slot_max=config.slot_max, donate=donate, xp=xp)


def device_of(array: Any, framework: str) -> Any:
    """The device to make constants on: torch's tensors carry one; the others place them themselves."""
    return array.device if framework == "torch" else None


def ops_of(config: Fp8Config, array: Any) -> Fp8ArrayOps:
    """The operations for ``config`` on the framework, device and namespace of ``array``."""
    framework = framework_of(array)
    return ops_for(config, framework, device_of(array, framework), namespace_of(array))


def check_step_ok(step_ok: Any, framework: str) -> None:
    """Refuse a ``step_ok`` that is not a bool or a 0-d bool array (before anything changes).

    Raises:
        TypeError: a string, a number, an array of another dtype or framework.
        ValueError: a bool array that is not 0-d.
    """
    accepted = f"a bool or a 0-d bool array (NumPy or {framework}), e.g. the loss scaler's finite"
    if isinstance(step_ok, (bool, np.bool_)):
        return
    shape, dtype = getattr(step_ok, "shape", None), getattr(step_ok, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"step_ok must be {accepted}; got {type(step_ok).__name__} {shown(step_ok)}")
    kind = framework_of(step_ok) if not isinstance(step_ok, np.ndarray) else "numpy"
    if kind not in ("numpy", framework):
        raise TypeError(f"step_ok must be {accepted}; got a {kind} array")
    if str(dtype).split(".")[-1] not in ("bool", "bool_"):
        raise TypeError(f"step_ok must be {accepted}; got an array of dtype {dtype}")
    if tuple(shape) != ():
        raise ValueError(f"step_ok must be {accepted}; got shape {tuple(shape)}")


def _head(state: Fp8State, ops: Fp8ArrayOps) -> Any:
    if state.head is not None:
        return state.head
    return ops.new_array([0] * state.history.shape[0], "int32")


def update_state(
    config: Fp8Config, state: Fp8State, amax: Any, step_ok: Any = True, donate: bool = False
) -> tuple[Fp8State, Any]:
    """The pure update: ``(next_state, updated)`` for ``[N]`` float32 ``amax`` of the state's framework.

    ``updated`` is an ``[N]`` bool array: the slots whose scale was recomputed this step. The
    transition's array operations, on any device; :func:`ampscale.fp8.update_state` runs the
    one-launch CUDA kernel instead where the state is on a GPU. ``donate=True`` gives ``state``
    up: NumPy, torch and CuPy then write the one new amax per slot into its history buffer
    instead of copying it (JAX does the same when the ``jit`` that calls this donates the state).

    Raises:
        TypeError, ValueError: ``step_ok`` is not a bool or a 0-d bool array.
    """
    framework = framework_of(state.scale)
    check_step_ok(step_ok, framework)
    ops = ops_for(config, framework, device_of(state.scale, framework), namespace_of(state.scale), donate)
    enter = ops.enter
    slot = Fp8Slot(
        enter(state.scale),
        enter(state.scale_inv),
        enter(state.history),
        state.filled,
        state.zero_amax,
        state.nonfinite,
        _head(state, ops),
    )
    fp8_max = enter(ops.array(list(config.slot_max), "float32"))
    next_slot, updated = slot_transition(config, slot, enter(amax), fp8_max, step_ok, ops)
    every_slot = next_slot.filled >= 0  # [N] true: a per-step flag as one per slot
    updated = every_slot if updated is True else every_slot & updated
    steps = state.steps + ops._to_int(state.steps < INT32_MAX)
    leave = ops.leave
    next_state = Fp8State(
        leave(next_slot.scale),
        leave(next_slot.scale_inv),
        leave(next_slot.history),
        next_slot.filled,
        next_slot.zero_amax,
        next_slot.nonfinite,
        steps=steps,
        head=next_slot.head,
    )
    return next_state, updated


def canonical_history(state: Fp8State) -> Any:
    """Every slot's history in canonical order, oldest first (``[N, L]``, the state's framework
    and device; no host read)."""
    framework = framework_of(state.history)
    history = state.history
    if state.head is None:
        return history
    n, length = history.shape[0], history.shape[-1]
    if framework == "torch":
        import torch

        positions = (state.head.long()[:, None] + torch.arange(length, device=history.device)[None, :]) % length
        return torch.gather(history, 1, positions)
    xp = make_ops(framework, xp=namespace_of(history)).xp
    head = xp.expand_dims(state.head, axis=1)
    positions = (head + xp.expand_dims(xp.arange(length, dtype=head.dtype), axis=0)) % length
    return xp.take_along_axis(history, positions, axis=1) if n else history
