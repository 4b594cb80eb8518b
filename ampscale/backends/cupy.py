"""CuPy backend: one fused multi-tensor CUDA kernel per step, state on the GPU, NCCL agreement.

The check + unscale of *every* gradient array, of any float dtype, is one launch of the kernel
in ``cupy_kernels.cu`` (loaded with ``cupy.RawModule``): a table of chunks (address, first
element, length, dtype) lives on the GPU, cached while the arrays stay the same, and each CUDA
block processes one chunk, reading and writing every element once, with float4 accesses where
aligned. The inverse scale and the flag stay on the GPU; ``unscale``, ``update`` and ``step``
never synchronise with the host. The state is 0-d CuPy arrays on the gradients' device and the
shared transition runs there.

Contiguous arrays (C or Fortran order) go through the kernel. Strided views are unscaled in
place by an exact per-array path (several launches each), with a one-time warning.

Agreement across GPUs: pass a ``cupy.cuda.nccl.NcclCommunicator`` as ``axis_name``; the flag
is all-reduced (MAX) on the current stream before the scale changes.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

import cupy
import numpy as np

from ampscale._errors import PerformanceWarning
from ampscale.backends._base import Backend
from ampscale.backends._cupy_plan import KINDS, chunk_table, kernel_source

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["BACKEND", "BLOCK_THREADS", "CupyBackend"]

#: threads per block of the kernel
BLOCK_THREADS = 512

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # device id -> compiled RawModule
_warned_strided = False


def _kernel(device_id: int) -> Any:
    """The compiled kernel for a device (compiled once per device, then cached by CuPy)."""
    with _lock:
        module = _modules.get(device_id)
        if module is None:
            module = _modules[device_id] = cupy.RawModule(code=kernel_source(), options=("--std=c++14",))
    return module.get_function("ampscale_check_and_unscale")


class CupyBackend(Backend):
    """The CuPy adapter."""

    name: ClassVar[str] = "cupy"
    in_place: ClassVar[bool] = True
    lazy_state: ClassVar[bool] = True

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def owns(self, value: Any) -> bool:
        return isinstance(value, cupy.ndarray)

    def owns_type(self, kind: type) -> bool:
        return issubclass(kind, cupy.ndarray)

    def is_floating_dtype(self, dtype: Any) -> bool:
        return bool(np.dtype(dtype).kind == "f") or np.dtype(dtype).name == "bfloat16"

    def namespace(self) -> Any:
        import array_api_compat.cupy as xp

        return xp

    def device_of(self, like: Any) -> Any:
        return like.device if isinstance(like, cupy.ndarray) else None

    # -- the fused hot path -----------------------------------------------------------------
    def _table(self, arrays: Sequence[Any], device_id: int) -> Any:
        key = tuple((a.data.ptr, a.size, a.dtype.name) for a in arrays)
        table = self._tables.get(key)
        if table is None:
            rows = chunk_table(
                [a.data.ptr for a in arrays], [a.size for a in arrays], [KINDS[a.dtype.name] for a in arrays]
            )
            with cupy.cuda.Device(device_id):
                table = cupy.asarray(rows.view(np.uint8))
            self._tables[key] = table
            if len(self._tables) > 32:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return table

    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        leaves = list(leaves)
        by_device: dict[int, list[Any]] = {}
        strided = []
        for leaf in leaves:
            if leaf.size == 0:
                continue
            if (leaf.flags.c_contiguous or leaf.flags.f_contiguous) and leaf.dtype.name in KINDS:
                by_device.setdefault(leaf.device.id, []).append(leaf)
            else:
                strided.append(leaf)
        flags = []
        multiply = inv_scale is not None
        for device_id, arrays in by_device.items():
            with cupy.cuda.Device(device_id):
                found_inf = cupy.zeros((), dtype=cupy.float32)
                inv = inv_scale if multiply else cupy.ones((), dtype=cupy.float32)
                if inv.device.id != device_id:
                    inv = cupy.asarray(inv)
                table = self._table(arrays, device_id)
                num_chunks = table.size // 32
                if num_chunks:
                    _kernel(device_id)((num_chunks,), (BLOCK_THREADS,), (table, inv, found_inf, np.int32(multiply)))
                flags.append(found_inf)
        for leaf in strided:
            flags.append(self._strided(leaf, inv_scale))
        if not flags:
            like = leaves[0] if leaves else None
            return leaves, self.as_bool(True, like)
        home = flags[0].device.id
        total = flags[0]
        for flag in flags[1:]:
            total = total + (flag if flag.device.id == home else cupy.asarray(flag))
        return leaves, total == 0

    def _strided(self, leaf: Any, inv_scale: Any) -> Any:
        """Exact per-array path for strided views (and dtypes the kernel lacks): in place."""
        global _warned_strided
        if not _warned_strided:
            _warned_strided = True
            warnings.warn(
                "ampscale: strided (non-contiguous) CuPy gradients are unscaled by a slower per-array "
                "path; make them contiguous to use the single fused kernel",
                PerformanceWarning,
                stacklevel=5,
            )
        with cupy.cuda.Device(leaf.device.id):
            wide = leaf.astype(cupy.float32) if leaf.dtype.itemsize < 4 else leaf
            bad = cupy.logical_not(cupy.isfinite(wide).all()).astype(cupy.float32)
            if inv_scale is not None:
                factor = inv_scale.astype(cupy.float64) if leaf.dtype == cupy.float64 else inv_scale
                leaf[...] = (wide * factor).astype(leaf.dtype)
        return bad

    def all_finite(self, leaves: Sequence[Any]) -> Any:
        return self.check_and_unscale(leaves, None)[1]

    # -- agreement --------------------------------------------------------------------------
    def agree(self, finite: Any, group: Any) -> Any:
        if group is None or callable(group):
            return super().agree(finite, group) if group is None else self.as_bool(group(finite), finite)
        from cupy.cuda import nccl

        found_inf = cupy.logical_not(finite).astype(cupy.float32).reshape(1)
        stream = cupy.cuda.get_current_stream().ptr
        group.allReduce(found_inf.data.ptr, found_inf.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, stream)
        return found_inf.reshape(()) == 0


BACKEND = CupyBackend()
