"""The torch adapter's CPU glue (adapters' layer): ampscale's native kernel on torch's memory,
torch's fused kernel split over threads, and C views of one-element CPU tensors.

The native kernel is the NumPy backend's (``ampscale/_native/cpu``), run on the tensors' memory
(read through torch's DLPack C exchange API: no copy, no Python call per tensor) and split over
the cores by element count; its values are torch's kernel's bit for bit (see
:func:`_native_cpu`). :func:`native_cpu_kernel` turns it off and on
(``AMPSCALE_TORCH_NATIVE=0``). Where torch must see the op, or the memory is not plain dense
memory, :mod:`ampscale.backends.torch` runs torch's fused kernel instead, over pieces of a long
list in parallel threads (:func:`_split_ways`, :func:`_fused_pieces`).
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue
from typing import Any

import numpy as np
import torch

from ampscale.backends._base import overlap_error

__all__ = ["native_cpu_kernel"]  # (ampscale.backends.torch offers it)

_DTYPE = operator.attrgetter("dtype")
_GET_DEVICE = torch.Tensor.get_device
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

_native: Any
try:  # ampscale's own host kernels, the NumPy backend's (absent from builds without a compiler)
    from ampscale._native.cpu import _numpy as _native
except ImportError:  # pragma: no cover - exercised only on builds without a C compiler
    _native = None


#: the native kernel's code per dtype (the NumPy extension's ``KIND_*``)
_NATIVE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_functorch_layer = torch._C._functorch.peek_interpreter_stack
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling
_native_enabled = [os.environ.get("AMPSCALE_TORCH_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")]
#: torch's DLPack C exchange API (torch >= 2.10): the native kernel reads every tensor's memory
#: through it in C; without it, through data_ptr() / numel() / is_contiguous() calls
_EXCHANGE_API = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
_PLAIN_TUPLE = (torch.Tensor, torch.nn.Parameter)
_DTYPE_OF_KIND = {kind: dtype for dtype, kind in _NATIVE_KINDS.items()}


def native_cpu_kernel(enabled: bool | None = None) -> bool:
    """Whether CPU gradients go through ampscale's native kernel (the NumPy backend's), and set it.

    ``enabled``: ``False`` makes CPU tensors use torch's fused kernel (the same bits), ``True``
    turns ampscale's back on; ``None`` only asks. The environment variable
    ``AMPSCALE_TORCH_NATIVE=0`` turns it off from the start. ``False`` is also returned where
    the native kernel is not built.
    """
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"native_cpu_kernel: enabled must be a bool or None; got {enabled!r}")
        _native_enabled[0] = enabled
    return _native is not None and _native_enabled[0]


def _native_context() -> bool:
    """Whether torch would run its own CPU kernel with nothing watching: no torch function or
    dispatch mode, no functorch transform (grad, vmap, functionalize), not compiling. (Inference
    mode and autocast change nothing for an in-place kernel on plain tensors; wrapped, batched,
    functional and fake tensors are refused one by one, by torch's DLPack export.)"""
    return _function_modes() == 0 and _dispatch_modes() == 0 and _functorch_layer() is None and not _is_compiling()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_cores = [_usable_cores()]  # read once (a call costs more than a small step); again after fork
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _cores.__setitem__(0, _usable_cores()))


def _native_ready() -> bool:
    """Whether the native kernel may run CPU tensors now (built, on, torch's exchange API there,
    nothing that torch must see active)."""
    return _native is not None and _native_enabled[0] and _EXCHANGE_API is not None and _native_context()


def _native_threads() -> int:
    """Threads for the native kernel: torch's own setting, at most the usable cores."""
    return max(1, min(int(torch.get_num_threads()), _cores[0]))


#: tensors from which a CPU group is split across threads (torch's CPU kernel walks the list
#: one tensor after another, and runs a tensor below 32768 elements on one thread)
_SPLIT_MIN_TENSORS = 256
#: tensors per piece of a split group (fewer for short lists, so each thread gets several)
_PIECE_TENSORS = 128
_PIECE_MIN_TENSORS = 32
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_IS_SPARSE = operator.attrgetter("is_sparse")
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)
_pool_lock = threading.Lock()


def _split_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, made again in a forked child (threads do not survive fork)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1]._max_workers < workers:
            _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="ampscale"))
        return _pool[1]


def _split_ways(grads: list[torch.Tensor], dtype: torch.dtype, plain: bool | None = None) -> int:
    """In how many parts to run a CPU group of the fused kernel (1: do not split).

    Only plain tensors, with none of torch's thread-local modes active (function and dispatch
    modes, inference mode, compilation), since a worker thread would not see them; and not
    float16 with sparse tensors among them (whose coalescing check must come before any work).
    ``plain``: whether every item is known to be a plain tensor (``None``: look).
    """
    if len(grads) < _SPLIT_MIN_TENSORS:
        return 1
    threads = min(torch.get_num_threads(), os.cpu_count() or 1)
    if threads < 2:
        return 1
    if (
        torch.is_inference_mode_enabled()
        or torch._C._len_torch_function_stack() > 0
        or torch._C._len_torch_dispatch_stack() > 0
        or torch.compiler.is_compiling()
        or not (set(map(type, grads)) <= _PLAIN_TYPES if plain is None else plain)
        or (dtype == torch.float16 and any(map(_IS_SPARSE, grads)))
    ):
        return 1
    return int(min(threads, len(grads) // (_SPLIT_MIN_TENSORS // 2)))


def _fused_pieces(
    pieces: SimpleQueue[list[torch.Tensor]], found_inf: torch.Tensor, inv: torch.Tensor
) -> list[tuple[list[torch.Tensor], NotImplementedError]]:
    """Run the fused kernel on pieces taken from ``pieces`` until none is left.

    Every thread of a split group runs this: a thread takes the next piece when it is free,
    so one that the machine preempts holds the others up by one piece at most. A piece the
    dispatcher refuses (it holds sparse tensors) is untouched, and is returned with the error.
    """
    refused: list[tuple[list[torch.Tensor], NotImplementedError]] = []
    with torch.no_grad():  # grad mode is thread-local; the caller's thread has it off already
        while True:
            try:
                piece = pieces.get_nowait()
            except Empty:
                return refused
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(piece, found_inf, inv)
            except NotImplementedError as exc:
                refused.append((piece, exc))


def _host_inverse(inv_scale: Any) -> Any:
    """The inverse scale for the native kernel: a float (``None``, check only: 1.0), a 0-d
    float32 CPU tensor as it is (the kernel reads it in place), or ``None`` where it is neither."""
    if type(inv_scale) is float:
        return inv_scale
    if inv_scale is None:
        return 1.0
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.dtype == torch.float32 and inv_scale.device.type == "cpu" and inv_scale.numel() == 1:
            return inv_scale
        return None
    if isinstance(inv_scale, (float, int, np.floating, np.integer)) and not isinstance(inv_scale, bool):
        return float(inv_scale)
    return None


def _native_cpu(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    inv: torch.Tensor | None,
    dtype: torch.dtype,
    plain: bool | None,
    inv_value: Any,
    writes: bool = True,
) -> bool | None:
    """Check and unscale CPU ``grads`` (one dtype) with ampscale's native kernel: whether every
    value written is finite, or ``None`` (nothing touched) where torch's own kernel must run.
    ``found_inf``, when given, is set to 1.0 on a non-finite step (as torch's kernel does).

    The kernel is the NumPy backend's (``ampscale/_native/cpu``), run on the tensors' memory
    through their data pointers: no copy, no buffer object per tensor, the work split over the
    cores by element count (torch's kernel runs a tensor below 32768 elements on one thread).
    The values written are torch's kernel's bit for bit: each element widened to float32
    (float64 stays float64), multiplied by the float32 inverse scale unless it is exactly 1,
    rounded to nearest even. The flag tests what is written (a finite value that overflows
    when unscaled, with a scale below 1, counts), which is the backend's flag for every scale.
    A NaN stays a NaN; its payload bits may differ from torch's, whose own differ between its
    vector widths and between the vector body and the tail of a tensor.

    Memory is checked in the same call, before any element changes: a buffer given twice is
    unscaled once, buffers that share memory in part are refused (:class:`AliasedGradientsError`).

    Torch's kernel runs instead for anything torch must see or that is not plain dense memory:
    a torch function or dispatch mode, functorch transforms or functionalization, compilation,
    tensor subclasses, tensors without a data pointer (sparse, mkldnn, batched, meta, fake), and
    non-contiguous ones. ``inv``: the inverse scale tensor (``None``: ``inv_value`` is it, a
    float or a 0-d float32 CPU tensor). ``writes``: whether the call unscales (a check-only call
    reads shared memory as it is).
    """
    kind = _NATIVE_KINDS.get(dtype)
    if kind is None or not _native_enabled[0] or _native is None or not _native_context():
        return None
    inverse = _host_inverse(inv) if inv_value is None else inv_value
    if inverse is None:
        return None  # an inverse scale torch's kernel refuses, with its own message
    if _EXCHANGE_API is not None:
        try:
            finite = _native.check_and_unscale_tensors(
                grads, _PLAIN_TUPLE, _EXCHANGE_API, inverse, writes, _native_threads()
            )
        except _native.OverlapError as exc:  # found before any element changed
            raise overlap_error(*exc.args) from None
        if finite is None:
            return None
    else:
        finite = _native_by_calls(grads, kind, float(inverse) if writes else 1.0, plain, writes)
        if finite is None:
            return None
    if not finite and found_inf is not None:
        found_inf.fill_(1.0)
    return bool(finite)


def _native_by_calls(
    grads: list[torch.Tensor], kind: int, inv_value: float, plain: bool | None, writes: bool
) -> bool | None:
    """:func:`_native_cpu`'s kernel call where torch has no DLPack exchange API: the memory of
    every tensor read through its methods (a few calls per tensor)."""
    if plain is not True and not set(map(type, grads)) <= _PLAIN_TYPES:
        return None
    if set(map(_DTYPE, grads)) != {_DTYPE_OF_KIND[kind]} or set(map(_GET_DEVICE, grads)) != {-1}:
        return None
    try:
        pointers = list(map(_DATA_PTR, grads))
    except RuntimeError:  # no storage: sparse, mkldnn, batched (vmap) tensors
        return None
    if not all(map(_IS_CONTIGUOUS, grads)):
        return None
    counts = list(map(_NUMEL, grads))
    if 0 in pointers and any(count for pointer, count in zip(pointers, counts, strict=True) if not pointer):
        return None  # elements without memory: meta, fake or functional tensors
    try:
        return bool(_native.check_and_unscale_at(pointers, counts, kind, inv_value, writes, _native_threads()))
    except _native.OverlapError as exc:  # found before any element changed
        raise overlap_error(*exc.args) from None


def _plain_cpu_dtype(leaves: list[torch.Tensor]) -> torch.dtype | None:
    """The one dtype of ``leaves`` where all are plain CPU tensors of one floating dtype the
    native kernel takes (one pass in C, through torch's DLPack exchange API), else ``None``.
    Call it where :func:`_native_ready` holds."""
    kind = _native.tensor_kind(leaves, _PLAIN_TUPLE, _EXCHANGE_API)
    return None if kind is None else _DTYPE_OF_KIND[kind]


def _fused_cpu(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv: torch.Tensor,
    dtype: Any,
    plain: bool | None,
    unscale_rest: Callable[[list[torch.Tensor], torch.Tensor], dict[torch.device, torch.Tensor]],
) -> None:
    """torch's fused kernel on CPU tensors, over pieces of the list in parallel threads.

    The list is cut into contiguous pieces (each thread then streams through neighbouring
    memory), which the calling thread and the workers take one at a time. Each piece runs
    the very same kernel, each thread with its own flag (the bits are those of one call);
    the flags are then combined into ``found_inf``. A piece refused because it holds sparse
    tensors is untouched, and goes through the sparse-aware path.
    """
    ways = _split_ways(grads, dtype, plain)
    if ways == 1:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        return
    size = max(_PIECE_MIN_TENSORS, min(_PIECE_TENSORS, len(grads) // (4 * ways)))
    pieces: SimpleQueue[list[torch.Tensor]] = SimpleQueue()
    for start in range(0, len(grads), size):
        pieces.put(grads[start : start + size])
    flags = [torch.zeros((), dtype=torch.float32) for _ in range(ways - 1)]
    pool = _split_pool(ways - 1)
    futures = [pool.submit(_fused_pieces, pieces, flag, inv) for flag in flags]
    try:
        refused = _fused_pieces(pieces, found_inf, inv)
    finally:  # never return (or raise) while a worker may still be writing
        for future in futures:
            exception = future.exception()
            if exception is not None:
                raise exception
    for future in futures:
        refused += future.result()
    for flag in flags:
        torch.maximum(found_inf, flag, out=found_inf)
    if not refused:
        return
    rest = [t for piece, _ in refused for t in piece]
    if len(rest) == len(grads):
        raise refused[0][1]  # nothing was touched: the caller takes the sparse-aware path
    for flag in unscale_rest(rest, inv).values():
        torch.maximum(found_inf, flag.to(found_inf.device), out=found_inf)


#: the C type of each dtype a host view reads and writes
_HOST_VIEW_TYPES = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double, torch.int32: ctypes.c_int32}


class _HostView:
    """A C view (``ctypes``) of a one-element CPU tensor's memory, kept while the tensor is the
    same object at the same address.

    Reading or writing ``_scale`` and ``_growth_tracker`` through its ``value`` costs a few tens
    of nanoseconds, against one to two microseconds for ``item()`` and ``fill_()``: the drop-in
    reads both and writes the tracker on every ``update()``. The tensor itself stays what torch
    has (the same object, updated in place); only its version counter does not move. The view
    holds the tensor, and :meth:`of` checks the tensor's address on every use, so a tensor given
    new memory (``set_()``, ``resize_()``) gets a new view before anything is read or written.
    """

    __slots__ = ("address", "tensor", "view")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.address = 0
        self.view: Any = None

    def of(self, tensor: torch.Tensor) -> Any:
        """The view of ``tensor`` (``None`` if it has none: not a plain one-element CPU tensor)."""
        address = tensor.data_ptr()
        if tensor is not self.tensor or address != self.address:
            self.tensor, self.address = tensor, address
            kind = _HOST_VIEW_TYPES.get(tensor.dtype)
            plain = (
                kind is not None
                and type(tensor) is torch.Tensor
                and tensor.is_cpu
                and tensor.numel() == 1
                and not tensor.requires_grad
                and not tensor.is_neg()
                and address != 0
            )
            self.view = kind.from_address(address) if plain and kind is not None else None
        return self.view

    def read(self, tensor: torch.Tensor) -> Any:
        view = self.of(tensor)
        return tensor.item() if view is None else view.value
