"""PyTorch backend (adapters' layer): state on the gradients' device, the check + unscale fused,
no host sync.

On the CPU the check + unscale is ampscale's own native kernel, the NumPy backend's, run on the
tensors' memory and split over the cores by element count, torch's kernel's values bit for bit
(:mod:`ampscale.backends._torch_cpu`). Where torch must see the op (a torch function or dispatch
mode, functorch, compilation, tensor subclasses) or the memory is not plain dense memory (sparse,
non-contiguous, meta), and on accelerators, it is ``torch._amp_foreach_non_finite_check_and_unscale_``,
the kernel ``torch.amp.GradScaler`` uses: gradients are grouped by device and dtype, checked in
float32 opmath, multiplied by the inverse scale, all in one launch per group, after the memory
checks of :mod:`ampscale.backends._torch_overlap` (each location once, partial overlap refused).
Where that kernel lacks a dtype (bfloat16 on CUDA), the gradients are widened to float32, run
through the same kernel and rounded back: the same bits; which path a (device, dtype) pair uses
is decided once, by trying the kernel. :func:`native_cpu_kernel` turns the native CPU path off
and on (``AMPSCALE_TORCH_NATIVE=0``).

State: on the CPU it is kept as Python scalars (the transition runs on the host, no tensor
kernels), exposed as 0-d CPU tensors; on an accelerator it is 0-d tensors on that device,
updated by the shared transition as tensor operations, asynchronously.

On CUDA the state is one packed record (:mod:`ampscale._native.cuda._packed`, held in a torch
tensor by :mod:`ampscale.backends._torch_cuda`) and a step is torch's fused kernel writing into
the record's scratch, then one launch of ampscale's kernels (the update, or the check of bfloat16
gradients and the loss with the transition in its last block); while the host's bound of the
scale is below 1 it is one launch of ampscale's kernel for every contiguous gradient (it checks
the values it writes, where torch's kernel would need a second pass). A record or chunk table
used on a stream other than the one it was allocated on gets ``record_stream`` for that stream.
Under CUDA graph capture every step raises before any work: the functional step writes a new
record per step, so a replay would repeat the captured step; the drop-in ``GradScaler``'s update
is one in-place kernel on fixed buffers, but its scale's host bound and its per-optimizer flags
live in Python, where a replay does not reach, so it refuses capture too.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ampscale import _tree
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
)
from ampscale._ops import ArrayOps, HostOps, PlainNamespace, host_ops
from ampscale.backends import _torch_cuda
from ampscale.backends._base import Backend, WriteGuard, adapter_ready, leaf_error, meta_error
from ampscale.backends._torch_cpu import (
    _PLAIN_TYPES,
    _SPLIT_MIN_TENSORS,
    _fused_cpu,
    _host_inverse,
    _native_cpu,
    _native_ready,
    _plain_cpu_dtype,
    native_cpu_kernel,
)
from ampscale.backends._torch_overlap import _distinct_memory

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["BACKEND", "TorchBackend", "native_cpu_kernel"]


# (device, dtype) -> whether torch's fused kernel supports it (learned on first use)
_fused_support: dict[tuple[torch.device, torch.dtype], bool] = {}
_DTYPE = operator.attrgetter("dtype")
_GET_DEVICE = torch.Tensor.get_device
#: the dtypes the fused kernel (or its exact float32 widening) unscales; others are refused up
#: front, since the kernel would raise only when it reached them, after unscaling earlier ones
_UNSCALABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_scratch = threading.local()
_inverses: dict[float, float] = {}


_FOUND_NONE = torch.zeros(())  # found_inf 0 and 1: logical_not() makes a new flag cheaply
_FOUND_ONE = torch.ones(())


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


class TorchBackend(Backend, CudaStep):
    """The PyTorch adapter."""

    name: ClassVar[str] = "torch"
    in_place: ClassVar[bool] = True
    lazy_state: ClassVar[bool] = True  # created on the device of the first tensors, as torch does
    packed_state: ClassVar[bool] = True  # on CUDA, where ampscale's kernels load

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
                    _fused_cpu(grads, found_inf, inv, dtype, plain, self.found_inf_and_unscale)
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
            dtype = _plain_cpu_dtype(leaves)
            if dtype is not None:
                dtypes = {dtype}
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
        if _torch_cuda._cuda_module(config, like.device) is not None:
            return _torch_cuda._packed_from_values(values, config, like.device)
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
            return config._cache.get("host") or host_ops(config)  # (the read inline: every step)
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
            and _torch_cuda._cuda_module(config, state.scale.device) is not None
        ):
            # an unpacked device state (GradScaler.update(new_scale) replaces the scale): pack it
            state = _torch_cuda._packed_from_fields(state, config)
        if not isinstance(state, PackedState):
            if ops is None:
                ops = self.ops(config, state)
            return super().run_transition(config, state, finite, loss_finite, ops)
        module = _torch_cuda._cuda_module(config, state.buffer.device)
        _torch_cuda._refuse_capture("update()")
        nxt = self.update_packed(module, state, finite, loss_finite)
        return nxt, None, nxt.view("floor_event")

    # -- CUDA: the packed state and the one-launch update ------------------------------------
    def new_record(self, like: PackedState, zero: bool = False) -> PackedState:
        make = torch.zeros if zero else torch.empty
        device = like.buffer.device
        buffer = make(_torch_cuda._RECORD_FLOATS, dtype=torch.float32, device=device)
        return _torch_cuda._TorchPacked(buffer, buffer.data_ptr(), like.scale_dtype, _torch_cuda._raw_stream(device))

    def current_stream(self, state: PackedState) -> int:
        return _torch_cuda._raw_stream(state.buffer.device)

    def keep_for_stream(self, buffers: tuple[Any, ...], stream: int) -> None:
        for buffer in buffers:
            _torch_cuda._record_stream(buffer)

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

    def fused_unscale_packed(
        self, config: ScalerConfig, state: PackedState, leaves: list[Any], loss: Any, scale_floor: float | None
    ) -> tuple[list[Any], Any, Any] | None:
        device = state.buffer.device
        module = _torch_cuda._cuda_module(config, device)
        # every memory location once, and refusals before anything changes (as check_and_unscale)
        distinct = _distinct_memory(list(leaves), config.scales)
        # While the scale may be below 1 (a host bound, no device read), ampscale's kernel
        # checks and unscales every contiguous gradient: one launch, where torch's kernel would
        # need a second pass to check what it wrote, and then the update (three launches)
        inv = state.view("inv_scale")
        below_one = config.scales and _may_overflow(inv, scale_floor)
        plan = _torch_cuda._cuda_plan(distinct, loss, device, every_dtype=below_one)
        if module is None or plan is None:
            return None
        torch_groups, own, loss_tensor = plan
        if not config.scales and not all(t.is_contiguous() for group in torch_groups for t in group):
            return None  # guard mode checks every leaf in ampscale's kernel, which needs them contiguous
        _torch_cuda._refuse_capture("unscale()")
        stream = self.current_stream(state)
        if not config.scales:
            own = distinct  # guard mode: check only, in ampscale's kernel (nothing written)
        # everything that can refuse is decided before torch's kernel changes a gradient: the
        # chunk table and the grid of ampscale's kernel (0 blocks: none is launched)
        table, grad_chunks = _torch_cuda._chunk_table(own, device, stream) if own else (None, 0)
        loss_ptr, meta, loss_chunks = _torch_cuda._loss_argument(loss_tensor)
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
                state.ptr + _torch_cuda._INV_OFFSET,
                scratch.ptr,
                state.ptr,
                nxt.ptr,
                options,
            )
            self.used_on(stream, state, scratch)
        else:
            # nothing for ampscale's kernel (no bfloat16 gradient or loss to check, or only empty
            # ones): the transition, reading torch's flag from the scratch (and resetting it)
            found = (scratch.ptr + _torch_cuda._FOUND_INF_OFFSET, FLAG_FOUND_INF)
            nxt = self.launch_update(module, state, stream, found, (0, FLAG_TRUE), scratch)
        finite = nxt.view("finite")
        loss_finite = None if loss is None else nxt.view("loss_finite")
        state.pending = (finite, loss_finite, nxt)
        return leaves, finite, loss_finite

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


# ampscale.fp8._cuda launches on torch's streams through these names of this module: each looks
# its home (_torch_cuda) up when called, so what replaces it there (the tests' CUDA stand-ins)
# is what runs
def _refuse_capture(what: str) -> None:
    _torch_cuda._refuse_capture(what)


def _raw_stream(device: torch.device) -> int:
    return _torch_cuda._raw_stream(device)


def _record_stream(tensor: torch.Tensor) -> None:
    _torch_cuda._record_stream(tensor)


BACKEND = TorchBackend()
adapter_ready(BACKEND)
