"""``ampscale.torch.ShardedGradScaler``: a drop-in for FSDP's ``ShardedGradScaler``.

Framework helpers' layer.

Kept apart from :mod:`ampscale.torch` because its base class lives in
``torch.distributed.fsdp``, which takes about two seconds to import; ``ampscale.torch``
loads this module the first time ``ShardedGradScaler`` is asked for. It builds on the drop-in
``GradScaler`` of :mod:`ampscale._torch_scaler`, as the public module does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedGradScaler

from ampscale._config import _UNSET
from ampscale._torch_scaler import GradScaler

__all__ = ["ShardedGradScaler"]


def _is_supported_device(tensor: torch.Tensor) -> bool:
    """The devices FSDP's scaler accepts (its own list)."""
    return bool(tensor.is_cuda) or tensor.device.type in (
        "xla",
        "cpu",
        "hpu",
        "mtia",
        "xpu",
        torch._C._get_privateuse1_backend_name(),
    )


class ShardedGradScaler(GradScaler, _TorchShardedGradScaler):  # type: ignore[misc]
    """Drop-in ``torch.distributed.fsdp.ShardedGradScaler``: :class:`~ampscale.torch.GradScaler`
    for gradients sharded across ranks (FSDP, ZeRO-style optimizers, hand-sharded models).

    As torch's: ``unscale_`` all-reduces every overflow flag (SUM) over ``process_group``, so
    the ranks, each of which sees only its own shards, skip the same steps and keep the same
    scale; a rank without gradients still takes part; float16 sparse gradients are coalesced
    in float32; ``scale`` returns the output's own dtype (float16 losses stay float16). Unlike
    torch's: the flags are agreed in a fused optimizer's ``step`` too (torch's scaler agrees
    only in ``unscale_``, so with ``Adam(fused=True)`` and no ``unscale_`` its ranks can
    disagree); they are 0-d tensors (torch's ``unscale_`` makes 1-element 1-d ones, which a
    fused optimizer's step then refuses); and the scale follows the preset's rule on every
    device (torch's scaler, on the CPU, grows by a float32 multiply with no check for
    overflow, so it can reach inf).

    Args:
        device: as :class:`~ampscale.torch.GradScaler`.
        init_scale: initial scale (torch: ``2.0**16``).
        backoff_factor: backoff factor (torch: 0.5; note torch's argument order).
        growth_factor: growth factor (torch: 2.0).
        growth_interval: finite steps between growths (torch: 2000).
        enabled: ``False`` makes every method a no-op.
        process_group: the ranks that share the model (default: the default group).
        **settings: ``preset=``, ``check_loss=`` and any other ampscale setting.
    """

    _casts_outputs: ClassVar[bool] = True  # scale() goes through _multiply, which casts back

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = _UNSET,  # type: ignore[assignment]
        backoff_factor: float = _UNSET,  # type: ignore[assignment]
        growth_factor: float = _UNSET,  # type: ignore[assignment]
        growth_interval: int = _UNSET,  # type: ignore[assignment]
        enabled: bool = True,
        process_group: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **settings)
        if self._enabled:
            self.process_group = process_group

    def _multiply(self, outputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not _is_supported_device(outputs):
            raise AssertionError(f"Expected supported device, got {outputs.device}")
        # FSDP with mixed precision returns float16/bfloat16 losses: keep their dtype
        return super()._multiply(outputs, scale).type(outputs.dtype)

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not allow_fp16 and any(g.dtype is torch.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is not None and grad.is_sparse and grad.dtype is torch.float16:
                        # coalesced in float32, as torch's: duplicates may overflow when summed
                        param.grad = grad.type(torch.float32).coalesce().type(torch.float16)
        found = self._unscale_into(optimizer, inv_scale, found_inf, allow_fp16)
        if not found:
            # a rank may hold no gradient shard at all: it still takes part in the all-reduce
            if self._scale is None:
                raise AssertionError("Expected _scale to be initialized, got None")
            found = {self._scale.device: found_inf.to(self._scale.device, copy=True)}
        return found

    def _agree(self, found: dict[torch.device, torch.Tensor]) -> None:
        """All-reduce (SUM) every flag over ``process_group`` in place, as torch's ``unscale_``."""
        works = []
        on_cpu: list[torch.Tensor] = []
        moved: list[torch.Tensor] = []
        for flag in found.values():
            if self._device != "cpu" and flag.device.type == "cpu":
                on_cpu.append(flag)
                moved.append(flag.to(self._device))
                works.append(dist.all_reduce(moved[-1], async_op=True, group=self.process_group))
            else:
                works.append(dist.all_reduce(flag, async_op=True, group=self.process_group))
        for work in works:
            work.wait()
        if on_cpu:
            torch._foreach_copy_(on_cpu, moved)
