"""CuPy backend: one fused multi-tensor CUDA kernel per step, state on the GPU, NCCL agreement.

The check + unscale of *every* gradient array, of any float dtype, is one launch of the kernel
in ``cupy_kernels.cu`` (loaded with ``cupy.RawModule``): a table of chunks (address, first
element, length, dtype) lives on the GPU, cached while the arrays stay the same, and each CUDA
block processes one chunk, reading and writing every element once, with 16-byte accesses where
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
from ampscale._ops import ArrayOps, PlainNamespace
from ampscale.backends._base import Backend
from ampscale.backends._cupy_plan import CHUNK_DTYPE, KINDS, chunk_table, kernel_source

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ampscale._config import ScalerConfig
    from ampscale._core import ScalerState

__all__ = ["BACKEND", "BLOCK_THREADS", "CupyBackend"]

#: threads per block of the kernel
BLOCK_THREADS = 512

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # device id -> compiled RawModule
_warned_strided = False
_ones: dict[int, Any] = {}  # device id -> a 0-d float32 one (the "inverse scale" of a check-only pass)


def _kind_codes() -> dict[Any, int]:
    codes: dict[Any, int] = {np.dtype(name): code for name, code in KINDS.items() if name != "bfloat16"}
    try:
        import ml_dtypes

        codes[np.dtype(ml_dtypes.bfloat16)] = KINDS["bfloat16"]
    except ImportError:  # pragma: no cover - CuPy's bfloat16 comes from ml_dtypes
        pass
    return codes


#: dtype -> the kernel's dtype code, for the dtypes the fused kernel handles
_KIND_OF = _kind_codes()


def _one(device_id: int) -> Any:
    one = _ones.get(device_id)
    if one is None:
        with cupy.cuda.Device(device_id):
            one = _ones[device_id] = cupy.ones((), dtype=cupy.float32)
    return one


def _full(value: Any, dtype: Any, device: Any) -> Any:
    if device is None:
        return cupy.full((), value, dtype=dtype)
    with device:
        return cupy.full((), value, dtype=dtype)


#: the transition's operations as plain CuPy calls
_TRANSITION_XP = PlainNamespace(cupy, cupy.bool_, lambda x, dtype: x.astype(dtype), _full)


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

    def ops(self, config: ScalerConfig, state: ScalerState) -> ArrayOps:
        # One ArrayOps per (settings, GPU), with its constants made once: no host-to-device
        # copy (which would wait for the GPU) in the per-step transition.
        key = f"cupy:{state.scale.data.device_id}"
        ops = config._cache.get(key)
        if ops is None:
            ops = config._cache[key] = ArrayOps(config, _TRANSITION_XP, state.scale.device, True, cache_constants=True)
        return ops  # type: ignore[no-any-return]

    # -- the fused hot path -----------------------------------------------------------------
    def _table(self, rows: list[tuple[int, int, int]], device_id: int) -> Any:
        """The chunk table of ``(address, size, kind)`` rows on the device, cached by the rows."""
        key = (device_id, *rows)
        table = self._tables.get(key)
        if table is None:
            addresses, sizes, kinds = zip(*rows, strict=True)
            host_table = chunk_table(addresses, sizes, kinds)
            with cupy.cuda.Device(device_id):
                table = cupy.asarray(host_table.view(np.uint8))
            self._tables[key] = table
            if len(self._tables) > 32:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return table

    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        leaves = list(leaves)
        # One cheap pass over the leaves (CuPy's own read-only fields: no temporary objects),
        # grouping the kernel's rows by device.
        rows: dict[int, list[tuple[int, int, int]]] = {}
        strided = []
        kind_of = _KIND_OF
        for leaf in leaves:
            size = leaf.size
            if not size:
                continue
            kind = kind_of.get(leaf.dtype)
            if kind is not None and (leaf._c_contiguous or leaf._f_contiguous):
                memory = leaf.data
                group = rows.get(memory.device_id)
                if group is None:
                    group = rows[memory.device_id] = []
                group.append((memory.ptr, size, kind))
            else:
                strided.append(leaf)
        flags = []
        multiply = inv_scale is not None
        for device_id, group in rows.items():
            with cupy.cuda.Device(device_id):
                found_inf = cupy.zeros((), dtype=cupy.float32)
                inv = inv_scale if multiply else _one(device_id)
                if inv.data.device_id != device_id:
                    inv = cupy.asarray(inv)
                table = self._table(group, device_id)
                _kernel(device_id)(
                    (table.size // CHUNK_DTYPE.itemsize,), (BLOCK_THREADS,), (table, inv, found_inf, np.int32(multiply))
                )
                flags.append(found_inf)
        for leaf in strided:
            flags.append(self._strided(leaf, inv_scale))
        if not flags:
            like = leaves[0] if leaves else None
            return leaves, self.as_bool(True, like)
        home = flags[0].data.device_id
        total = flags[0]
        for flag in flags[1:]:
            total = total + (flag if flag.data.device_id == home else cupy.asarray(flag))
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
