"""Amaxes and overflow flags reduced across devices in one collective, with nan kept.

Every rank (or device) of a tensor- or data-parallel group must compute the same FP8 scales,
so their amaxes are reduced by max over the group before the update; which group is the
caller's choice and is never guessed (NVIDIA/Megatron-LM#442: a 40B model diverged when the
amaxes were reduced over the data-parallel group instead of the amax group).

One collective per step carries everything that must agree: one float32 buffer ::

    [ amax_1 .. amax_N (nan as 0) | isnan(amax_1) .. isnan(amax_N) | flag_1 .. flag_k ]

reduced by MAX. A flag is 0 or 1 (1: something went wrong, e.g. the loss scaler's found-inf),
so the max of flags is their OR. NaN is carried by its own flags because the collectives'
max does not keep it: NCCL's MAX ignores nan (Azure/MS-AMP converts nan to inf before its
all-reduce), and CPU max reductions differ by rank order (ml-explore/mlx#4072,
pytorch/pytorch#197719). An inf amax survives any max as it is.

The collective is the framework's own, queued without a host read:

* torch: ``torch.distributed.all_reduce(buffer, ReduceOp.MAX, group)`` (gloo, NCCL);
* JAX: one ``lax.pmax`` over the named axes (``shard_map``, ``pmap``), plus every mesh axis
  the buffer still varies over, so each device ends with the same values;
* CuPy: an NCCL all-reduce (``ncclMax``) on the current stream over a ``NcclCommunicator``;
* any framework: a callable ``group(buffer) -> buffer`` (e.g. an MPI all-reduce).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from ampscale.fp8._ops import framework_of

__all__ = ["reduce_amax"]


class _Unset:
    """The default of ``group``: the caller said nothing (see :func:`resolve_group`)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def _live_torch_world() -> int:
    """The world size of an initialised ``torch.distributed`` (1 when none is live)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


def _varying_axes(value: Any) -> set[Any]:
    if "jax" not in sys.modules or framework_of(value) != "jax":
        return set()
    from ampscale.backends.jax import varying_axes

    return varying_axes(value)


def resolve_group(group: Any, amax: Any, what: str = "group") -> Any:
    """``group`` as given, or ``None`` (local) where the caller gave none and nothing is
    distributed; a clear error where something is distributed and no group was named.

    Raises:
        ValueError: ``group`` left out while ``torch.distributed`` runs with several ranks, or
            while ``amax`` varies over mapped JAX axes (``shard_map``): which group the scales
            agree over must be said, ``None`` included (each rank keeps its own scales).
    """
    if group is not UNSET:
        return group
    world = _live_torch_world()
    if world > 1 and framework_of(amax) == "torch":
        raise ValueError(
            f"{what} must be given while torch.distributed runs with {world} ranks: the process group "
            "over which the amaxes are reduced (the tensor- x data-parallel 'amax group' for "
            "Megatron-style models, not necessarily the data-parallel group), 'world', or None to "
            "keep each rank's own scales"
        )
    axes = _varying_axes(amax)
    if axes:
        raise ValueError(
            f"{what} must be given: the amaxes vary over the mapped axes {sorted(axes, key=str)}; pass "
            "the axis name(s) to reduce over (one pmax), or None to keep each device's own scales"
        )
    return None


def _namespace(framework: str, like: Any) -> Any:
    if framework == "torch":
        import torch

        return torch
    if framework == "jax":
        import jax.numpy as jnp

        return jnp
    if framework == "array_api":
        return like.__array_namespace__()
    if framework == "cupy":
        return sys.modules["cupy"]
    import numpy as np

    return np


def _as_float(xp: Any, framework: str, value: Any) -> Any:
    if framework == "torch":
        return value.to(xp.float32)
    if framework in ("jax", "array_api"):
        return xp.astype(value, xp.float32)
    return value.astype(xp.float32)


def pack(amax: Any, flags: Sequence[Any]) -> Any:
    """The float32 buffer ``[amax with nan as 0, isnan(amax), flags]`` (see the module docstring).

    ``flags`` are 0-d bools of ``amax``'s framework (true: something went wrong).
    """
    framework = framework_of(amax)
    xp = _namespace(framework, amax)
    nan = xp.isnan(amax)
    zero = xp.zeros_like(amax)
    values = xp.where(nan, zero, amax)
    parts = [values, _as_float(xp, framework, nan)]
    parts += [xp.reshape(_as_float(xp, framework, flag), (1,)) for flag in flags]
    if framework == "torch":
        return xp.cat(parts)
    if framework == "array_api":
        return xp.concat(parts)
    return xp.concatenate(parts)


def unpack(buffer: Any, size: int, count: int) -> tuple[Any, list[Any]]:
    """``(amax, flags)`` from a reduced :func:`pack` buffer of ``size`` amaxes and ``count`` flags."""
    framework = framework_of(buffer)
    xp = _namespace(framework, buffer)
    values, nan = buffer[:size], buffer[size : 2 * size]
    if framework in ("torch", "jax"):
        nan_value = xp.full_like(values, math.nan)
    else:
        nan_value = xp.full(values.shape, math.nan, dtype=values.dtype)
    amax = xp.where(nan > 0, nan_value, values)
    flags = [buffer[2 * size + i] > 0 for i in range(count)]
    return amax, flags


def all_reduce_max(buffer: Any, group: Any) -> Any:
    """``buffer`` (1-D float32) reduced by MAX over ``group``: one collective, no host read.

    Raises:
        RuntimeError: a torch process group while ``torch.distributed`` is not initialised.
        TypeError: a group this framework cannot reduce over.
    """
    if callable(group) and not _is_nccl_communicator(group):
        return group(buffer)
    framework = framework_of(buffer)
    if framework == "torch":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "group names a torch.distributed process group, but torch.distributed is not "
                "initialised (call torch.distributed.init_process_group first)"
            )
        process_group = None if group in (True, "world", dist.group.WORLD) else group
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=process_group)
        return buffer
    if framework == "jax":
        import jax

        from ampscale.backends.jax import axis_names

        axes = set(axis_names(group)) | _varying_axes(buffer)
        ordered = tuple(sorted(axes, key=str))
        return jax.lax.pmax(buffer, ordered if len(ordered) > 1 else ordered[0])
    if framework == "cupy" and _is_nccl_communicator(group):
        cupy = sys.modules["cupy"]
        from cupy.cuda import nccl

        stream = cupy.cuda.get_current_stream().ptr
        group.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, stream)
        return buffer
    raise TypeError(
        f"group must be None, a callable buffer -> buffer, or (torch) a process group or 'world', (JAX) axis "
        f"name(s), (CuPy) an NCCL communicator; got {group!r} for {framework} arrays"
    )


def check_group(group: Any, framework: str) -> None:
    """Refuse, before anything changes, a group that ``framework``'s arrays cannot be reduced over.

    Raises:
        TypeError: the group's kind does not fit the framework (the message lists what does).
        RuntimeError: a torch process group while ``torch.distributed`` is not initialised.
    """
    if group is None or (callable(group) and not _is_nccl_communicator(group)):
        return
    fits = False
    if framework == "torch":
        dist = sys.modules.get("torch.distributed")
        fits = group in (True, "world") or (dist is not None and isinstance(group, dist.ProcessGroup))
        if fits and (dist is None or not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError(
                "group names a torch.distributed process group, but torch.distributed is not "
                "initialised (call torch.distributed.init_process_group first)"
            )
    elif framework == "jax":
        names = group if isinstance(group, (tuple, list)) else (group,)
        # axis names are hashable and never bools (a flag passed by mistake)
        fits = bool(names) and all(type(n).__hash__ is not None and not isinstance(n, bool) for n in names)
    elif framework == "cupy":
        fits = _is_nccl_communicator(group)
    if not fits:
        raise TypeError(
            f"group must be None, a callable buffer -> buffer, or (torch) a process group or 'world', (JAX) axis "
            f"name(s), (CuPy) an NCCL communicator; got {group!r} for {framework} arrays"
        )


def _is_nccl_communicator(group: Any) -> bool:
    # CuPy's NcclCommunicator, or anything that all-reduces like it (read by its method)
    return callable(getattr(group, "allReduce", None))


def reduce_with_flags(amax: Any, flags: Sequence[Any], group: Any) -> tuple[Any, list[Any]]:
    """``amax`` and the 0-d bool ``flags`` reduced over ``group`` in one collective (max of
    the amaxes, nan kept; OR of the flags). ``group=None``: returned as they are."""
    if group is None:
        return amax, list(flags)
    check_group(group, framework_of(amax))
    size = int(amax.shape[0])
    reduced = all_reduce_max(pack(amax, flags), group)
    return unpack(reduced, size, len(flags))


def reduce_amax(amax: Any, group: Any) -> Any:
    """The max of ``amax`` over ``group``, in one collective, with nan kept.

    Args:
        amax: a ``[N]`` float32 array (NumPy, JAX, torch, CuPy, array API): this rank's amaxes.
        group: required, never guessed: a ``torch.distributed`` process group (or ``"world"``),
            JAX axis name(s) (under ``shard_map`` / ``pmap``), a CuPy NCCL communicator, a
            callable ``buffer -> buffer``, or ``None`` (no reduction: each rank keeps its own).

    Returns:
        ``[N]`` float32: on every rank, the largest amax of the group per slot; nan where any
        rank's amax was nan (an NCCL max alone would drop it).

    Example:
        >>> import numpy as np, ampscale.fp8 as fp8
        >>> fp8.reduce_amax(np.float32([1.0, 2.0]), None)  # None: this rank's own amaxes
        array([1., 2.], dtype=float32)
    """
    shape = tuple(getattr(amax, "shape", ()))
    if len(shape) != 1:
        raise ValueError(f"amax must be a 1-D array (one value per slot); got shape {shape}")
    return reduce_with_flags(amax, (), group)[0]
