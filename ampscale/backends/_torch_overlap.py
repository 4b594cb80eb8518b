"""The torch adapter's memory checks (adapters' layer): every memory location unscaled once.

Before torch's fused kernel changes anything, :func:`_distinct_memory` keeps a buffer given twice
once and refuses gradients that share memory in part, or a tensor whose own elements share memory
(:class:`~ampscale.AliasedGradientsError`), which torch's kernel would find only when it reached
them. (ampscale's native CPU kernel and CUDA kernels find shared memory themselves.)
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from ampscale.backends._base import internal_overlap_error, may_overlap_itself, meta_error, overlap_error

__all__: list[str] = []

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


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
