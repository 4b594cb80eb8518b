"""The FP8 state's pure update over every slot, with the operations of the framework holding it.

Below both the scaler (:mod:`ampscale.fp8._scaler`) and the checkpoint importers
(:mod:`ampscale.fp8._state_dict`), which recompute scales from imported histories with it.
"""

from __future__ import annotations

import functools
from typing import Any

from ampscale._config import INT32_MAX
from ampscale.fp8._config import Fp8Config
from ampscale.fp8._ops import Fp8ArrayOps, framework_of, namespace_of
from ampscale.fp8._transition import Fp8Slot, Fp8State, slot_transition

__all__ = ["device_of", "ops_for", "update_state"]


@functools.lru_cache(maxsize=64)
def ops_for(config: Fp8Config, framework: str, device: Any, xp: Any = None) -> Fp8ArrayOps:
    """The operations of ``framework`` on ``device`` for ``config`` (made once per key);
    ``xp``: the namespace of an ``"array_api"`` framework."""
    return Fp8ArrayOps(framework, device=device, slot_max=config.slot_max, xp=xp)


def device_of(array: Any, framework: str) -> Any:
    """The device to make constants on: torch's tensors carry one; the others place them themselves."""
    return array.device if framework == "torch" else None


def ops_of(config: Fp8Config, array: Any) -> Fp8ArrayOps:
    """The operations for ``config`` on the framework, device and namespace of ``array``."""
    framework = framework_of(array)
    return ops_for(config, framework, device_of(array, framework), namespace_of(array))


def update_state(config: Fp8Config, state: Fp8State, amax: Any, step_ok: Any = True) -> tuple[Fp8State, Any]:
    """The pure update: ``(next_state, updated)`` for ``[N]`` float32 ``amax`` of the state's framework.

    ``updated`` is an ``[N]`` bool array: the slots whose scale was recomputed this step. The
    transition's array operations, on any device; :func:`ampscale.fp8.update_state` runs the
    one-launch CUDA kernel instead where the state is on a GPU.
    """
    ops = ops_of(config, state.scale)
    slot = Fp8Slot(state.scale, state.scale_inv, state.history, state.filled, state.zero_amax, state.nonfinite)
    fp8_max = ops.array(list(config.slot_max), "float32")
    next_slot, updated = slot_transition(config, slot, amax, fp8_max, step_ok, ops)
    every_slot = next_slot.filled >= 0  # [N] true: a per-step flag as one per slot
    updated = every_slot if updated is True else every_slot & updated
    steps = state.steps + ops._to_int(state.steps < INT32_MAX)
    return Fp8State(*next_slot, steps=steps), updated
