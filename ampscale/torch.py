"""``ampscale.torch``: drop-ins for ``torch.amp.GradScaler`` and FSDP's ``ShardedGradScaler``.

Framework helpers' layer; the classes live in ``_torch_scaler`` and ``_torch_sharded``.

:class:`GradScaler` is a subclass of ``torch.amp.GradScaler`` with the same constructor,
methods, call-order errors, ``state_dict`` keys and private attributes (``_scale``,
``_growth_tracker``, ``_per_optimizer_states``, ``_unscale_grads_``, ...), each with torch's
meaning, so existing loops, and the libraries that reach into the scaler, run unchanged::

    scaler = ampscale.torch.GradScaler("cuda")
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)                 # returns optimizer.step()'s value, as torch
        scaler.update()
        if scaler.last_step.applied:           # was the update applied? (StepResult)
            scheduler.step()

Differences, all additions:

* ``step`` returns what torch's returns (``optimizer.step()``'s value, ``None`` when skipped);
  :attr:`GradScaler.last_step` is a :class:`StepResult` saying whether that update was
  applied (a device tensor on the fused path, so there is still no sync).
* float16 and bfloat16 gradients are accepted (torch refuses float16 and, on CUDA, bfloat16).
* ``preset=``, ``hysteresis=``, ``min_scale=``, ``max_scale=``, ``on_floor=`` and the other
  ampscale settings; a ``process_group`` whose ranks agree on overflow before anything changes.
* a scaled loss that is not finite counts as an overflow (``check_loss=False`` turns it off);
  see :meth:`GradScaler.scale` for the exact rule.

The state is torch's: ``_scale`` (float32) and ``_growth_tracker`` (int32) are 0-d tensors on
the device of the first scaled output, updated in place; changing them in place or assigning
new ones changes the scale as it does in torch. ampscale's other counters (hysteresis, skipped
steps, ...) live beside them, as Python numbers on the CPU and 0-d tensors elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampscale._info import missing_framework

try:
    import torch  # noqa: F401 - say what to install, not only what is missing
except ModuleNotFoundError as exc:
    raise missing_framework(__name__, exc) from exc

from ampscale._torch_scaler import GradScaler, OptState, SettingError, StepResult, _fresh_state
from ampscale.backends._torch_cpu import _HostView

if TYPE_CHECKING:
    from ampscale._torch_sharded import ShardedGradScaler

__all__ = ["GradScaler", "OptState", "SettingError", "ShardedGradScaler", "StepResult"]

# the public home of the classes (reprs, pickles, the API reference); a pickled GradScaler also
# names the factory of its per-optimizer states and its host views: they are found here too, so
# pickles load whichever module of the package defines them
for _public in (GradScaler, SettingError, StepResult, _fresh_state, _HostView):
    _public.__module__ = __name__
del _public


def __getattr__(name: str) -> Any:
    # FSDP's scaler needs torch.distributed.fsdp (about 2 s to import): load it when asked for
    if name == "ShardedGradScaler":
        from ampscale._torch_sharded import ShardedGradScaler

        return ShardedGradScaler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
