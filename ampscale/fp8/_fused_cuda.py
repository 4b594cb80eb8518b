"""The fused FP8 pass on CUDA: torch CUDA tensors and CuPy arrays through one launch of
``ampscale_fp8_pass`` (``ampscale/_native/cuda/fp8_kernels.cu``).

One launch reads every tensor once and writes every amax, the all-finite flag and (casting)
every payload and clipped count; no host read, no second launch, no memset (the kernel's last
block resets its scratch). The kernels are compiled by ampscale's own NVRTC call (IEEE options,
no flush-to-zero; cached on disk), loaded through the driver launcher for torch and into CuPy as
a binary, as the loss scaler's kernels are. Host-side pieces, cached while the tensors stay the
same: the chunk table (uploaded from pinned memory, queued on the stream), and per device,
stream and slot count the scratch. Every payload of a call lives in one new uint8 buffer (each at
a 16-byte aligned offset), viewed per tensor, so a cached table serves every call.

torch: the payloads are views of that buffer as torch's float8 dtype. CuPy has no float8 dtype:
its payloads are uint8 arrays holding the format's bytes (ml_dtypes' bytes, E5M2's NaN 0x7e),
viewable on the host as the ml_dtypes type. Non-contiguous tensors are copied first.

Where the kernel cannot run (no driver, NVRTC or ROCm: one warning; CUDA graph capture; a torch
function or dispatch mode, transform or compilation; tensor subclasses), the callers take the
bit arithmetic in the framework's own operations (:mod:`ampscale.fp8._fused_torch`,
:mod:`ampscale.fp8._fused`): the same results.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ampscale._native.cuda import _fp8
from ampscale.fp8._pass import FORMAT_CODES, check_scales, nan_byte

__all__ = ["cupy_amax", "cupy_amax_cast", "torch_amax", "torch_amax_cast"]

_lock = threading.Lock()
_kernels: dict[tuple[str, int], Any] = {}  # (framework, device ordinal) -> kernel, or None
_tables: OrderedDict[Any, Any] = OrderedDict()  # (framework, device, rows) -> (device table, host copy, stream)
_scratch: dict[Any, Any] = {}  # (framework, device, stream, slots) -> zeroed scratch


def _scratch_pointers(base: int, slots: int) -> tuple[int, int, int]:
    """``top`` (uint32[slots]), ``clipped`` (uint64[slots]) and ``ticket`` (uint32) in one
    zeroed int64 buffer of ``2 * slots + 1`` elements at ``base``."""
    return base, base + 8 * slots, base + 16 * slots


# ------------------------------------------------------------------------------ torch


class _DriverKernel:
    """``ampscale_fp8_pass`` loaded through ampscale's driver launcher on one device."""

    __slots__ = ("context", "function", "launch_raw", "module")

    def __init__(self, ordinal: int) -> None:
        from ampscale._native.cuda import driver

        self.module = driver.DeviceModule(_fp8.module_source(), ordinal)
        self.context = self.module.context
        self.function = driver.launcher().get_function(self.module.module, self.context, "ampscale_fp8_pass")
        self.launch_raw = self.module.launch

    def launch(self, grid: int, block: int, stream: int, *params: int) -> None:
        self.launch_raw(self.function, self.context, grid, block, stream, *params)


def _torch_kernel(device: Any) -> Any:
    """The kernel for a torch CUDA ``device``, once per device; ``None`` (one warning) where it
    cannot be built or loaded here."""
    import torch

    from ampscale._native.cuda import driver

    ordinal = device.index if device.index is not None else 0
    key = ("torch", ordinal)
    with _lock:
        if key in _kernels:
            return _kernels[key]
        kernel = None
        if getattr(torch.version, "hip", None):
            reason: str | None = "this torch runs on ROCm"
        else:
            reason = driver.unavailable_reason()
        if reason is None:
            try:
                kernel = _DriverKernel(ordinal)
            except (OSError, RuntimeError) as exc:  # NvrtcError is a RuntimeError
                reason = str(exc)
        if kernel is None:
            driver.warn_fallback("torch (the FP8 pass)", reason or "unknown")
        _kernels[key] = kernel
        return kernel


def _torch_ready(leaves: list[Any], device: Any) -> Any:
    """The kernel, where it may run these leaves now; else ``None``."""
    from ampscale.backends import _torch_cpu, _torch_cuda

    if not _torch_cpu._native_context():  # torch function / dispatch modes, transforms, compiling
        return None
    if not set(map(type, leaves)) <= _torch_cpu._PLAIN_TYPES:
        return None
    if _torch_cuda._capturing is not None and device.type == "cuda" and _torch_cuda._capturing():
        return None  # the eager path captures as torch operations
    return _torch_kernel(device)


def _torch_stream(device: Any) -> int:
    from ampscale.backends import torch as torch_backend

    return torch_backend._raw_stream(device) if device.type == "cuda" else 0


def _torch_table(rows: tuple[Any, ...], offsets: list[int], device: Any, stream: int) -> tuple[int, int]:
    """The chunk table of ``rows`` on ``device`` (cached), as ``(address, rows)``."""
    import torch

    key = ("torch", device, rows)
    with _lock:
        entry = _tables.get(key)
        if entry is None:
            addresses, sizes, kinds = zip(*rows, strict=True) if rows else ((), (), ())
            host = torch.from_numpy(_fp8.chunk_table(addresses, offsets, sizes, kinds).view(np.uint8))
            if device.type == "cuda":
                host = host.pin_memory()  # pinned: the copy is queued on the stream, no sync
            entry = _tables[key] = (host.to(device, non_blocking=True), host, stream)
            if len(_tables) > 32:
                _tables.popitem(last=False)
        else:
            _tables.move_to_end(key)
    table = entry[0]
    if entry[2] != stream and device.type == "cuda":
        table.record_stream(torch.cuda.current_stream(device))
    count = table.numel() // _fp8.CHUNK_DTYPE.itemsize
    return (table.data_ptr() if count else 0), count


def _torch_scratch(device: Any, stream: int, slots: int) -> int:
    import torch

    key = ("torch", device, stream, slots)
    with _lock:
        scratch = _scratch.get(key)
        if scratch is None:
            scratch = _scratch[key] = torch.zeros(2 * slots + 1, dtype=torch.int64, device=device)
    return int(scratch.data_ptr())


def _torch_pass(leaves: list[Any], kinds: list[int], device: Any, cast: tuple[Any, str, bool] | None) -> Any:
    import torch

    kernel = _torch_ready(leaves, device)
    if kernel is None:
        return None
    tensors = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in leaves]
    sizes = [t.numel() for t in tensors]
    offsets, total = _fp8.payload_offsets(sizes)
    rows = tuple(zip([t.data_ptr() for t in tensors], sizes, kinds, strict=True))
    stream = _torch_stream(device)
    table, count = _torch_table(rows, offsets, device, stream)
    slots = len(tensors)
    top, clipped, ticket = _scratch_pointers(_torch_scratch(device, stream, slots), slots)
    amaxes = torch.empty(slots, dtype=torch.float32, device=device)
    finite = torch.empty(1, dtype=torch.uint8, device=device)
    payload = clipped_out = scales = None
    options = 0
    if cast is not None:
        scales, fmt, divide = cast
        scales = scales.detach().contiguous()
        payload = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        clipped_out = torch.empty(slots, dtype=torch.int64, device=device)
        options = _fp8.options(FORMAT_CODES[fmt], divide, nan_byte(fmt, "torch"))
    kernel.launch(
        max(1, count),
        _fp8.THREADS,
        stream,
        table,
        count,
        0 if payload is None else payload.data_ptr(),
        0 if scales is None else scales.data_ptr(),
        slots,
        options,
        top,
        clipped,
        ticket,
        amaxes.data_ptr(),
        0 if clipped_out is None else clipped_out.data_ptr(),
        finite.data_ptr(),
    )
    flag = finite.view(torch.bool).reshape(())
    if cast is None:
        return amaxes, flag
    from ampscale.fp8._cast import fp8_dtype

    dtype = fp8_dtype(cast[1], "torch")
    assert payload is not None
    views = [payload[o : o + n].view(t.shape).view(dtype) for o, n, t in zip(offsets, sizes, leaves, strict=True)]
    return views, amaxes, clipped_out


def torch_amax(leaves: list[Any], kinds: list[int], device: Any) -> tuple[Any, Any] | None:
    """``(amaxes, finite)`` of torch CUDA ``leaves`` in one launch; ``None`` where it cannot run."""
    return _torch_pass(leaves, kinds, device, None)  # type: ignore[no-any-return]


def torch_amax_cast(
    leaves: list[Any], kinds: list[int], scales: Any, fmt: str, divide: bool, device: Any
) -> tuple[list[Any], Any, Any] | None:
    """``(payloads, amaxes, clipped)`` of torch CUDA ``leaves`` in one launch; ``None`` where it cannot run."""
    return _torch_pass(leaves, kinds, device, (scales, fmt, divide))  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ CuPy


def _cupy_kernel(device_id: int) -> Any:
    """``ampscale_fp8_pass`` loaded into CuPy on one device (ampscale's NVRTC binary, loaded as
    it is: CuPy's own compile would add ``-ftz=true``); ``None``, one warning, where it cannot be."""
    import cupy

    from ampscale._native.cuda import _plan, nvrtc

    key = ("cupy", device_id)
    with _lock:
        if key in _kernels:
            return _kernels[key]
        kernel = None
        try:
            with cupy.cuda.Device(device_id) as device:
                arch = int(device.compute_capability)
                image, kind = nvrtc.compiled(_fp8.module_source(), arch, _plan.COMPILE_OPTIONS, "ampscale_fp8.cu")
                if kind == "ptx" and not image.endswith(b"\0"):
                    image += b"\0"  # the driver reads PTX as a C string
                module = cupy.cuda.function.Module()
                module.load(image)
                kernel = (module, module.get_function("ampscale_fp8_pass"))
        except Exception as exc:  # OSError (no NVRTC), NvrtcError, CuPy's CUDADriverError
            from ampscale._native.cuda.driver import warn_fallback

            warn_fallback("cupy (the FP8 pass)", f"the kernels could not be built or loaded: {exc}")
        _kernels[key] = kernel
        return kernel


def _cupy_device(leaves: list[Any]) -> int:
    first = leaves[0].data.device_id
    for index, leaf in enumerate(leaves):
        if leaf.data.device_id != first:
            raise ValueError(
                f"tree leaves must be on one device: leaf [0] is on device {first}, leaf [{index}] on "
                f"{leaf.data.device_id}"
            )
    return int(first)


def _cupy_pass(leaves: list[Any], kinds: list[int], cast: tuple[Any, str, bool] | None) -> Any:
    import cupy

    device_id = _cupy_device(leaves)
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return None  # the eager path captures as CuPy operations
    kernel = _cupy_kernel(device_id)
    if kernel is None:
        return None
    arrays = [a if a._c_contiguous or a._f_contiguous else cupy.ascontiguousarray(a) for a in leaves]
    sizes = [int(a.size) for a in arrays]
    offsets, total = _fp8.payload_offsets(sizes)
    rows = tuple(zip([int(a.data.ptr) for a in arrays], sizes, kinds, strict=True))
    slots = len(arrays)
    key = ("cupy", device_id, rows)
    with _lock, cupy.cuda.Device(device_id):
        entry = _tables.get(key)
        if entry is None:
            # a pageable copy, once per distinct set of arrays (the loss scaler's tables too)
            addresses, lengths, codes = zip(*rows, strict=True)
            host = _fp8.chunk_table(addresses, offsets, lengths, codes)
            entry = _tables[key] = (cupy.asarray(host.view(np.uint8)), None, stream.ptr)
            if len(_tables) > 32:
                _tables.popitem(last=False)
        scratch_key = ("cupy", device_id, stream.ptr, slots)
        scratch = _scratch.get(scratch_key)
        if scratch is None:
            scratch = _scratch[scratch_key] = cupy.zeros(2 * slots + 1, dtype=cupy.int64)
        amaxes = cupy.empty(slots, dtype=cupy.float32)
        finite = cupy.empty(1, dtype=cupy.uint8)
        payload = clipped_out = scales = None
        options = 0
        if cast is not None:
            scales, fmt, divide = cast
            scales = scales if scales._c_contiguous else cupy.ascontiguousarray(scales)
            payload = cupy.empty(max(total, 1), dtype=cupy.uint8)
            clipped_out = cupy.empty(slots, dtype=cupy.int64)
            options = _fp8.options(FORMAT_CODES[fmt], divide, nan_byte(fmt, "cupy"))
    table = entry[0]
    count = int(table.size) // _fp8.CHUNK_DTYPE.itemsize
    if entry[2] != stream.ptr:  # made on another stream: held until this one passes the launch
        from ampscale.backends.cupy import _hold_for_stream

        _hold_for_stream((table,))
    top, clipped, ticket = _scratch_pointers(int(scratch.data.ptr), slots)
    u64, i64 = np.uint64, np.int64
    kernel[1](
        (max(1, count),),
        (_fp8.THREADS,),
        (
            u64(int(table.data.ptr) if count else 0),
            i64(count),
            u64(0 if payload is None else int(payload.data.ptr)),
            u64(0 if scales is None else int(scales.data.ptr)),
            i64(slots),
            i64(options),
            u64(top),
            u64(clipped),
            u64(ticket),
            u64(int(amaxes.data.ptr)),
            u64(0 if clipped_out is None else int(clipped_out.data.ptr)),
            u64(int(finite.data.ptr)),
        ),
    )
    flag = finite.view(cupy.bool_).reshape(())
    if cast is None:
        return amaxes, flag
    assert payload is not None
    views = [payload[o : o + n].reshape(a.shape) for o, n, a in zip(offsets, sizes, leaves, strict=True)]
    return views, amaxes, clipped_out


def cupy_amax(leaves: list[Any], kinds: list[int]) -> tuple[Any, Any] | None:
    """``(amaxes, finite)`` of CuPy ``leaves`` in one launch; ``None`` where it cannot run."""
    return _cupy_pass(leaves, kinds, None)  # type: ignore[no-any-return]


def cupy_amax_cast(
    leaves: list[Any], kinds: list[int], scales: Any, fmt: str, divide: bool
) -> tuple[list[Any], Any, Any] | None:
    """``(payloads, amaxes, clipped)`` of CuPy ``leaves`` in one launch (uint8 payloads)."""
    check_scales(scales, len(leaves), "cupy")
    return _cupy_pass(leaves, kinds, (scales, fmt, divide))  # type: ignore[no-any-return]
