"""The torch adapter's CUDA glue (adapters' layer): the packed state in a torch tensor, the
emitted kernels for a device, torch's streams and graph capture, the launch plan of a step.

On CUDA the state is one packed record (:mod:`ampscale._native.cuda._packed`) and a step is
torch's fused kernel writing into the record's scratch, then one launch of ampscale's kernels
(:meth:`ampscale.backends.torch.TorchBackend.fused_unscale_packed`); the drop-in ``GradScaler``'s
``update()`` is one in-place launch on its own tensors (:func:`_update_fields`). Under CUDA graph
capture every step raises before any work (:func:`_refuse_capture`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ampscale._codegen import STATE_BYTES
from ampscale._config import ScalerConfig
from ampscale._core import ScalerState
from ampscale._native.cuda import _plan
from ampscale._native.cuda._packed import (
    FLAG_BAD_BOOL,
    FLAG_FALSE,
    FLAG_FOUND_INF,
    FLAG_TRUE,
    PackedState,
    encode,
    offset_of,
)

__all__: list[str] = []

_RECORD_FLOATS = STATE_BYTES // 4  # the packed record as float32 elements
_INV_OFFSET = offset_of("inv_scale", "float32")[0]
_FOUND_INF_OFFSET = offset_of("found_inf", "float32")[0]
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_KIND_CODES = {
    torch.float16: _plan.KINDS["float16"],
    torch.bfloat16: _plan.KINDS["bfloat16"],
    torch.float32: _plan.KINDS["float32"],
    torch.float64: _plan.KINDS["float64"],
}
_cuda_tables: dict[Any, Any] = {}
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: whether the current CUDA stream is capturing a graph (``None``: torch built without CUDA)
_capturing: Callable[[], bool] | None = (
    torch._C._cuda_isCurrentStreamCapturing if torch.backends.cuda.is_built() else None  # type: ignore[attr-defined]
)
_CAPTURE_ERROR = (
    "ampscale: {what} cannot run under CUDA graph capture: the scaler's state moves with every "
    "step (the functional scaler writes a new device record per step; the drop-in GradScaler "
    "keeps the scale's bound and the optimizers' flags on the host), so a replay would repeat "
    "the captured step with the captured scale. Capture the forward and backward passes only, "
    "and call unscale/step/update outside the graph"
)


def _refuse_capture(what: str) -> None:
    """``RuntimeError`` when the current stream is capturing a CUDA graph (before any work)."""
    if _capturing is not None and _capturing():
        raise RuntimeError(_CAPTURE_ERROR.format(what=what))


def _record_stream(tensor: torch.Tensor) -> None:
    """Tell torch's caching allocator that ``tensor`` is used on the current stream of its
    device, so that its block is not reused before that stream has passed the use."""
    tensor.record_stream(torch.cuda.current_stream(tensor.device))


def _raw_stream(device: torch.device) -> int:
    assert _current_raw_stream is not None  # checked by _cuda_module
    return int(_current_raw_stream(device.index))


class _TorchPacked(PackedState):
    """A packed state in a torch CUDA tensor of 20 float32 elements."""

    __slots__ = ()

    def _make_view(self, name: str) -> Any:
        offset, dtype = offset_of(name, self.scale_dtype)
        typed = self.buffer if dtype == "float32" else self.buffer.view(_TORCH_DTYPES[dtype])
        view = typed[offset // typed.element_size()]
        return view.view(torch.bool) if name in ("finite", "loss_finite") else view


def _cuda_module(config: ScalerConfig, device: torch.device) -> Any:
    """The emitted kernels for ``config`` on a CUDA ``device``; ``None`` where they cannot run
    (not CUDA, ROCm, no driver or NVRTC: one PerformanceWarning says why)."""
    if device.type != "cuda":
        return None
    key = f"torch-cuda-module:{device.index}"
    cache = config._cache
    if key in cache:
        return cache[key]
    from ampscale._native.cuda import driver

    if getattr(torch.version, "hip", None) or _current_raw_stream is None:
        reason = "this torch runs on ROCm" if getattr(torch.version, "hip", None) else "torch has no raw CUDA stream"
        driver.warn_fallback("torch", reason)
        module = None
    else:
        module = driver.module_for(config, device.index if device.index is not None else 0, "torch")
    cache[key] = module
    return module


def _packed_from_values(values: ScalerState, config: ScalerConfig, device: torch.device) -> _TorchPacked:
    _refuse_capture("creating the state")
    record = torch.from_numpy(encode(values, config.scale_dtype).view(np.float32))
    if device.type == "cuda":
        record = record.pin_memory()  # pinned: the copy is queued on the stream, no sync
    buffer = record.to(device, non_blocking=True)
    return _TorchPacked(buffer, buffer.data_ptr(), config.scale_dtype, _raw_stream(device))


def _packed_from_fields(fields: ScalerState, config: ScalerConfig) -> _TorchPacked:
    """Pack a state of 0-d CUDA tensors into a record (on the device: no host read)."""
    device = fields.scale.device
    buffer = torch.zeros(_RECORD_FLOATS, dtype=torch.float32, device=device)
    state = _TorchPacked(buffer, buffer.data_ptr(), config.scale_dtype, _raw_stream(device))
    for name in ScalerState._fields:
        state.view(name).copy_(getattr(fields, name))
    state.view("inv_scale").copy_(state.view("scale").double().reciprocal().float())
    state.view("finite").fill_(True)
    state.view("loss_finite").fill_(True)
    return state


def _cuda_plan(
    leaves: list[Any], loss: Any, device: torch.device, every_dtype: bool = False
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], torch.Tensor | None] | None:
    """How a one-launch step covers ``leaves`` and ``loss`` on ``device``: the groups for torch's
    kernel (one per dtype but bfloat16), the tensors for ampscale's kernel (bfloat16 ones), the
    loss; ``None`` when it cannot (another device, sparse or non-contiguous bfloat16, ...).

    ``every_dtype``: ampscale's kernel takes every contiguous tensor, whatever its dtype, and
    torch's kernel only the non-contiguous ones. Used while the scale may be below 1: torch's
    kernel tests its inputs, so it would need a second, check-only pass over the values it
    wrote (a finite value can overflow when divided by a scale below 1), where ampscale's
    kernel tests the values it stores in the same pass, with the same bits written.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    own: list[torch.Tensor] = []
    for leaf in leaves:
        if leaf.device != device or leaf.is_sparse or leaf.dtype not in _KIND_CODES:
            return None
        if every_dtype and leaf.is_contiguous():
            own.append(leaf)
        else:
            groups.setdefault(leaf.dtype, []).append(leaf)
    own += groups.pop(torch.bfloat16, [])
    if any(not t.is_contiguous() for t in own):
        return None
    if loss is not None and (
        loss.device != device or loss.is_sparse or loss.dtype not in _KIND_CODES or not loss.is_contiguous()
    ):
        return None
    return list(groups.values()), own, loss


def _loss_argument(loss: torch.Tensor | None) -> tuple[int, int, int]:
    """``(pointer, loss_meta, chunks)`` of the loss for ``ampscale_step``."""
    if loss is None or loss.numel() == 0:
        return 0, 0, 0
    size = loss.numel()
    return loss.data_ptr(), _plan.loss_meta(size, _KIND_CODES[loss.dtype]), -(-size // _plan.CHUNK)


def _chunk_table(leaves: list[torch.Tensor], device: torch.device, stream: int) -> tuple[torch.Tensor | None, int]:
    """The chunk table of contiguous ``leaves`` on ``device``, cached while they stay the same
    (``None`` and 0 chunks when every leaf is empty). A table made on another stream gets
    ``record_stream`` for ``stream``, so its eviction cannot free it under this launch."""
    rows = tuple((t.data_ptr(), t.numel(), _KIND_CODES[t.dtype]) for t in leaves if t.numel())
    if not rows:
        return None, 0
    tables: dict[Any, Any] = _cuda_tables
    key = (device, rows)
    entry = tables.get(key)
    if entry is None:
        addresses, sizes, kinds = zip(*rows, strict=True)
        host = torch.from_numpy(_plan.chunk_table(addresses, sizes, kinds).view(np.uint8))
        if device.type == "cuda":
            host = host.pin_memory()  # pinned, non-blocking: no sync; kept alive with the table
        entry = (host.to(device, non_blocking=True), host, stream)
        if len(tables) > 32:
            tables.pop(next(iter(tables)))
        tables[key] = entry
    elif entry[2] != stream:
        _record_stream(entry[0])
    table = entry[0]
    return table, table.numel() // _plan.CHUNK_DTYPE.itemsize


def _update_fields(
    config: ScalerConfig,
    scale: torch.Tensor,
    tracker: torch.Tensor,
    record: PackedState,
    found_infs: Callable[[], list[torch.Tensor]],
    loss_bad: list[torch.Tensor] | None,
) -> bool:
    """The drop-in ``GradScaler``'s ``update()`` on CUDA: one launch of ``ampscale_update_fields``
    that reads torch's overflow flag (the sum of ``found_infs()``, if there are several) and the
    loss flag on the device and rewrites ``scale``, ``tracker`` and ``record`` (the other
    fields) in place; no sync. ``loss_bad``: the scaled losses' overflow flags (0-d bools), or
    ``None`` for a loss already known to have overflowed. ``False`` where it does not apply
    (not CUDA, kernels not loaded, dtypes or devices that differ): nothing was launched.
    """
    device = scale.device
    module = _cuda_module(config, device)
    wide = torch.float64 if config.scale_dtype == "float64" else torch.float32
    if (
        module is None
        or record.scale_dtype != config.scale_dtype
        or scale.dtype is not wide
        or tracker.dtype is not torch.int32
        or tracker.device != device
        or record.buffer.device != device
    ):
        return False
    # the scale's host bound and the per-optimizer flags live in Python: a graph replay
    # would not move them, so an update under stream capture raises
    _refuse_capture("GradScaler.update()")
    flags = found_infs()
    found = flags[0]
    if len(flags) > 1 or found.device != device or found.dtype is not torch.float32:
        total = found.to(device=device, dtype=torch.float32, non_blocking=True)
        for flag in flags[1:]:
            total = total + flag.to(device=device, dtype=torch.float32, non_blocking=True)
        found = total
    if loss_bad is None:
        loss_ptr, loss_kind = 0, FLAG_FALSE
    elif not loss_bad:
        loss_ptr, loss_kind = 0, FLAG_TRUE
    else:
        bad: torch.Tensor | None = None
        for flag in loss_bad:
            moved = flag.to(device, non_blocking=True)
            bad = moved if bad is None else bad.logical_or(moved)
        assert bad is not None
        loss_ptr, loss_kind = bad.data_ptr(), FLAG_BAD_BOOL
    module.launch(
        module.update_fields,
        module.context,
        1,
        1,
        _raw_stream(device),
        scale.data_ptr(),
        tracker.data_ptr(),
        record.ptr,
        found.data_ptr(),
        FLAG_FOUND_INF,
        loss_ptr,
        loss_kind,
    )
    return True
