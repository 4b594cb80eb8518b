"""CuPy backend: one CUDA launch per step (check, unscale and the state update), no host sync.

Adapters' layer.

The kernels (``ampscale/_native/cuda/kernels.cu``, with the state transition emitted as C for the
scaler's configuration by :mod:`ampscale._codegen`) are compiled by ampscale's own NVRTC call
(:func:`ampscale._native.cuda.nvrtc.compiled`, cached on disk, the binary the torch backend
loads too) and the binary is loaded into CuPy as it is (``cupy.cuda.function.Module().load``):
CuPy's own compile (``RawModule(code=...)``) appends ``-ftz=true`` after the caller's options,
which would flush subnormal scales, inverse scales and gradients to zero. A table of chunks (address, first element,
length, dtype) of every gradient array lives on the GPU, cached while the arrays stay the same;
each block processes one chunk, reading and writing every element once, with 16-byte accesses
where aligned. The blocks past the table check the loss. The block that finishes last runs the
transition on one thread and writes the next state: check, unscale and update are one launch.

The state is one 80-byte device buffer (:mod:`ampscale._native.cuda._packed`), the fields are
views of it, and each update writes a new buffer. Where the flag must be known first (a
caller's flag, NCCL agreement, underflow counting), the check runs alone and a one-thread
update kernel follows: one more launch, still no sync.

Contiguous arrays (C or Fortran order) go through the kernel. A strided view goes through it
too, by way of a contiguous copy of its bits (copied as unsigned integers, so nothing is
rounded or flushed), unscaled with the contiguous arrays and copied back: exact, and two more
launches per view, with a one-time warning.

What is exact on CuPy, and what is not: CuPy compiles every kernel of its own (its ufuncs and
elementwise kernels: ``*``, ``where``, ``astype``, ...) with ``-ftz=true``, so its float32
arithmetic flushes subnormal inputs and results to zero. ampscale's kernel never goes through
CuPy's compiler, so the check and unscale of every gradient (strided views included) and the
state transition are exact, as on the host. These use CuPy's own operations and so flush
float32 (and bfloat16, computed in float32) subnormals: ``scale()`` (``loss * scale``: a scaled
loss below 2**-126 in magnitude becomes 0, where torch keeps it), ``masked_add_`` (the
optimizer's ``t + alpha * u``), and, only where ampscale's kernels cannot be built or loaded
(no NVRTC or driver; a warning says so), the eager transition (a scale below 2**-126, or above
2**126 whose inverse is subnormal, is flushed) and the unscale of every gradient. float16 and
float64 values are not affected (every float16 value is a normal float32; ``-ftz`` concerns
float32 only). Underflow counting (``unscale(..., underflow=True)``) is exact all the same: a
flushed subnormal is still below the smallest normal value.

Streams: a record or chunk table used by a launch on a stream other than the one it was
allocated on is held until that stream has passed the launch (a CUDA event), so CuPy's pool,
which reuses a freed block on its own stream at once, cannot hand it out under a running
kernel. CUDA graphs: the functional step writes each state to a new record, so a captured step
would replay the captured scale forever; a step, update or state made under stream capture
raises ``RuntimeError`` instead.

Agreement across GPUs: pass a ``cupy.cuda.nccl.NcclCommunicator`` as ``axis_name``; the flag
is all-reduced (MAX) on the current stream before the scale changes.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, ClassVar

import cupy
import numpy as np

from ampscale._config import make_config
from ampscale._core import ScalerState
from ampscale._errors import PerformanceWarning
from ampscale._native.cuda import _plan, nvrtc
from ampscale._native.cuda._packed import (
    FLAG_BOOL,
    FLAG_FALSE,
    FLAG_TRUE,
    CudaStep,
    PackedState,
    decode,
    encode,
    offset_of,
)
from ampscale._ops import ArrayOps, PlainNamespace
from ampscale.backends._base import Backend, adapter_ready

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ampscale._config import ScalerConfig

__all__ = ["BACKEND", "BLOCK_THREADS", "CupyBackend"]

#: threads per block of the kernel
BLOCK_THREADS = _plan.BLOCK_THREADS

_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}  # (source, device id) -> (step, update) kernels, or None
_warned_strided = False
_RECORD_FLOATS = 20
_INV_OFFSET = offset_of("inv_scale", "float32")[0]
_CUPY_DTYPES = {"float32": cupy.float32, "float64": cupy.float64, "int32": cupy.int32, "uint8": cupy.uint8}
_DEFAULT_CONFIG = make_config()


def _kind_codes() -> dict[Any, int]:
    codes: dict[Any, int] = {np.dtype(name): code for name, code in _plan.KINDS.items() if name != "bfloat16"}
    try:
        import ml_dtypes

        codes[np.dtype(ml_dtypes.bfloat16)] = _plan.KINDS["bfloat16"]
    except ImportError:  # pragma: no cover - CuPy's bfloat16 comes from ml_dtypes
        pass
    return codes


#: dtype -> the kernel's dtype code, for the dtypes the fused kernel handles
_KIND_OF = _kind_codes()


def _full(value: Any, dtype: Any, device: Any) -> Any:
    if device is None:
        return cupy.full((), value, dtype=dtype)
    with device:
        return cupy.full((), value, dtype=dtype)


#: the transition's operations as plain CuPy calls (the eager path, where NVRTC refused the module);
#: CuPy compiles them with -ftz=true, so this path flushes a subnormal scale or inverse scale
_TRANSITION_XP = PlainNamespace(cupy, cupy.bool_, lambda x, dtype: x.astype(dtype), _full)
#: what the eager path gives, for the warning that says it runs
_EAGER_RESULTS = (
    "CuPy compiles its own kernels with -ftz=true, so this path flushes float32 and bfloat16 "
    "subnormals to zero where ampscale's kernel keeps them: a scale below 2**-126, an inverse "
    "scale of a scale above 2**126, and subnormal gradient values"
)
#: unsigned integers of each item size: strided views are copied through them, bit for bit
_BITS = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}


class _Kernels:
    """``ampscale_step`` and ``ampscale_update`` of one configuration on one device."""

    __slots__ = ("kind", "module", "step", "update")

    def __init__(self, module: Any, kind: str) -> None:
        self.module = module  # the functions keep it loaded too
        self.kind = kind
        self.step = module.get_function("ampscale_step")
        self.update = module.get_function("ampscale_update")


def _load_module(source: str, device_id: int) -> _Kernels:
    """The module compiled by ampscale's NVRTC call (IEEE options, no flush-to-zero; cached on
    disk) for the device's architecture, loaded into CuPy's context as a binary: CuPy compiles
    nothing (its compiler would append ``-ftz=true``)."""
    with cupy.cuda.Device(device_id) as device:
        arch = int(device.compute_capability)
        image, kind = nvrtc.compiled(source, arch, _plan.COMPILE_OPTIONS, "ampscale.cu")
        if kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # the driver reads PTX as a C string
        module = cupy.cuda.function.Module()
        module.load(image)
        return _Kernels(module, kind)


def _kernels(config: ScalerConfig, device_id: int) -> _Kernels | None:
    """The kernels for ``config`` on a device, made once per distinct source; ``None``, with one
    warning, where NVRTC cannot be loaded or refuses them, or the driver refuses the binary."""
    key = f"cupy-kernels:{device_id}"
    cached = config._cache.get(key, False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    source = _plan.module_source(config)
    with _lock:
        if (source, device_id) not in _modules:
            try:
                _modules[source, device_id] = _load_module(source, device_id)
            except Exception as exc:  # OSError (no NVRTC), NvrtcError, CuPy's CUDADriverError
                from ampscale._native.cuda.driver import warn_fallback

                warn_fallback("cupy", f"the kernels could not be built or loaded: {exc}", results=_EAGER_RESULTS)
                _modules[source, device_id] = None
        kernels = _modules[source, device_id]
    config._cache[key] = kernels
    return kernels  # type: ignore[no-any-return]


_CAPTURE_ERROR = (
    "ampscale: {what} cannot run under CUDA graph capture on CuPy: each step of the functional "
    "scaler writes its state to a new device record, so a captured step would replay the "
    "captured scale on every replay. Run the scaler's unscale/update/step outside the capture"
)


def _refuse_capture(what: str) -> None:
    """``RuntimeError`` when the current stream is capturing a CUDA graph (before any work)."""
    if cupy.cuda.get_current_stream().is_capturing():
        raise RuntimeError(_CAPTURE_ERROR.format(what=what))


#: (event, buffers): buffers used on a stream other than their own, held until the event passes
_held: deque[tuple[Any, tuple[Any, ...]]] = deque()


def _hold_for_stream(buffers: tuple[Any, ...]) -> None:
    """Keep ``buffers`` alive until the current stream has run what is queued on it now.

    CuPy's pool reuses a freed block on the stream it was allocated on without waiting for
    other streams; a buffer read by a kernel on another stream must outlive that kernel.
    """
    while _held and _held[0][0].done:
        _held.popleft()
    event = cupy.cuda.Event(disable_timing=True)
    event.record(cupy.cuda.get_current_stream())
    _held.append((event, buffers))


class _CupyPacked(PackedState):
    """A packed state in a CuPy array of 20 float32 elements."""

    __slots__ = ()

    def _make_view(self, name: str) -> Any:
        offset, dtype = offset_of(name, self.scale_dtype)
        typed = self.buffer if dtype == "float32" else self.buffer.view(_CUPY_DTYPES[dtype])
        view = typed[offset // typed.itemsize]
        return view.view(cupy.bool_) if name in ("finite", "loss_finite") else view


def _warn_strided() -> None:
    global _warned_strided
    if not _warned_strided:
        _warned_strided = True
        warnings.warn(
            "ampscale: strided (non-contiguous) CuPy gradients are copied to contiguous memory for "
            "ampscale's kernel and back (exact, two more launches each, and no one-launch step); make "
            "them contiguous to keep a single launch",
            PerformanceWarning,
            stacklevel=6,
        )


def _i64(value: int) -> Any:
    return np.int64(value)  # a long long kernel parameter


def _u64(value: int) -> Any:
    return np.uint64(value)  # a pointer kernel parameter


class CupyBackend(Backend, CudaStep):
    """The CuPy adapter."""

    name: ClassVar[str] = "cupy"
    in_place: ClassVar[bool] = True
    lazy_state: ClassVar[bool] = True
    packed_state: ClassVar[bool] = True

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

    def copy_leaf(self, leaf: Any) -> Any:
        return leaf.copy()  # on the array's device and the current stream

    def same_bits(self, a: Any, b: Any) -> bool:
        from ampscale.backends.numpy import _same_bits

        return _same_bits(a, b)  # one host read (a sync): only Scaler.step's check of a new update_fn

    def device_of(self, like: Any) -> Any:
        return like.device if isinstance(like, cupy.ndarray) else None

    # -- state ------------------------------------------------------------------------------
    def make_state(self, values: ScalerState, config: ScalerConfig, like: Any = None, previous: Any = None) -> Any:
        device_id = like.data.device_id if isinstance(like, cupy.ndarray) else cupy.cuda.Device().id
        if _kernels(config, device_id) is None:
            return super().make_state(values, config, like, previous)
        _refuse_capture("creating the state")
        with cupy.cuda.Device(device_id):
            buffer = cupy.asarray(encode(values, config.scale_dtype).view(np.float32))
            stream = int(cupy.cuda.get_current_stream().ptr)
        return _CupyPacked(buffer, buffer.data.ptr, config.scale_dtype, stream)

    def read_state(self, state: Any) -> ScalerState:
        if isinstance(state, PackedState):
            return decode(cupy.asnumpy(state.buffer), state.scale_dtype)  # one copy (a sync)
        return super().read_state(state)

    def public_state(self, state: Any, config: ScalerConfig) -> ScalerState:
        if isinstance(state, PackedState):
            return state.fields()
        return state  # type: ignore[no-any-return]

    def ops(self, config: ScalerConfig, state: Any) -> ArrayOps:
        if isinstance(state, PackedState):
            return None  # type: ignore[return-value] # run_transition launches the emitted C
        # One ArrayOps per (settings, GPU), with its constants made once: no host-to-device
        # copy (which would wait for the GPU) in the per-step transition.
        key = f"cupy:{state.scale.data.device_id}"
        ops = config._cache.get(key)
        if ops is None:
            ops = config._cache[key] = ArrayOps(config, _TRANSITION_XP, state.scale.device, True, cache_constants=True)
        return ops  # type: ignore[no-any-return]

    def run_transition(
        self, config: ScalerConfig, state: Any, finite: Any, loss_finite: Any, ops: Any
    ) -> tuple[Any, ScalerState | None, Any]:
        if not isinstance(state, PackedState):
            return super().run_transition(config, state, finite, loss_finite, ops or self.ops(config, state))
        kernels = _kernels(config, state.buffer.data.device_id)
        _refuse_capture("update()")
        with state.buffer.device:
            nxt = self.update_packed(kernels, state, finite, loss_finite)
        return nxt, None, nxt.view("floor_event")

    # -- CudaStep: the framework's pieces -----------------------------------------------------
    def new_record(self, like: PackedState, zero: bool = False) -> PackedState:
        with like.buffer.device:
            buffer = (cupy.zeros if zero else cupy.empty)(_RECORD_FLOATS, dtype=cupy.float32)
            stream = int(cupy.cuda.get_current_stream().ptr)
        return _CupyPacked(buffer, buffer.data.ptr, like.scale_dtype, stream)

    def current_stream(self, state: PackedState) -> int:
        return int(cupy.cuda.get_current_stream().ptr)

    def keep_for_stream(self, buffers: tuple[Any, ...], stream: int) -> None:
        _hold_for_stream(buffers)

    def flag_argument(self, flag: Any, state: PackedState) -> tuple[int, int, Any]:
        if isinstance(flag, (bool, np.bool_)):
            return 0, FLAG_TRUE if flag else FLAG_FALSE, None
        flag = cupy.asarray(flag)
        if flag.data.device_id != state.buffer.data.device_id:
            with state.buffer.device:
                flag = cupy.asarray(flag)
        if flag.dtype != cupy.bool_:
            flag = flag.astype(cupy.bool_)
        return flag.data.ptr, FLAG_BOOL, flag

    def launch_update(
        self,
        module: Any,
        state: PackedState,
        stream: int,
        finite: tuple[int, int],
        loss_finite: tuple[int, int],
        scratch: PackedState | None = None,
    ) -> PackedState:
        nxt = self.new_record(state)
        args = (state.buffer, nxt.buffer, _u64(finite[0]), _i64(finite[1]), _u64(loss_finite[0]), _i64(loss_finite[1]))
        module.update((1,), (1,), (*args, _u64(0 if scratch is None else scratch.ptr)))
        self.used_on(stream, state, scratch)  # after the launch: held until the stream passes it
        return nxt

    # -- the fused hot path -----------------------------------------------------------------
    def _table(self, rows: tuple[tuple[int, int, int], ...], device_id: int) -> tuple[Any, int, bool]:
        """The chunk table of ``(address, size, kind)`` rows on the device, cached by the rows,
        its chunk count, and whether it was made on another stream than the current one (the
        caller then holds it past the launch: see :func:`_hold_for_stream`)."""
        key = (device_id, rows)
        entry = self._tables.get(key)
        stream = int(cupy.cuda.get_current_stream().ptr)
        if entry is None:
            addresses, sizes, kinds = zip(*rows, strict=True) if rows else ((), (), ())
            host_table = _plan.chunk_table(addresses, sizes, kinds)
            with cupy.cuda.Device(device_id):
                entry = (cupy.asarray(host_table.view(np.uint8)), stream)
            self._tables[key] = entry
            if len(self._tables) > 32:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        table = entry[0]
        return table, table.size // _plan.CHUNK_DTYPE.itemsize, entry[1] != stream

    @staticmethod
    def _rows(leaves: Sequence[Any]) -> tuple[dict[int, list[tuple[int, int, int]]], list[Any]]:
        """The kernel's rows grouped by device, and the leaves it cannot take (strided, other dtypes)."""
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
        return rows, strided

    def fused_unscale_packed(
        self, config: ScalerConfig, state: PackedState, leaves: list[Any], loss: Any, scale_floor: float | None
    ) -> tuple[list[Any], Any, Any] | None:
        # scale_floor is not needed: ampscale's kernel checks the values it writes
        device_id = state.buffer.data.device_id
        rows, strided = self._rows(leaves)
        if strided or any(d != device_id for d in rows):
            return None
        loss_ptr, meta, loss_chunks = 0, 0, 0
        if loss is not None:
            kind = _KIND_OF.get(loss.dtype)
            if kind is None or loss.data.device_id != device_id or not (loss._c_contiguous or loss._f_contiguous):
                return None
            if loss.size:
                loss_ptr, meta = loss.data.ptr, _plan.loss_meta(loss.size, kind)
                loss_chunks = -(-loss.size // _plan.CHUNK)
        kernels = _kernels(config, device_id)
        assert kernels is not None  # a packed state exists only where they compiled
        _refuse_capture("unscale()")
        with state.buffer.device:
            stream = self.current_stream(state)
            group = rows.get(device_id, [])
            table, grad_chunks, foreign = self._table(tuple(group), device_id) if group else (None, 0, False)
            scratch = self.scratch_for(state, stream)
            if grad_chunks + loss_chunks == 0:  # nothing to check: every value is finite
                nxt = self.launch_update(kernels, state, stream, (0, FLAG_TRUE), (0, FLAG_TRUE))
            else:
                nxt = self.new_record(state)
                options = (_plan.MULTIPLY if config.scales else 0) | _plan.TAIL
                kernels.step(
                    (grad_chunks + loss_chunks,),
                    (BLOCK_THREADS,),
                    (
                        _u64(0 if table is None else table.data.ptr),
                        _i64(grad_chunks),
                        _u64(loss_ptr),
                        _i64(meta),
                        _u64(state.ptr + _INV_OFFSET),
                        scratch.buffer,
                        state.buffer,
                        nxt.buffer,
                        _i64(options),
                    ),
                )
                self.used_on(stream, state, scratch)  # after the launch: held until the stream passes it
                if foreign:
                    _hold_for_stream((table,))
        finite = nxt.view("finite")
        loss_finite = None if loss is None else nxt.view("loss_finite")
        state.pending = (finite, loss_finite, nxt)
        return leaves, finite, loss_finite

    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        leaves = list(leaves)
        rows, strided = self._rows(leaves)
        flags = []
        multiply = inv_scale is not None
        # Strided views go through ampscale's kernel too (CuPy's own kernels flush subnormals):
        # a contiguous copy of each view's bits joins the launch, and is copied back after it.
        copies: list[tuple[Any, Any, Any]] = []
        elementwise = []
        for leaf in strided:
            kind = _KIND_OF.get(leaf.dtype)
            device_id = leaf.data.device_id
            if kind is None or _kernels(_DEFAULT_CONFIG, device_id) is None:
                elementwise.append(leaf)
                continue
            _warn_strided()
            bits = _BITS[leaf.dtype.itemsize]
            with cupy.cuda.Device(device_id):
                copy = cupy.empty(leaf.shape, dtype=bits)
                copy[...] = leaf.view(bits)  # an integer copy: every bit as it is
            rows.setdefault(device_id, []).append((copy.data.ptr, copy.size, kind))
            copies.append((leaf, copy, bits))
        for device_id, group in rows.items():
            kernels = _kernels(_DEFAULT_CONFIG, device_id)  # the check kernel is the same in every module
            if kernels is None:
                elementwise += [leaf for leaf in leaves if leaf.size and leaf.data.device_id == device_id]
                continue
            with cupy.cuda.Device(device_id):
                scratch = cupy.zeros(_RECORD_FLOATS, dtype=cupy.float32)
                inv = inv_scale if multiply else scratch[0]  # any float when only checking
                if inv.data.device_id != device_id:
                    inv = cupy.asarray(inv)
                table, chunks, foreign = self._table(tuple(group), device_id)
                kernels.step(
                    (chunks,),
                    (BLOCK_THREADS,),
                    (
                        table,
                        _i64(chunks),
                        _u64(0),
                        _i64(0),
                        inv,
                        scratch,
                        _u64(0),
                        _u64(0),
                        _i64(_plan.MULTIPLY if multiply else 0),
                    ),
                )
                if foreign:
                    _hold_for_stream((table,))
                flags.append(scratch[offset_of("found_inf", "float32")[0] // 4])
        if multiply:
            for leaf, copy, bits in copies:  # queued after the kernel, on the same stream
                with cupy.cuda.Device(leaf.data.device_id):
                    leaf.view(bits)[...] = copy
        for leaf in elementwise:
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
        """The unscale in CuPy's own operations, in place, where ampscale's kernels cannot run (not
        built or loaded): exact for float16 and float64, but CuPy compiles with ``-ftz=true``, so
        float32 and bfloat16 subnormals (inputs and products) are flushed to zero."""
        with cupy.cuda.Device(leaf.device.id):
            wide = leaf.astype(cupy.float32) if leaf.dtype.itemsize < 4 else leaf
            if inv_scale is not None:
                factor = inv_scale.astype(cupy.float64) if leaf.dtype == cupy.float64 else inv_scale
                out = (wide * factor).astype(leaf.dtype)
                leaf[...] = out
                wide = out.astype(cupy.float32) if out.dtype.itemsize < 4 else out
            # the stored values are checked: finite iff every unscaled value is
            return cupy.logical_not(cupy.isfinite(wide).all()).astype(cupy.float32)

    def all_finite(self, leaves: Sequence[Any]) -> Any:
        return self.check_and_unscale(leaves, None)[1]

    # -- agreement --------------------------------------------------------------------------
    def agree(self, finite: Any, group: Any) -> Any:
        if group is None or callable(group):
            return super().agree(finite, group) if group is None else self.as_bool(group(finite), finite)
        found_inf = cupy.logical_not(finite).astype(cupy.float32).reshape(1)
        self._all_reduce_max(found_inf, group)
        return found_inf.reshape(()) == 0

    def agree_flags(self, finite: Any, loss_finite: Any, group: Any) -> tuple[Any, Any]:
        if group is None or callable(group):
            return super().agree_flags(finite, loss_finite, group)
        with cupy.cuda.Device(finite.data.device_id):  # the loss may live on another GPU
            flags = cupy.stack([finite, cupy.asarray(loss_finite)])
            found_inf = cupy.logical_not(flags).astype(cupy.float32)
            # one NCCL all-reduce of a 2-element buffer for both flags, not one each
            self._all_reduce_max(found_inf, group)
        return found_inf[0] == 0, found_inf[1] == 0

    @staticmethod
    def _all_reduce_max(found_inf: Any, comm: Any) -> None:
        """All-reduce (MAX, in place) a contiguous float32 buffer over an NCCL communicator, on
        the current stream (queued: no sync)."""
        from cupy.cuda import nccl

        stream = cupy.cuda.get_current_stream().ptr
        comm.allReduce(found_inf.data.ptr, found_inf.data.ptr, found_inf.size, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, stream)


BACKEND = CupyBackend()
adapter_ready(BACKEND)
