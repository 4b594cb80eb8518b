"""PyTorch backend: state on the gradients' device, the check + unscale fused, no host sync.

On the CPU the check + unscale is ampscale's own native kernel, the NumPy backend's
(``ampscale/_native/cpu``), run on the tensors' memory (read through torch's DLPack C exchange
API: no copy, no Python call per tensor) and split over the cores by element count; its values
are torch's kernel's bit for bit (see :func:`_native_cpu`). Where torch must see the op (a
torch function or dispatch mode, functorch, compilation, tensor subclasses) or the memory is
not plain dense memory (sparse, non-contiguous, meta), and on accelerators, it is
``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler`` uses:
gradients are grouped by device and dtype, checked in float32 opmath, multiplied by the inverse
scale, all in one launch per group. Where that kernel lacks a dtype (bfloat16 on CUDA), the
gradients are widened to float32, run through the same kernel and rounded back: the same bits;
which path a (device, dtype) pair uses is decided once, by trying the kernel.
:func:`native_cpu_kernel` turns the native CPU path off and on (``AMPSCALE_TORCH_NATIVE=0``).

State: on the CPU it is kept as Python scalars (the transition runs on the host, no tensor
kernels), exposed as 0-d CPU tensors; on an accelerator it is 0-d tensors on that device,
updated by the shared transition as tensor operations, asynchronously.

On CUDA the state is one packed record (:mod:`ampscale._native.cuda._packed`) and a step is
torch's fused kernel writing into the record's scratch, then one launch of ampscale's kernels
(the update, or the check of bfloat16 gradients and the loss with the transition in its last
block); while the host's bound of the scale is below 1 it is one launch of ampscale's kernel
for every contiguous gradient (it checks the values it writes, where torch's kernel would need
a second pass). A record or chunk table used on a stream other than the one it was allocated on gets
``record_stream`` for that stream. Under CUDA graph capture every step raises before any work:
the functional step writes a new record per step, so a replay would repeat the captured step;
the drop-in ``GradScaler``'s update is one in-place kernel on fixed buffers, but its scale's
host bound and its per-optimizer flags live in Python, where a replay does not reach, so it
refuses capture too (``ampscale._torch_scaler``).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ampscale import _tree
from ampscale._codegen import STATE_BYTES
from ampscale._config import ScalerConfig, _round_to
from ampscale._core import INT_FIELDS, ScalerState
from ampscale._native.cuda import _plan
from ampscale._native.cuda._packed import (
    FLAG_BOOL,
    FLAG_FALSE,
    FLAG_FOUND_INF,
    FLAG_TRUE,
    CudaStep,
    PackedState,
    decode,
    encode,
    offset_of,
)
from ampscale._ops import ArrayOps, HostOps, PlainNamespace, host_ops
from ampscale.backends._base import (
    Backend,
    WriteGuard,
    adapter_ready,
    internal_overlap_error,
    leaf_error,
    may_overlap_itself,
    meta_error,
    overlap_error,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = ["BACKEND", "TorchBackend", "native_cpu_kernel"]

_native: Any
try:  # ampscale's own host kernels, the NumPy backend's (absent from builds without a compiler)
    from ampscale._native.cpu import _numpy as _native
except ImportError:  # pragma: no cover - exercised only on builds without a C compiler
    _native = None

# (device, dtype) -> whether torch's fused kernel supports it (learned on first use)
_fused_support: dict[tuple[torch.device, torch.dtype], bool] = {}
_DTYPE = operator.attrgetter("dtype")
_GET_DEVICE = torch.Tensor.get_device
_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
#: the dtypes the fused kernel (or its exact float32 widening) unscales; others are refused up
#: front, since the kernel would raise only when it reached them, after unscaling earlier ones
_UNSCALABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_scratch = threading.local()
_inverses: dict[float, float] = {}
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


_FOUND_NONE = torch.zeros(())  # found_inf 0 and 1: logical_not() makes a new flag cheaply
_FOUND_ONE = torch.ones(())
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


class _no_grad:
    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.previous)


class UncoalescedSparseError(ValueError):
    """A float16 sparse gradient must be coalesced before it is unscaled."""


def _is_cpu(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


#: the transition's operations as plain torch calls (fill kernels for constants)
_TRANSITION_XP = PlainNamespace(
    torch,
    torch.bool,
    lambda x, dtype: x.to(dtype),
    lambda value, dtype, device: torch.full((), value, dtype=dtype, device=device),
)


#: float32 elements widened at a time by the 16-bit fallback (256 MiB of copies)
_WIDE_BATCH_ELEMENTS = 1 << 26

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


def _batches(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` of at most ``limit`` elements (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = [[]]
    count = 0
    for t in tensors:
        n = t.numel()
        if out[-1] and count + n > limit:
            out.append([])
            count = 0
        out[-1].append(t)
        count += n
    return out


def _refuse_dtypes(
    leaves: Sequence[Any], dtypes: set[Any], spec: Any, what: str, backend: Backend | None = None
) -> None:
    """``TypeError`` for a dtype the kernel cannot unscale (integers, complex, float8, ...)."""
    for dtype in dtypes - _UNSCALABLE:
        index = next(i for i, leaf in enumerate(leaves) if leaf.dtype == dtype)
        paths = (backend or BACKEND).leaf_paths(spec) if spec is not None else None
        kind = "a floating-point dtype ampscale does not unscale" if dtype.is_floating_point else "not floating point"
        raise leaf_error(
            TypeError,
            f"{what} {{}} has dtype {str(dtype).replace('torch.', '')} ({kind}); it must be float16, "
            "bfloat16, float32 or float64",
            index,
            paths=paths,
        )


def _may_overflow(inv_scale: Any, scale_floor: float | None) -> bool:
    """Whether unscaling by ``inv_scale`` may turn a finite value into inf: a scale below 1.

    With an inverse of at most 1 no product exceeds its input, so the kernel's check of the
    inputs is the check of the values written. A host inverse is known here. A device one is
    not read (that would wait for the device): ``scale_floor``, a lower bound of the scale known
    on the host, decides, and without one the values written are checked.
    """
    if inv_scale is None:
        return False
    if isinstance(inv_scale, torch.Tensor):
        return scale_floor is None or not scale_floor >= 1.0
    return not inv_scale <= 1.0


def _memory_of(t: torch.Tensor) -> torch.Tensor:
    return t._values() if t.is_sparse else t


#: lists up to this length are checked for shared memory without NumPy
_SMALL_LIST = 256


def _distinct_memory(leaves: list[torch.Tensor], writes: bool, itemsize: int | None = None) -> list[torch.Tensor]:
    """The leaves to run the kernel on: each memory location once, checked before any change.

    Returns ``leaves`` itself when no two share memory. A buffer given twice (the same tensor,
    or views of exactly the same elements with one dtype) is kept once: every place in the tree
    shows the result. Raises :class:`AliasedGradientsError` for partial overlap, or for a
    tensor whose own elements share memory (a stride of 0, as ``autograd.grad`` returns for a
    broadcast bias), which torch's kernel refuses only when it reaches it. Three passes over
    the leaves' attributes in C (pointer, size, contiguity) and one sort.
    ``writes``: whether the call unscales (a check-only call reads each location, whatever
    aliases it; a tensor that overlaps itself is then checked through a contiguous copy).
    ``itemsize``: the element size when all leaves are known to share one dtype.
    """
    if not leaves:
        return leaves
    if len(leaves) == 1:
        leaf = leaves[0]
        if leaf.is_meta:
            raise meta_error(0)
        if leaf.is_sparse or _IS_CONTIGUOUS(leaf):
            return leaves
        return _self_overlaps(leaves, writes)
    try:
        pointers = list(map(_DATA_PTR, leaves))
    except RuntimeError:  # sparse tensors have no data pointer: their values are what changes
        return _distinct_memory_sparse(leaves, writes)
    if 0 in pointers:  # empty tensors, or meta tensors (no data at all): refused
        _refuse_meta(leaves, pointers)
    dense = all(map(_IS_CONTIGUOUS, leaves))
    if not dense:
        leaves = _self_overlaps(leaves, writes)
    if not writes:
        return leaves
    if dense and len(leaves) <= _SMALL_LIST:
        # a short list (a small model's gradients): plain Python, since NumPy's calls on a few
        # dozen values cost more than the work (and their code evicts the caller's from cache)
        if itemsize is None:
            spans = sorted(zip(pointers, map(_NBYTES, leaves), strict=True))
        else:
            spans = sorted(zip(pointers, map(_NUMEL, leaves), strict=True))
        end = 0
        for start, size in spans:
            if size and start:  # empty and meta tensors have no memory
                if start < end:
                    break
                end = start + (size if itemsize is None else size * itemsize)
        else:
            return leaves
    starts = np.array(pointers, np.int64)
    # a contiguous tensor spans its numel() elements; the few others are measured one by one
    if dense and itemsize is not None:
        sizes = np.fromiter(map(_NUMEL, leaves), np.int64, len(leaves)) * itemsize
    else:
        sizes = np.fromiter(map(_NBYTES if dense else _span_bytes, leaves), np.int64, len(leaves))
    sizes[starts == 0] = 0  # meta tensors (no memory) and empty ones
    order = np.argsort(starts, kind="stable")
    low = starts[order]
    high = low + sizes[order]
    reach = np.maximum.accumulate(high)
    if not np.any((low[1:] < reach[:-1]) & (sizes[order][1:] > 0)):
        return leaves
    return _resolve_overlaps(leaves, [int(i) for i in order], starts, sizes)


def _refuse_meta(leaves: list[torch.Tensor], pointers: list[int]) -> None:
    """Raise for the first meta tensor among the leaves without memory (a check, before any change)."""
    for index, (leaf, pointer) in enumerate(zip(leaves, pointers, strict=True)):
        if pointer == 0 and leaf.is_meta:
            raise meta_error(index)


def _span_bytes(t: torch.Tensor) -> int:
    if _IS_CONTIGUOUS(t):
        return int(t.nbytes)
    if t.numel() == 0:
        return 0
    return int((sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size())


def _self_overlaps(leaves: list[torch.Tensor], writes: bool) -> list[torch.Tensor]:
    """``leaves``, refusing (``writes``) or copying (reads) tensors that overlap themselves."""
    out = leaves
    for index, t in enumerate(leaves):
        if t.is_sparse or _IS_CONTIGUOUS(t) or not may_overlap_itself(t.shape, t.stride(), 1):
            continue
        if writes:
            raise internal_overlap_error(index, t.shape, t.stride(), "tensor.contiguous()")
        if out is leaves:
            out = list(leaves)
        out[index] = t.contiguous()  # only read: a copy has the same values, and torch takes it
    return out


def _distinct_memory_sparse(leaves: list[torch.Tensor], writes: bool) -> list[torch.Tensor]:
    memory = [_memory_of(t) for t in leaves]
    distinct = _distinct_memory(memory, writes)
    if distinct is memory:
        return leaves
    kept = {id(t) for t in distinct}
    return [t for t, m in zip(leaves, memory, strict=True) if id(m) in kept]


class _Layout:
    """A tensor's memory layout as a NumPy array interface (addresses only: never read)."""

    def __init__(self, t: torch.Tensor) -> None:
        size = t.element_size()
        self.__array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": f"|V{size}",
            "data": (t.data_ptr(), False),
            "strides": tuple(stride * size for stride in t.stride()),
            "version": 3,
        }


def _layout(t: torch.Tensor) -> np.ndarray:
    return np.asarray(_Layout(t))


def _resolve_overlaps(leaves: list[torch.Tensor], order: list[int], starts: Any, sizes: Any) -> list[torch.Tensor]:
    """The exact look at leaves whose memory ranges meet: repeats dropped, partial overlap refused."""
    repeats: set[int] = set()
    active: list[int] = []
    for index in order:
        if sizes[index] == 0:
            continue
        low = starts[index]
        active = [i for i in active if starts[i] + sizes[i] > low]
        for other in active:
            a, b = leaves[other], leaves[index]
            same = starts[other] == low and sizes[other] == sizes[index] and a.dtype == b.dtype
            layout = (a.stride() == b.stride() and a.shape == b.shape) or (_IS_CONTIGUOUS(a) and _IS_CONTIGUOUS(b))
            if same and layout:
                repeats.add(index)
                break
            if np.shares_memory(_layout(a), _layout(b)):  # exact, from addresses and strides
                raise overlap_error(min(index, other), max(index, other))
        else:
            active.append(index)
    return [t for i, t in enumerate(leaves) if i not in repeats]


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


# ------------------------------------------------------------------------------ CUDA helpers

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


class TorchBackend(Backend, CudaStep):
    """The PyTorch adapter."""

    name: ClassVar[str] = "torch"
    in_place: ClassVar[bool] = True
    lazy_state: ClassVar[bool] = True  # created on the device of the first tensors, as torch does

    def __init__(self) -> None:
        self._constants: dict[tuple[float, torch.device], torch.Tensor] = {}

    # -- arrays ----------------------------------------------------------------------------
    def flatten(self, tree: Any) -> tuple[list[Any], Any]:
        kind = type(tree)
        if (kind is list or kind is tuple) and set(map(type, tree)) <= _PLAIN_TYPES:
            # a flat list of plain tensors, the usual gradients: validate() and the thread
            # split need not look at the types again
            leaves = list(tree)
            _scratch.plain = leaves
            return leaves, _tree.flat_spec(kind, len(leaves))
        return _tree.flatten(tree)

    def owns(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def owns_type(self, kind: type) -> bool:
        return issubclass(kind, torch.Tensor)

    def is_floating_dtype(self, dtype: Any) -> bool:
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point

    def namespace(self) -> Any:
        import array_api_compat.torch as xp

        return xp

    def has_float64(self, like: Any) -> bool:
        return not isinstance(like, torch.Tensor) or like.device.type != "mps"

    def device_of(self, like: Any) -> Any:
        return like.device if isinstance(like, torch.Tensor) else torch.device("cpu")

    def constant(self, value: float, device: torch.device) -> torch.Tensor:
        """A cached 0-d float32 tensor (scales and inverse scales repeat from step to step)."""
        key = (value, device)  # torch.device hashes fast enough; values are Python floats
        tensor = self._constants.get(key)
        if tensor is None:
            if len(self._constants) > 256:
                self._constants.clear()
            tensor = self._constants[key] = torch.full((), value, dtype=torch.float32, device=device)
        return tensor

    # -- the fused hot path -----------------------------------------------------------------
    def found_inf_and_unscale(
        self,
        leaves: Sequence[torch.Tensor],
        inv_scale: Any,
        scratch: bool = False,
        found_inf: torch.Tensor | None = None,
        scale_floor: float | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """Check and unscale in place; return a float32 ``found_inf`` (0 or 1) per device.

        ``inv_scale`` is a 0-d float32 tensor, a Python float, or ``None`` (check only).
        Sparse gradients are checked and unscaled through their values (float16 ones must be
        coalesced first, since duplicates may overflow when summed; ``GradScaler`` does it).
        With ``scratch`` the flag tensors are reused per thread (the caller consumes them
        before the next call). ``found_inf``: the flag each device starts from, copied there
        (as ``torch.amp.GradScaler._unscale_grads_`` does); zeros when ``None``.
        ``scale_floor``: a host lower bound of a device scale (see
        :meth:`check_and_unscale_bounded`).

        Everything that could make torch's kernel raise part way (a dtype it lacks, a tensor
        whose elements share memory, two gradients that share memory in part) is refused
        before the first element changes; a buffer given twice is unscaled once.
        """
        validated = getattr(_scratch, "validated", None)
        _scratch.validated = None
        if validated is not None and validated[0] is leaves:
            dtypes = validated[1]  # computed by validate() for this very list
        else:
            dtypes = set(map(_DTYPE, leaves))
            _refuse_dtypes(leaves, dtypes, None, "gradient")
        if len(dtypes) == 1 and leaves and _native_ready():
            # CPU tensors of one dtype: ampscale's kernel (it finds shared memory itself)
            grads = leaves if type(leaves) is list else list(leaves)
            (dtype,) = dtypes
            finite = _native_cpu(grads, None, None, dtype, None, _host_inverse(inv_scale), inv_scale is not None)
            if finite is not None:
                cpu = grads[0].device
                flag = self._found_inf(cpu, scratch, found_inf)
                if not finite:
                    flag.fill_(1.0)
                return {cpu: flag}
        leaves = _distinct_memory(list(leaves), inv_scale is not None)
        needs_output_check = _may_overflow(inv_scale, scale_floor)
        if len(dtypes) == 1 and len(set(map(_GET_DEVICE, leaves))) == 1:
            # The common case, one launch: every gradient on one device with one dtype.
            device, dtype = leaves[0].device, leaves[0].dtype
            flag = self._found_inf(device, scratch, found_inf)
            inv_value = _host_inverse(inv_scale)
            try:
                with _no_grad():
                    inv = self._inverse_on(inv_scale, device)
                    checked = self._check_and_unscale_group(leaves, flag, inv, device, dtype, None, inv_value)
                    if needs_output_check and not checked:
                        self._check_and_unscale_group(leaves, flag, self.constant(1.0, device), device, dtype)
                return {device: flag}
            except NotImplementedError:
                # sparse gradients: the dispatcher refused the whole call, nothing was touched
                if not any(leaf.is_sparse for leaf in leaves):
                    raise
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for leaf in leaves:
            if leaf.is_sparse:
                if leaf.dtype == torch.float16 and not leaf.is_coalesced():
                    raise UncoalescedSparseError(
                        "float16 sparse gradients must be coalesced before unscaling (duplicates may "
                        "overflow when summed); call .coalesce() first (GradScaler does it for you)"
                    )
                leaf = leaf._values()
            groups.setdefault((leaf.device, leaf.dtype), []).append(leaf)
        found: dict[torch.device, torch.Tensor] = {}
        inv_value = _host_inverse(inv_scale)
        with _no_grad():
            for (device, dtype), grads in groups.items():
                flag = found.get(device)
                if flag is None:
                    flag = found[device] = self._found_inf(device, scratch, found_inf)
                inv = self._inverse_on(inv_scale, device)
                checked = self._check_and_unscale_group(grads, flag, inv, device, dtype, None, inv_value)
                if needs_output_check and not checked:
                    self._check_and_unscale_group(grads, flag, self.constant(1.0, device), device, dtype)
        return found

    @staticmethod
    def _single_group(leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool | None] | None:
        """``(first leaf, plain)`` when all leaves share a device and a dtype.

        ``plain``: whether all leaves are known to be plain tensors (``None``: not known).
        """
        if not leaves:
            return None
        validated = _scratch.__dict__.pop("validated", None)
        if validated is None or validated[0] is not leaves:
            validated = None
        if len(leaves) == 1:
            leaf = leaves[0]
            if validated is None and leaf.dtype not in _UNSCALABLE:
                _refuse_dtypes(leaves, {leaf.dtype}, None, "gradient")
            return leaf, None
        dtypes = set(map(_DTYPE, leaves)) if validated is None else validated[1]
        if validated is None:
            _refuse_dtypes(leaves, dtypes, None, "gradient")
        if len(dtypes) != 1:
            return None
        if validated is not None and validated[3]:
            return leaves[0], validated[2]  # validate() saw plain CPU tensors (the native check)
        # get_device() is fast; it is -1 for the CPU and the meta device alike, which torch's
        # kernel takes in one call (the caller keys its flag by the first leaf's device)
        devices = set(map(_GET_DEVICE, leaves))
        if len(devices) != 1:
            return None
        return leaves[0], None if validated is None else validated[2]

    def _found_inf(self, device: torch.device, scratch: bool, initial: torch.Tensor | None = None) -> torch.Tensor:
        if initial is not None:
            return initial.to(device, copy=True)
        if not scratch:
            return torch.zeros((), dtype=torch.float32, device=device)
        buffers = getattr(_scratch, "buffers", None)
        if buffers is None:
            buffers = _scratch.buffers = {}
        buffer = buffers.get(device)
        if buffer is None:
            buffer = buffers[device] = torch.zeros((), dtype=torch.float32, device=device)
            return buffer
        return buffer.zero_()

    def _inverse_on(self, inv_scale: Any, device: torch.device) -> torch.Tensor:
        if inv_scale is None:
            return self.constant(1.0, device)
        if isinstance(inv_scale, torch.Tensor):
            return inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        return self.constant(float(inv_scale), device)

    def _check_and_unscale_group(
        self,
        grads: list[torch.Tensor],
        found_inf: torch.Tensor,
        inv: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        plain: bool | None = None,
        inv_value: Any = None,
    ) -> bool:
        """torch's fused kernel on one (device, dtype) group, or ampscale's native kernel on CPU
        tensors (:func:`_native_cpu`). Returns whether the values written were checked too (the
        native kernel checks what it writes; torch's checks its inputs). ``inv_value``: the
        float ``inv`` holds, when the caller knows it (saves reading the tensor)."""
        if device.type == "cpu" and _native_cpu(grads, found_inf, inv, dtype, plain, inv_value) is not None:
            return True
        key = (device, dtype)
        supported = _fused_support.get(key)
        if supported is not False:
            try:
                if supported and len(grads) >= _SPLIT_MIN_TENSORS and device.type == "cpu":
                    self._fused_cpu(grads, found_inf, inv, dtype, plain)
                else:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
                _fused_support[key] = True
                return False
            except RuntimeError as exc:
                if supported or "not implemented" not in str(exc).lower():
                    raise
                _fused_support[key] = False  # e.g. bfloat16 on CUDA: nothing was touched
        if (
            dtype in (torch.float16, torch.bfloat16)
            and _fused_support.get((device, torch.float32)) is not False
            and not any(g.is_sparse for g in grads)
        ):
            # Widen to float32 (exact), run the fused kernel on the copies (the check, and the
            # multiply in float32 opmath), round back to nearest even: the same bits the kernel
            # gives where it has the dtype. In batches, to bound the extra memory.
            for batch in _batches(grads, _WIDE_BATCH_ELEMENTS):
                wide = [g.float() for g in batch]
                self._check_and_unscale_group(wide, found_inf, inv, device, torch.float32)
                torch._foreach_copy_(batch, wide)
            return False
        # Exact generic fallback: check the inputs, then multiply in float32 opmath (float64
        # for float64) one tensor at a time (a foreach multiply would round the factor to the
        # tensors' dtype first).
        flags = torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads]).any()
        found_inf.add_(flags.to(torch.float32)).clamp_(max=1.0)
        for g in grads:
            if g.dtype in (torch.float16, torch.bfloat16):
                g.copy_(g.float().mul_(inv))
            else:
                g.mul_(inv)
        return False

    def _fused_cpu(
        self,
        grads: list[torch.Tensor],
        found_inf: torch.Tensor,
        inv: torch.Tensor,
        dtype: Any,
        plain: bool | None = None,
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
        for flag in self.found_inf_and_unscale(rest, inv).values():
            torch.maximum(found_inf, flag.to(found_inf.device), out=found_inf)

    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        return self.check_and_unscale_bounded(leaves, inv_scale, None)

    def check_and_unscale_bounded(
        self, leaves: Sequence[Any], inv_scale: Any, scale_floor: float | None
    ) -> tuple[list[Any], Any]:
        """:meth:`check_and_unscale`, where the values written are checked only if they may overflow.

        torch's kernel checks the inputs. With a scale below 1 a finite input may overflow when
        unscaled, so a check-only pass over the values written follows; with a scale of at
        least 1 it cannot, and there is no second pass. A CPU scale is a host value; a device
        scale is known only through ``scale_floor``, a lower bound the scaler keeps on the host
        (``None``: unknown, so the second pass runs).
        """
        fast = self._single_group(leaves)
        if fast is not None:
            # One device, one dtype: a single kernel launch on a per-thread scratch flag.
            first, plain = fast
            device = first.device
            if device.type == "cpu":
                grads = leaves if type(leaves) is list else list(leaves)
                # ampscale's kernel, which also finds shared memory (before any change)
                finite = _native_cpu(
                    grads, None, None, first.dtype, plain, _host_inverse(inv_scale), inv_scale is not None
                )
                if finite is not None:
                    return grads, (_FOUND_NONE if finite else _FOUND_ONE).logical_not()  # a new tensor
            # keyed by the device itself: get_device() is -1 for the CPU and the meta device alike
            flags: dict[torch.device, torch.Tensor] = _scratch.__dict__.setdefault("flags", {})
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            else:
                flag.zero_()
            inv = self._inverse_on(inv_scale, device)
            grads = leaves if type(leaves) is list else list(leaves)
            distinct = _distinct_memory(grads, inv_scale is not None, first.element_size())
            previous = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                checked = self._check_and_unscale_group(
                    distinct, flag, inv, device, first.dtype, plain, _host_inverse(inv_scale)
                )
                if not checked and _may_overflow(inv_scale, scale_floor):
                    # a scale below 1: the kernel checked the inputs, and a finite input may
                    # have overflowed when unscaled, so the values written are checked too
                    one = self.constant(1.0, device)
                    self._check_and_unscale_group(distinct, flag, one, device, first.dtype, plain)
            except NotImplementedError:
                if not any(leaf.is_sparse for leaf in leaves):
                    raise
            else:
                return grads, flag.logical_not()  # a new tensor: the scratch flag stays ours
            finally:
                torch._C._set_grad_enabled(previous)
        found = self.found_inf_and_unscale(leaves, inv_scale, scratch=True, scale_floor=scale_floor)
        if len(found) == 1:
            (found_inf,) = found.values()
        else:
            first = next(iter(found.values()))
            found_inf = sum(f.to(first.device, non_blocking=True) for f in found.values())
        return list(leaves), found_inf.logical_not()  # a new tensor: the scratch flag stays ours

    def validate(self, leaves: Sequence[Any], spec: Any, what: str = "gradient") -> set[Any] | None:
        plain = _scratch.__dict__.pop("plain", None) is leaves  # flatten() made this list
        if len(leaves) == 1:  # the common loss / single-tensor case, without building sets
            leaf = leaves[0]
            if type(leaf) in _PLAIN_TYPES and leaf.dtype in _UNSCALABLE:
                _scratch.validated = None
                return {leaf.dtype}
        _scratch.validated = None
        if type(leaves) is list and len(leaves) > 1 and _native_ready():
            # one pass in C (torch's DLPack exchange API): plain CPU tensors of one float dtype
            # are valid as they are; anything else is looked at below
            kind = _native.tensor_kind(leaves, _PLAIN_TUPLE, _EXCHANGE_API)
            if kind is not None:
                dtypes = {_DTYPE_OF_KIND[kind]}
                _scratch.validated = (leaves, dtypes, True, True)
                return dtypes
        if not plain:
            types = set(map(type, leaves))
            for kind in types:
                if not issubclass(kind, torch.Tensor):
                    self._reject(leaves, spec, next(i for i, leaf in enumerate(leaves) if type(leaf) is kind), what)
            plain = types <= _PLAIN_TYPES
        dtypes = set(map(_DTYPE, leaves))
        _refuse_dtypes(leaves, dtypes, spec, what, self)
        # check_and_unscale, called next with this list, reuses what was learnt (one pass each)
        _scratch.validated = (leaves, dtypes, plain, False)
        return dtypes

    def all_finite(self, leaves: Sequence[Any]) -> Any:
        return self.check_and_unscale(leaves, None)[1]

    def check_unscale_and_count(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any, Any]:
        """:meth:`check_and_unscale`, and the fraction of scaled values that are zero or subnormal.

        Counted on the inputs, before they are unscaled, with one reduction per leaf and no
        host read (a 0-d float64 tensor on the first leaf's device; float32 on MPS). Dense
        tensors count every element, strided views and read-only ones included; a sparse
        gradient (``nn.Embedding(sparse=True)``) counts its stored values, the rows the batch
        touched. Refusals (shared memory, meta tensors) come first: nothing is counted or
        changed for a tree that will be refused.
        """
        grads = list(leaves)
        _distinct_memory(grads, inv_scale is not None)  # refuse before any work
        tiny: dict[torch.device, torch.Tensor] = {}
        total = 0
        with _no_grad():
            for leaf in grads:
                values = leaf._values() if leaf.is_sparse else leaf
                count = (values.abs() < torch.finfo(values.dtype).tiny).sum()
                previous = tiny.get(values.device)
                tiny[values.device] = count if previous is None else previous + count
                total += values.numel()
        out, finite = self.check_and_unscale(grads, inv_scale)
        home = grads[0].device if grads else torch.device("cpu")
        wide = torch.float64 if self.has_float64(grads[0] if grads else None) else torch.float32
        counted = torch.zeros((), dtype=wide, device=home)
        for count in tiny.values():
            counted += count.to(home, non_blocking=True)
        return out, finite, counted / max(total, 1)

    # -- state ------------------------------------------------------------------------------
    def host(self, state: ScalerState) -> bool:
        """Whether ``state`` is kept on the host (Python scalars) rather than device tensors."""
        return not isinstance(state, PackedState) and not isinstance(state.scale, torch.Tensor)

    def make_state(self, values: ScalerState, config: ScalerConfig, like: Any = None, previous: Any = None) -> Any:
        if _is_cpu(like):
            return values if type(values) is ScalerState else ScalerState._make(values)
        if _cuda_module(config, like.device) is not None:
            return _packed_from_values(values, config, like.device)
        return super().make_state(values, config, like, previous)

    def read_state(self, state: ScalerState) -> ScalerState:
        if isinstance(state, PackedState):
            return decode(state.buffer.cpu().numpy(), state.scale_dtype)  # one copy (a sync)
        if self.host(state):
            return state
        return super().read_state(state)

    def public_state(self, state: ScalerState, config: ScalerConfig) -> ScalerState:
        if isinstance(state, PackedState):
            return state.fields()
        if not self.host(state):
            return state
        scale_dtype = torch.float64 if config.scale_dtype == "float64" else torch.float32
        return ScalerState(
            *(
                torch.tensor(v, dtype=torch.int32 if f in INT_FIELDS else scale_dtype)
                for f, v in zip(ScalerState._fields, state, strict=True)
            )
        )

    def ops(self, config: ScalerConfig, state: ScalerState) -> ArrayOps | HostOps:
        if isinstance(state, PackedState):
            return None  # type: ignore[return-value] # run_transition launches the emitted C
        if self.host(state):
            return host_ops(config)
        device = state.scale.device
        key = f"torch:{device}"
        ops = config._cache.get(key)
        if ops is None:
            ops = config._cache[key] = ArrayOps(
                config, _TRANSITION_XP, device, self.has_float64(state.scale), cache_constants=True
            )
        return ops  # type: ignore[no-any-return]

    def state_device_matches(self, state: ScalerState, like: Any) -> bool:
        if isinstance(state, PackedState):
            return isinstance(like, torch.Tensor) and like.device == state.buffer.device
        return self.host(state) == _is_cpu(like) and (
            self.host(state) or not isinstance(like, torch.Tensor) or like.device == state.scale.device
        )

    def run_transition(
        self, config: ScalerConfig, state: Any, finite: Any, loss_finite: Any, ops: Any
    ) -> tuple[Any, ScalerState | None, Any]:
        if (
            type(state) is ScalerState
            and isinstance(state.scale, torch.Tensor)
            and state.scale.is_cuda
            and _cuda_module(config, state.scale.device) is not None
        ):
            # an unpacked device state (GradScaler.update(new_scale) replaces the scale): pack it
            state = _packed_from_fields(state, config)
        if not isinstance(state, PackedState):
            if ops is None:
                ops = self.ops(config, state)
            return super().run_transition(config, state, finite, loss_finite, ops)
        module = _cuda_module(config, state.buffer.device)
        _refuse_capture("update()")
        nxt = self.update_packed(module, state, finite, loss_finite)
        return nxt, None, nxt.view("floor_event")

    # -- CUDA: the packed state and the one-launch update ------------------------------------
    def new_record(self, like: PackedState, zero: bool = False) -> PackedState:
        make = torch.zeros if zero else torch.empty
        device = like.buffer.device
        buffer = make(_RECORD_FLOATS, dtype=torch.float32, device=device)
        return _TorchPacked(buffer, buffer.data_ptr(), like.scale_dtype, _raw_stream(device))

    def current_stream(self, state: PackedState) -> int:
        return _raw_stream(state.buffer.device)

    def keep_for_stream(self, buffers: tuple[Any, ...], stream: int) -> None:
        for buffer in buffers:
            _record_stream(buffer)

    def flag_argument(self, flag: Any, state: PackedState) -> tuple[int, int, Any]:
        if isinstance(flag, bool):
            return 0, FLAG_TRUE if flag else FLAG_FALSE, None
        if not isinstance(flag, torch.Tensor):
            flag = torch.as_tensor(flag)
        if flag.device != state.buffer.device:
            flag = flag.to(state.buffer.device, non_blocking=True)
        if flag.dtype == torch.bool:
            return flag.data_ptr(), FLAG_BOOL, flag
        flag = flag.to(torch.bool)
        return flag.data_ptr(), FLAG_BOOL, flag

    def fused_unscale(
        self, config: ScalerConfig, state: Any, leaves: list[Any], loss: Any, scale_floor: float | None = None
    ) -> tuple[list[Any], Any, Any] | None:
        if not isinstance(state, PackedState):
            return None
        if config.grad_dtype == "promote":  # float32 copies of the 16-bit leaves, checked and unscaled
            leaves = self.promote(leaves)
        device = state.buffer.device
        module = _cuda_module(config, device)
        # every memory location once, and refusals before anything changes (as check_and_unscale)
        distinct = _distinct_memory(list(leaves), config.scales)
        # While the scale may be below 1 (a host bound, no device read), ampscale's kernel
        # checks and unscales every contiguous gradient: one launch, where torch's kernel would
        # need a second pass to check what it wrote, and then the update (three launches)
        inv = state.view("inv_scale")
        below_one = config.scales and _may_overflow(inv, scale_floor)
        plan = _cuda_plan(distinct, loss, device, every_dtype=below_one)
        if module is None or plan is None:
            return None
        torch_groups, own, loss_tensor = plan
        if not config.scales and not all(t.is_contiguous() for group in torch_groups for t in group):
            return None  # guard mode checks every leaf in ampscale's kernel, which needs them contiguous
        _refuse_capture("unscale()")
        stream = self.current_stream(state)
        if not config.scales:
            own = distinct  # guard mode: check only, in ampscale's kernel (nothing written)
        # everything that can refuse is decided before torch's kernel changes a gradient: the
        # chunk table and the grid of ampscale's kernel (0 blocks: none is launched)
        table, grad_chunks = self._chunk_table(own, device, stream) if own else (None, 0)
        loss_ptr, meta, loss_chunks = _loss_argument(loss_tensor)
        scratch = self.scratch_for(state, stream)
        if config.scales:
            with _no_grad():
                # torch's own kernel (GradScaler's), its flag pointed at the record's scratch; it
                # checks the inputs, so while the scale may be below 1 a check-only pass of the
                # values written follows (only non-contiguous gradients are left to it then)
                found_inf = scratch.view("found_inf")
                written = self.constant(1.0, device) if below_one else None
                for group in torch_groups:
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
                    if written is not None:
                        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, written)
        if grad_chunks + loss_chunks:
            # ampscale's kernel: bfloat16 gradients (torch's kernel has none on CUDA), every
            # contiguous gradient while the scale may be below 1, and the loss; then the
            # transition in its last block
            options = (_plan.MULTIPLY if config.scales else 0) | _plan.TAIL
            nxt = self.new_record(state)
            module.launch(
                module.step,
                module.context,
                grad_chunks + loss_chunks,
                _plan.BLOCK_THREADS,
                stream,
                0 if table is None else table.data_ptr(),
                grad_chunks,
                loss_ptr,
                meta,
                state.ptr + _INV_OFFSET,
                scratch.ptr,
                state.ptr,
                nxt.ptr,
                options,
            )
            self.used_on(stream, state, scratch)
        else:
            # nothing for ampscale's kernel (no bfloat16 gradient or loss to check, or only empty
            # ones): the transition, reading torch's flag from the scratch (and resetting it)
            found = (scratch.ptr + _FOUND_INF_OFFSET, FLAG_FOUND_INF)
            nxt = self.launch_update(module, state, stream, found, (0, FLAG_TRUE), scratch)
        finite = nxt.view("finite")
        loss_finite = None if loss is None else nxt.view("loss_finite")
        state.pending = (finite, loss_finite, nxt)
        return leaves, finite, loss_finite

    def _chunk_table(
        self, leaves: list[torch.Tensor], device: torch.device, stream: int
    ) -> tuple[torch.Tensor | None, int]:
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

    # -- small helpers ----------------------------------------------------------------------
    def multiply_by_scale(self, loss: Any, scale: Any) -> Any:
        if not isinstance(scale, torch.Tensor):
            scale = self.constant(float(scale), loss.device)
        elif scale.dtype != torch.float32:
            scale = scale.to(torch.float32)
        # torch.amp.GradScaler: outputs * scale (a float32 0-d tensor), with torch's promotion
        return loss * scale.to(device=loss.device, non_blocking=True)

    def inverse_scale(self, scale: Any) -> Any:
        if not isinstance(scale, torch.Tensor):
            inverse = _inverses.get(scale)
            if inverse is None:
                if len(_inverses) > 1024:
                    _inverses.clear()
                inverse = _inverses[scale] = _round_to(1.0 / float(scale), "float32")
            return inverse
        # exactly torch.amp.GradScaler's: reciprocal in float64, then float32
        if scale.device.type == "mps":
            return scale.float().reciprocal()
        return scale.double().reciprocal().float()

    def to_device_of(self, value: Any, like: Any) -> Any:
        if isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor) and value.device != like.device:
            return value.to(like.device, non_blocking=True)
        return value

    def logical_and(self, a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device != b.device:
            b = b.to(a.device, non_blocking=True)
        return torch.logical_and(a, b)

    def as_bool(self, value: Any, like: Any = None) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.dtype == torch.bool else value.to(torch.bool)
        return torch.tensor(bool(value), device=self.device_of(like))

    def host_flag(self, finite: Any) -> bool | None:
        # on the CPU the flag is host memory: no sync, and no work on a skipped step
        return bool(finite) if _is_cpu(finite) else None

    def copy_leaf(self, leaf: Any) -> Any:
        return leaf.detach().clone()

    def same_bits(self, a: Any, b: Any) -> bool:
        bits = _BITS.get(a.element_size())
        if bits is None or a.dtype != b.dtype:
            return bool(torch.equal(a, b))
        return bool(torch.equal(a.view(bits), b.view(bits)))

    @contextlib.contextmanager
    def guard_writes(self, arrays: Sequence[Any]) -> Iterator[WriteGuard]:
        # torch counts every in-place write into a tensor (or a view of its memory): exact, but
        # seen after the call, where NumPy's read-only arrays refuse the write itself
        yield _VersionGuard(arrays)

    def masked_add_(self, finite: Any, targets: Sequence[Any], updates: Sequence[Any], alpha: float) -> None:
        if _is_cpu(finite):
            if bool(finite):  # host memory: nothing to do on an overflow
                for target, update in zip(targets, updates, strict=True):
                    target.add_(update if alpha == 1 else alpha * update)
            return
        flag = self.as_bool(finite)
        for target, update in zip(targets, updates, strict=True):
            new = target + (update if alpha == 1 else alpha * update)
            target.copy_(torch.where(flag.to(target.device, non_blocking=True), new, target))

    def masked_copy_(self, finite: Any, targets: Sequence[Any], values: Sequence[Any]) -> None:
        if _is_cpu(finite):
            if bool(finite):
                for target, value in zip(targets, values, strict=True):
                    target.copy_(value)
            return
        flag = self.as_bool(finite)
        for target, value in zip(targets, values, strict=True):
            target.copy_(torch.where(flag.to(target.device, non_blocking=True), value.to(target.dtype), target))

    def agree(self, finite: Any, group: Any) -> Any:
        if group is None or callable(group):
            return super().agree(finite, group) if group is None else self.as_bool(group(finite), finite)
        found_inf = torch.logical_not(finite).to(torch.float32)
        self._all_reduce_max(found_inf, group)
        return found_inf == 0

    def agree_flags(self, finite: Any, loss_finite: Any, group: Any) -> tuple[Any, Any]:
        if group is None or callable(group):
            return super().agree_flags(finite, loss_finite, group)
        if isinstance(loss_finite, torch.Tensor) and loss_finite.device != finite.device:
            loss_finite = loss_finite.to(finite.device, non_blocking=True)
        # one blocking all-reduce for both flags, not one each
        found_inf = torch.logical_not(torch.stack([finite, loss_finite])).to(torch.float32)
        self._all_reduce_max(found_inf, group)
        return found_inf[0] == 0, found_inf[1] == 0

    @staticmethod
    def _all_reduce_max(found_inf: Any, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "axis_name names a torch.distributed process group, but torch.distributed is not "
                "initialised (call torch.distributed.init_process_group first)"
            )
        process_group = None if group in (True, "world", dist.group.WORLD) else group
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group)

    def count_nonfinite(self, leaves: Sequence[Any]) -> list[tuple[int, int, int]]:
        out = []
        for index, leaf in enumerate(leaves):
            if leaf.is_meta:
                raise meta_error(index)
            values = leaf._values() if leaf.is_sparse else leaf
            out.append(
                (
                    int(torch.isnan(values).sum()),
                    int(torch.isposinf(values).sum()),
                    int(torch.isneginf(values).sum()),
                )
            )
        return out


#: integer dtypes of each element size, to compare tensors bit for bit
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _VersionGuard(WriteGuard):
    """Writes into tensors, seen by their version counters (which views of a tensor share)."""

    def __init__(self, arrays: Sequence[Any]) -> None:
        super().__init__(exact=True)
        self.arrays = list(arrays)
        self.versions = [t._version if isinstance(t, torch.Tensor) else None for t in self.arrays]

    def written(self) -> list[int]:
        return [
            i
            for i, (t, version) in enumerate(zip(self.arrays, self.versions, strict=True))
            if version is not None and t._version != version
        ]


BACKEND = TorchBackend()
adapter_ready(BACKEND)
