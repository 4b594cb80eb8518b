"""The drop-in ``GradScaler`` (public as :class:`ampscale.torch.GradScaler`; see :mod:`ampscale.torch`).

Framework helpers' layer: torch's protocol (call order, per-optimizer flags, ``state_dict``)
over the scaler's settings and state machine; the kernels, the CPU views and the CUDA launch are
the torch adapter's (:mod:`ampscale.backends.torch`, with ``_torch_cpu`` and ``_torch_cuda``).

Kept below :mod:`ampscale.torch` so that the FSDP scaler (:mod:`ampscale._torch_sharded`), which
subclasses it, and the public module, which offers both, import it from one place: the public
module imports this one and the FSDP one, and neither of those imports the public module.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple, NoReturn, cast

import torch
from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
from torch.amp.grad_scaler import OptState

from ampscale._config import (
    _UNSET,
    PRESETS,
    ScalerConfig,
    given_number,
    make_config,
    plain_number,
    shown,
    torch_setting,
)
from ampscale._core import ScalerState, initial_values
from ampscale._errors import StateDictError
from ampscale._native.cuda._packed import PackedState
from ampscale._ops import HostOps, host_ops
from ampscale._scaler import Scaler, _PendingScaler
from ampscale._state_dict import check_scale, from_state_dict, to_state_dict, torch_compatible
from ampscale.backends import _torch_cuda
from ampscale.backends._base import Backend, name_leaves
from ampscale.backends._torch_cpu import _HostView
from ampscale.backends.torch import BACKEND, UncoalescedSparseError

__all__ = ["GradScaler", "OptState", "SettingError", "StepResult"]


class SettingError(ValueError, AssertionError):
    """A bad setting: a ``ValueError`` naming it, and an ``AssertionError`` like torch's checks."""


class StepResult(NamedTuple):
    """What the latest :meth:`GradScaler.step` did (:attr:`GradScaler.last_step`), true when the
    step was applied: an immutable named tuple.

    ``step()`` itself returns what ``torch.amp.GradScaler.step`` returns (``optimizer.step()``'s
    value, ``None`` when skipped); this is where the outcome is kept.

    Attributes:
        applied: whether ``optimizer.step()`` took effect: a Python bool, or a 0-d bool tensor
            on the fused path (read it only when you need it: that read is a sync).
        found_inf: 0-d float32 tensor, nonzero when this optimizer's step overflowed (shared:
            do not modify it).
    """

    applied: bool | torch.Tensor
    found_inf: torch.Tensor

    def __bool__(self) -> bool:
        return bool(self.applied)


#: ``_new_tuple(StepResult, (applied, found_inf))``: a ``StepResult`` in one C call
#: (``step()`` makes one per call; the class's ``__new__`` is a Python function)
_new_tuple = tuple.__new__


#: ``found_inf`` of a step that checked nothing (a disabled scaler): shared, never written
_NO_OVERFLOW = torch.zeros(())


#: the outcome of a step that checked nothing (a disabled scaler)
_ALWAYS_APPLIED = StepResult(True, _NO_OVERFLOW)

_READY, _STEPPED = OptState.READY, OptState.STEPPED


def _fresh_state() -> dict[str, Any]:
    """A new entry of ``_per_optimizer_states``: torch's, with torch's ``OptState``."""
    return {"stage": _READY, "found_inf_per_device": {}}


def _grads_of(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's gradients, each ``.grad`` read once (with thousands of parameters the
    reads are a large part of the step)."""
    return [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]


def _parameter_names(optimizer: Any) -> list[str]:
    """A name for each gradient of ``_grads_of(optimizer)``, in its order (only for errors).

    The parameter's name where the optimizer was given named parameters (torch keeps them as
    ``param_groups[i]["param_names"]``: ``SGD(model.named_parameters())``), else its place:
    ``param_groups[0]['params'][3]``.
    """
    names = []
    for group_index, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for index, param in enumerate(group["params"]):
            if param.grad is not None:
                if given is not None and index < len(given):
                    names.append(str(given[index]))
                else:
                    names.append(f"param_groups[{group_index}]['params'][{index}]")
    return names


#: run the accelerator code path on CPU tensors too (tests: to exercise it, and show it reads nothing)
_DEVICE_PATH_EVERYWHERE = False


def _on_host(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor`` is a plain memory read (CPU), not a device sync.

    Every host-or-device decision of the drop-in is this one (inlined in the hot paths).
    """
    return bool(tensor.is_cpu) and not _DEVICE_PATH_EVERYWHERE


def _torch_setting(name: str) -> Any:
    """``_growth_factor`` and its kin: torch's attribute, kept as given, validated when written."""
    key = f"_given_{name}"

    def get(self: GradScaler) -> Any:
        try:
            return self.__dict__[key]
        except KeyError:  # torch's disabled scaler has none until a setter stores one
            raise AttributeError(f"{type(self).__name__!r} object has no attribute '_{name}'") from None

    def set(self: GradScaler, value: Any) -> None:
        if self._enabled:
            self._replace_setting(name, value)
        self.__dict__[key] = given_number(value, name == "growth_interval")

    return property(get, set, doc=f"The {name.replace('_', ' ')} as given (torch's attribute).")


#: step functions that take a ``grad_scaler`` keyword (``inspect.signature`` costs ~15 us)
_takes_grad_scaler: dict[Any, bool] = {}


def _step_takes_grad_scaler(step: Any) -> bool:
    function = getattr(step, "__func__", step)
    known = _takes_grad_scaler.get(function)
    if known is None:
        if len(_takes_grad_scaler) > 256:
            _takes_grad_scaler.clear()
        known = _takes_grad_scaler[function] = "grad_scaler" in inspect.signature(step).parameters
    return known


_FLOAT32 = torch.float32
_Tensor = torch.Tensor
_UNCHECKED = object()


class GradScaler(_TorchGradScaler):  # type: ignore[misc]
    """Drop-in ``torch.amp.GradScaler`` on ampscale's state machine.

    Args:
        device: ``"cuda"`` (torch's default; disabled with a warning when torch's own check,
            ``torch.cuda.amp.common.amp_definitely_not_available()``, says so), ``"cpu"``, or
            another device type.
        init_scale: initial scale (preset default; torch: ``2.0**16``).
        growth_factor: growth factor (torch: 2.0).
        backoff_factor: backoff factor (torch: 0.5).
        growth_interval: finite steps between growths (torch: 2000). As in torch, a value below
            1 means the scale never grows (with an ``AmpscaleWarning``).
        enabled: ``False`` makes every method a no-op, as in torch.
        preset: whose exact policy to follow (see ``ampscale.PRESETS``); default ``"torch"``.
        check_loss: count a non-finite scaled loss as an overflow (default ``True``; see
            :meth:`scale`).
        process_group: a ``torch.distributed`` process group (or ``"world"``) whose ranks must
            agree on overflow; the flags are all-reduced (MAX) in ``unscale_``.
        **settings: any other ``ampscale.create_scaler`` setting (``hysteresis``,
            ``min_scale``, ``max_scale``, ``on_floor``, ...).

    Raises:
        SettingError: a setting ampscale does not accept (a ``ValueError`` naming it, also an
            ``AssertionError`` as torch's own checks raise).
    """

    #: whether ``_multiply`` does more than multiply (FSDP's scaler casts back to the output's dtype)
    _casts_outputs: ClassVar[bool] = False

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = _UNSET,  # type: ignore[assignment]
        growth_factor: float = _UNSET,  # type: ignore[assignment]
        backoff_factor: float = _UNSET,  # type: ignore[assignment]
        growth_interval: int = _UNSET,  # type: ignore[assignment]
        enabled: bool = True,
        *,
        preset: str = "torch",
        check_loss: bool = True,
        process_group: Any = None,
        **settings: Any,
    ) -> None:
        # torch's attributes, with torch's names and meaning (no call to torch's __init__:
        # its checks are a subset of ampscale's)
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        self._check_loss = check_loss
        self._process_group = process_group
        if not self._enabled:
            return
        given = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        config = self._new_config(preset, given, settings)
        self._preset = preset
        self._settings = settings
        self._config = config
        self._init_scale = config.init_scale if init_scale is _UNSET else init_scale
        self._scale: torch.Tensor | None = None
        self._set_given(
            growth_factor=config.growth_factor if growth_factor is _UNSET else growth_factor,
            backoff_factor=config.backoff_factor if backoff_factor is _UNSET else backoff_factor,
            growth_interval=config.growth_interval if growth_interval is _UNSET else growth_interval,
        )
        start = initial_values(config)
        self._init_growth_tracker = start.growth_tracker
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_state)
        # ampscale's other fields (ScalerState[2:]): pending values until the first scale(),
        # then Python numbers (CPU) or 0-d tensors beside _scale
        self._init_rest: tuple[Any, ...] = tuple(start[2:])
        self._rest: tuple[Any, ...] | None = None
        # on CUDA: the packed record whose views _rest holds (update() is one in-place kernel)
        self._record: PackedState | None = None
        self._reset_loss_flags()
        self._step_applied: bool | None = None
        self._scale_view, self._tracker_view = _HostView(), _HostView()
        self._host_ops: HostOps | None = None
        self._plain_scale: object = _UNCHECKED  # the _scale the inline scale() path has checked
        # (scale tensor, its version, a lower bound of its value) for a scale on an accelerator
        self._scale_bound: tuple[torch.Tensor, int, float] | None = None

    # -- settings -------------------------------------------------------------------------------
    def _new_config(self, preset: str, given: dict[str, Any], settings: dict[str, Any]) -> ScalerConfig:
        default_offset = PRESETS[preset].defaults["interval_offset"] if preset in PRESETS else 0
        offset = plain_number(settings.get("interval_offset", default_offset), integral=True)
        offset = offset if isinstance(offset, int) and offset in (0, 1) else 0
        values = {name: torch_setting(name, value, offset) for name, value in given.items()}
        try:
            return make_config(preset, **values, **settings)
        except ValueError as exc:
            raise SettingError(str(exc)) from None

    def _replace_setting(self, name: str, value: Any) -> None:
        config = self._config
        stored = torch_setting(name, value, config.interval_offset)
        try:
            new = config.replace(**{name: stored})
        except ValueError as exc:
            raise SettingError(str(exc)) from None
        self._config = new
        if new.backoff_rule == "divide":  # single-factor presets: the backoff follows the growth
            self.__dict__["_given_backoff_factor"] = new.backoff_factor

    def _set_given(self, **values: Any) -> None:
        """Store torch's settings as given (what the getters and ``state_dict`` return), unchecked.

        Numbers are kept as plain Python numbers (``np.float32(2.0)`` as ``2.0``), so that
        ``state_dict()`` is JSON-serialisable and loads with ``torch.load(weights_only=True)``.
        """
        for name, value in values.items():
            self.__dict__[f"_given_{name}"] = given_number(value, name == "growth_interval")

    # torch's attributes: what was given, as torch keeps it; writing one (as torch's setters,
    # and code that skips them, do) validates it and changes the settings in use, once enabled
    _growth_factor = _torch_setting("growth_factor")
    _backoff_factor = _torch_setting("backoff_factor")
    _growth_interval = _torch_setting("growth_interval")

    @property
    def config(self) -> ScalerConfig:
        """The settings in use (ampscale's view of them)."""
        return self._config

    @property
    def scaler(self) -> Scaler:
        """An immutable ``ampscale.Scaler`` snapshot of this one (``.outcome``, ``.get_stats()``)."""
        if self._scale is None:
            return _PendingScaler(self._config, self._host_values(), BACKEND)
        if _on_host(self._scale):
            return Scaler(self._config, self._host_values(), BACKEND)
        assert self._growth_tracker is not None
        assert self._rest is not None
        # clones: on CUDA update() rewrites the fields in place, and a snapshot must not move
        state = ScalerState(self._scale.clone(), self._growth_tracker.clone(), *(v.clone() for v in self._rest))
        return Scaler(self._config, state, BACKEND)

    def _host_values(self) -> ScalerState:
        """The whole state as Python numbers (a host read on an accelerator)."""
        if self._scale is None or self._growth_tracker is None or self._rest is None:
            return ScalerState(self._init_scale, self._init_growth_tracker, *self._init_rest)
        rest = self._rest if _on_host(self._scale) else [v.item() for v in self._rest]
        return ScalerState(self._scale.item(), self._growth_tracker.item(), *rest)

    def _missing_state(self, funcname: str) -> NoReturn:
        """Raise torch's error for a call that needs the state before the first ``scale()``."""
        self._check_scale_growth_tracker(funcname)
        raise AssertionError(f"Attempted {funcname} but _scale is None.")  # (torch's check raised already)

    # -- lazy state -----------------------------------------------------------------------------
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """Create ``_scale`` and ``_growth_tracker`` on ``dev`` (torch's), and ampscale's counters."""
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        config = self._config
        self._scale = torch.full((), self._init_scale, dtype=self._scale_dtype(config, dev), device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        if _on_host(self._scale):
            self._rest = self._init_rest
        else:
            values = ScalerState(float(self._init_scale), int(self._init_growth_tracker), *self._init_rest)
            self._rest = self._device_rest(values, config)

    @staticmethod
    def _scale_dtype(config: ScalerConfig, device: Any) -> torch.dtype:
        """The dtype of ``_scale`` for ``config`` on ``device``: float64 where the settings keep the
        scale in float64 and the device has it, else float32 (torch's)."""
        wide = config.scale_dtype == "float64" and BACKEND.has_float64(torch.empty((), device=device))
        return torch.float64 if wide else torch.float32

    def _device_rest(self, values: ScalerState, config: ScalerConfig) -> tuple[Any, ...]:
        """ampscale's other fields as 0-d tensors beside ``_scale``, with ``_record`` set (see
        :meth:`_device_fields`)."""
        assert self._scale is not None
        rest, self._record = self._device_fields(values, config, self._scale)
        return rest

    @staticmethod
    def _device_fields(
        values: ScalerState, config: ScalerConfig, like: torch.Tensor
    ) -> tuple[tuple[Any, ...], PackedState | None]:
        """``(rest, record)``: ampscale's other fields as 0-d tensors on ``like``'s device; nothing
        of the scaler changes (``load_state_dict`` builds them before it replaces anything).

        On CUDA, where ampscale's kernels load, they are views of one packed record, which the
        one-launch update rewrites in place together with ``_scale`` and ``_growth_tracker``;
        elsewhere separate tensors that the eager transition replaces at each update (no record).
        """
        if _torch_cuda._cuda_module(config, like.device) is not None:  # CUDA, kernels loaded
            record = _torch_cuda._packed_from_values(values, config, like.device)
            return tuple(record.view(name) for name in ScalerState._fields[2:]), record
        # the generic tensor state (the torch backend would keep CPU state as Python numbers)
        return tuple(Backend.make_state(BACKEND, values, config, like)[2:]), None

    # -- scale ----------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor or an iterable of tensors by the scale (torch's semantics).

        With ``check_loss`` (the default), each scaled output that can seed a backward pass
        (``requires_grad``) is checked at once and folded into one overflow flag per device;
        nothing is kept. The rule: a non-finite scaled output counts as an overflow for every
        optimizer unscaled (by ``unscale_`` or ``step``) after it and before the next
        ``update()``, which then backs off once; outputs scaled under ``torch.no_grad()`` (for
        logging, say) never count. On the CPU the check reads the value (no device involved);
        elsewhere it is two small kernels and no sync.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, _Tensor):
            scale = self._scale
            if scale is not self._plain_scale or not outputs.is_cpu:
                if scale is None:
                    self._lazy_init_scale_growth_tracker(outputs.device)
                    scale = cast(torch.Tensor, self._scale)
                if self._casts_outputs or scale.dtype is not _FLOAT32 or not (scale.is_cpu and outputs.is_cpu):
                    return self._scale_one(outputs, scale)
                self._plain_scale = scale  # a float32 CPU tensor: checked once per tensor object
            # the common case inline: this runs once per micro-batch
            scaled = outputs * scale
            if self._check_loss and scaled.requires_grad:
                if scaled.dim() or _DEVICE_PATH_EVERYWHERE:
                    self._note_loss(scaled)
                else:
                    # tolist(), not item(): item() on a tensor that requires grad warns (and
                    # costs 2 us more); a complex loss goes the general way
                    try:
                        finite = math.isfinite(scaled.tolist())
                    except TypeError:
                        self._note_loss(scaled)
                    else:
                        if not finite:
                            self._loss_bad_on_host = True
            return scaled

        moved: dict[torch.device, torch.Tensor] = {}  # the scale on each device, copied once

        def apply_scale(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(value.device)
                assert self._scale is not None
                if not moved:
                    moved[self._scale.device] = self._scale
                scale = moved.get(value.device)
                if scale is None:
                    scale = moved[value.device] = self._scale.to(value.device, non_blocking=True)
                return self._scale_one(value, scale)
            if isinstance(value, Iterable):
                mapped = map(apply_scale, value)
                if isinstance(value, (list, tuple)):
                    return type(value)(mapped)
                return mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _scale_one(self, outputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = self._multiply(outputs, scale)
        if self._check_loss and scaled.requires_grad:
            self._note_loss(scaled)
        return scaled

    def _multiply(self, outputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``outputs * scale`` with torch's promotion (a float32 scale)."""
        if scale.dtype is not torch.float32:
            scale = scale.float()  # the float64 presets keep a float64 scale
        if not (scale.is_cpu and outputs.is_cpu) and scale.device != outputs.device:
            scale = scale.to(device=outputs.device, non_blocking=True)
        return outputs * scale

    def _reset_loss_flags(self) -> None:
        self._loss_bad_on_host = False
        self._loss_bad: dict[torch.device, torch.Tensor] = {}  # per device, 0-d bool, kept on device

    def _note_loss(self, scaled: torch.Tensor) -> None:
        """Fold ``scaled`` into this iteration's loss overflow flag (keeps no reference to it)."""
        if _on_host(scaled):
            with torch.no_grad():
                finite = bool(torch.isfinite(scaled).all())
            if not finite:
                self._loss_bad_on_host = True
            return
        with torch.no_grad():
            bad = torch.isfinite(scaled).all().logical_not()
            flag = self._loss_bad.get(scaled.device)
            if flag is None:
                self._loss_bad[scaled.device] = bad
            else:
                flag.logical_or_(bad)

    def _settle(self, found: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """Fold the loss flags into an optimizer's fresh ``found_inf`` tensors, then agree on them."""
        if found and self._check_loss:
            home = self._scale.device if self._scale is not None else next(iter(found))
            if self._loss_bad_on_host:
                target = found.get(torch.device("cpu"), found.get(home, next(iter(found.values()))))
                target.fill_(1.0)
            for device, bad in self._loss_bad.items():
                target = found.get(device, found.get(home, next(iter(found.values()))))
                torch.maximum(target, bad.to(device=target.device, dtype=target.dtype), out=target)
        if found:
            self._agree(found)
        return found

    def _agree(self, found: dict[torch.device, torch.Tensor]) -> None:
        """Make every rank of ``process_group`` see the same flags (all-reduce MAX, in place)."""
        if self._process_group is None:
            return
        import torch.distributed as dist

        group = None if self._process_group in (True, "world") else self._process_group
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)

    # -- unscale --------------------------------------------------------------------------------
    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale`` in place and check them (torch's).

        Returns one flag per device of the gradients, each starting as a copy of ``found_inf``
        and set to 1.0 if that device's gradients held an inf or nan ({} when there are no
        gradients). Subclasses may override it, as FSDP's ``ShardedGradScaler`` does: ``unscale_``
        and ``step`` call it. ``allow_fp16=False`` refuses float16 gradients, as torch does.
        """
        return self._unscale_into(optimizer, inv_scale, found_inf, allow_fp16)

    def _unscale_into(
        self, optimizer: Any, inv_scale: Any, found_inf: torch.Tensor | None, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        grads = _grads_of(optimizer)
        if not grads:
            return {}
        if not allow_fp16 and any(g.dtype is torch.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")
        if isinstance(inv_scale, torch.Tensor) and inv_scale is BACKEND.constant(1.0, inv_scale.device):
            floor: float | None = math.inf  # a check only (_check_inf_per_device): nothing is multiplied
        else:
            floor = self._scale_floor(optimizer)
        try:
            try:
                return BACKEND.found_inf_and_unscale(grads, inv_scale, found_inf=found_inf, scale_floor=floor)
            except UncoalescedSparseError:
                # torch coalesces float16 sparse gradients first: duplicates may overflow when summed
                self._coalesce_half_sparse(optimizer)
                return BACKEND.found_inf_and_unscale(
                    _grads_of(optimizer), inv_scale, found_inf=found_inf, scale_floor=floor
                )
        except Exception as exc:  # an error naming gradients by index: name their parameters
            name_leaves(exc, lambda: _parameter_names(optimizer))
            raise

    def _scale_floor(self, optimizer: Any) -> float | None:
        """The scale on the CPU; a host lower bound of it on an accelerator (``None``: unknown).

        Below a scale of 1 a finite gradient can overflow when unscaled, and the backend then
        checks the values it wrote too (a second pass). To skip that pass without reading the
        device, the scaler keeps a bound: the scale last read, lowered by one backoff at each
        ``update()`` (the most an update can lower it), valid while the tensor is the same and
        its version counter shows no other write (``update(new_scale)``, ``load_state_dict``,
        a user's ``fill_``). When the bound falls below 1 the scale is read once (a sync, about
        every log2(scale) updates), unless the optimizer takes the scaler itself (fused
        optimizers, which torch runs without any sync): those get the second pass instead.
        """
        scale = self._scale
        if scale is None:
            return None
        if _on_host(scale):
            return float(self._scale_view.read(scale))  # a CPU tensor: read, nothing to wait for
        bound = getattr(self, "_scale_bound", None)  # (absent from pickles of older versions)
        if bound is not None and bound[0] is scale and bound[1] == scale._version and bound[2] >= 1.0:
            return float(bound[2])
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return None
        value = float(scale.item())  # the documented occasional read (see above)
        self._scale_bound = (scale, scale._version, value)
        return value

    @staticmethod
    def _coalesce_half_sparse(optimizer: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.is_sparse and p.grad.dtype is torch.float16:
                        p.grad = p.grad.coalesce()

    def _inverse_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """torch's ``1 / scale``: reciprocal in float64, then float32 (a cached constant on the CPU)."""
        if _on_host(scale):
            return BACKEND.constant(BACKEND.inverse_scale(self._scale_view.read(scale)), scale.device)
        inverse: torch.Tensor = BACKEND.inverse_scale(scale)
        return inverse

    def _new_found(self, optimizer: Any, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """Unscale (or check, with ``inv_scale`` 1) through ``_unscale_grads_``, as torch does."""
        scale = self._scale
        assert scale is not None
        if type(self)._unscale_grads_ is GradScaler._unscale_grads_:
            # not overridden: let the backend make the zero flags (torch makes one and copies it)
            return self._settle(self._unscale_into(optimizer, inv_scale, None))
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        return self._settle(self._unscale_grads_(optimizer, inv_scale, found_inf, True))

    def unscale_(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients in place and record whether they overflowed.

        Optional, as in torch: use it to clip or inspect unscaled gradients before ``step``.
        Calling it twice before ``update`` raises, as in torch. Does not sync. float16
        gradients are accepted.
        """
        if not self._enabled:
            return
        scale = self._scale
        if scale is None or self._growth_tracker is None:
            self._missing_state("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        optimizer_state["found_inf_per_device"] = self._new_found(optimizer, self._inverse_scale(scale))
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients without unscaling them, and record the flags (torch's)."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found = self._new_found(optimizer, BACKEND.constant(1.0, scale.device))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    # -- step -----------------------------------------------------------------------------------
    @staticmethod
    def _sum_found(found: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
        if len(found) == 1:
            (flag,) = found.values()
            if flag.device == device:
                return flag
        total: torch.Tensor | None = None
        for flag in found.values():
            moved = flag.to(device, non_blocking=True)
            total = moved if total is None else total + moved
        assert total is not None
        return total

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``optimizer.step()`` unless this optimizer's gradients overflowed (torch's; reads the flags)."""
        found = optimizer_state["found_inf_per_device"]
        if len(found) == 1:
            (flag,) = found.values()
            applied = not flag.item()
        else:
            applied = not sum(v.item() for v in found.values())
        self._step_applied = applied
        return optimizer.step(*args, **kwargs) if applied else None

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and call ``optimizer.step()`` unless the step overflowed.

        Returns what ``torch.amp.GradScaler.step`` returns: ``optimizer.step(*args, **kwargs)``'s
        return value (the closure's loss, for an optimizer given a closure positionally), or
        ``None`` when the step was skipped. Whether it was applied is :attr:`last_step` (a
        :class:`StepResult`: a device tensor on the fused path, so no sync). An optimizer with
        ``_step_supports_amp_scaling`` (``Adam(fused=True)``, ...) is handed the scale and the
        flag as tensors (``grad_scale``, ``found_inf``) and the host reads nothing; if its
        ``step`` takes a ``grad_scaler`` keyword it gets this scaler instead (with torch's
        ``FutureWarning``) and does everything itself. Otherwise the skip decision reads the
        flag, as torch's does.
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            self._last_step = _ALWAYS_APPLIED
            return retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._scale
        if scale is None or self._growth_tracker is None:
            self._missing_state("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        stage = optimizer_state["stage"]
        if stage is _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_amp_aware(optimizer, optimizer_state, scale, args, kwargs)
        if stage is _READY:
            self.unscale_(optimizer)
        found = optimizer_state["found_inf_per_device"]
        if len(found) == 1:
            if (scale is self._plain_scale or scale.is_cpu) and type(self)._maybe_opt_step is _OWN_MAYBE_OPT_STEP:
                # the common case, _maybe_opt_step inline: one CPU flag, read (no device involved)
                for found_inf in found.values():
                    if found_inf.is_cpu:
                        ok = not found_inf.item()
                        retval = optimizer.step(*args, **kwargs) if ok else None
                        optimizer_state["stage"] = _STEPPED
                        self._last_step = _new_tuple(StepResult, (ok, found_inf))
                        return retval
        elif not found:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        self._step_applied = None
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        found_inf = self._sum_found(found, scale.device)
        applied: bool | torch.Tensor | None = self._step_applied
        if applied is None:  # _maybe_opt_step was overridden: report the flag, unread
            applied = found_inf == 0
        optimizer_state["stage"] = _STEPPED
        self._last_step = _new_tuple(StepResult, (applied, found_inf))
        return retval

    @property
    def last_step(self) -> StepResult | None:
        """The outcome of the latest :meth:`step` call (``None`` before the first).

        A :class:`StepResult`, true when that optimizer's update was applied; kept through
        :meth:`update` until the next ``step()``, so a scheduler or an EMA can be gated after
        the iteration: ``if scaler.last_step: scheduler.step()``. ``applied`` is a device tensor
        on the fused path (``Adam(fused=True)`` on a GPU): reading it is the sync, when you
        choose. With several optimizers, read it after each one's ``step()``.
        """
        return self.__dict__.get("_last_step")

    def _step_amp_aware(
        self, optimizer: Any, optimizer_state: dict[str, Any], scale: torch.Tensor, args: Any, kwargs: dict[str, Any]
    ) -> Any:
        """``step`` for an optimizer that handles scaling itself (torch's two protocols)."""
        if _step_takes_grad_scaler(optimizer.step):
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs.update({"grad_scaler": self})
            retval = optimizer.step(*args, **kwargs)
            optimizer_state["stage"] = OptState.STEPPED
            found = optimizer_state["found_inf_per_device"]  # whatever the optimizer recorded
            if not found:
                self._last_step = _ALWAYS_APPLIED
                return retval
            found_inf = self._sum_found(found, scale.device)
            self._last_step = StepResult(found_inf == 0, found_inf)
            return retval
        if optimizer_state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        found_inf = self._sum_found(optimizer_state["found_inf_per_device"], scale.device)
        grad_scale = self._get_scale_async()
        if grad_scale.dtype is not torch.float32:
            grad_scale = grad_scale.float()
        # Keep a scale the user set on the optimizer: multiply it in (as torch does).
        optimizer.grad_scale = (
            getattr(optimizer, "grad_scale", None)
            if optimizer_state["stage"] is OptState.UNSCALED
            else grad_scale * getattr(optimizer, "grad_scale", 1)
        )
        optimizer.found_inf = found_inf
        retval = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        del optimizer.grad_scale
        del optimizer.found_inf
        self._last_step = StepResult(found_inf == 0, found_inf)
        return retval

    # -- update ---------------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's overflow flags (or set it to ``new_scale``).

        Like torch: backs off once if any optimizer overflowed, grows after ``growth_interval``
        finite iterations, and ``new_scale`` fills the scale in place without touching the
        growth tracker. Raises :class:`ampscale.ScaleAtFloorError` when the preset's
        ``on_floor`` says so (after the step is recorded, so the loop can go on). Does not sync
        (except for an ``on_floor`` reaction, which reads one flag).
        """
        if not self._enabled:
            return
        scale, tracker = self._scale, self._growth_tracker
        if scale is None or tracker is None:
            self._missing_state("update")
        floor_values: ScalerState | None = None
        if new_scale is not None:
            self._fill_scale(scale, new_scale)
        elif scale.is_cpu and not _DEVICE_PATH_EVERYWHERE:
            # the host transition, inline (it runs on every step): the flags and the state read
            # as Python numbers, the tensors written through their NumPy views
            total, flags = 0.0, 0
            for state in self._per_optimizer_states.values():
                for flag in state["found_inf_per_device"].values():
                    total += flag.item()  # torch sums the flags too
                    flags += 1
            if not flags:
                raise AssertionError("No inf checks were recorded prior to update.")
            config = self._config
            ops = self._host_transition()
            scale_view, tracker_view = self._scale_view.of(scale), self._tracker_view.of(tracker)
            old_scale = scale.item() if scale_view is None else scale_view.value
            old_tracker = tracker.item() if tracker_view is None else tracker_view.value
            if not total and not self._loss_bad_on_host and not self._loss_bad:
                # the usual step, gradients and losses finite: the transition with both flags folded in
                new_scale, new_tracker, rest, floor_event = ops.run_split_ok(old_scale, old_tracker, self._rest)
            else:
                loss_ok = not self._loss_bad_on_host and not any(map(bool, self._loss_bad.values()))
                new_scale, new_tracker, rest, floor_event = ops.run_split(
                    old_scale, old_tracker, self._rest, not total, loss_ok
                )
            if new_scale != old_scale or old_scale != old_scale:  # (NaN: write it anyway)
                if scale_view is None:
                    scale.fill_(new_scale)
                else:
                    scale_view.value = new_scale
            if new_tracker != old_tracker:
                if tracker_view is None:
                    tracker.fill_(new_tracker)
                else:
                    tracker_view.value = new_tracker
            self._rest = rest
            if floor_event and config.on_floor != "ignore":
                floor_values = ScalerState(new_scale, new_tracker, *rest)
        else:
            floor_values = self._update_on_device(scale, tracker)
        # a new dict, as torch: references to the old one (and its flags) stay intact
        self._per_optimizer_states = defaultdict(_fresh_state)
        if self._loss_bad_on_host or self._loss_bad:
            self._reset_loss_flags()
        if floor_values is not None:
            self._react_to_floor(floor_values)

    def _found_infs(self) -> list[torch.Tensor]:
        found_infs = [
            flag for state in self._per_optimizer_states.values() for flag in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        return found_infs

    def _update_in_place(self, scale: torch.Tensor, tracker: torch.Tensor) -> ScalerState | bool | None:
        """``update()`` on CUDA as one launch (:func:`ampscale.backends._torch_cuda._update_fields`):
        ``_scale``, ``_growth_tracker`` and the record of the other fields rewritten in place,
        no sync. Returns ``False`` where it does not apply (the eager transition runs), else what
        :meth:`_update_on_device` returns."""
        record = getattr(self, "_record", None)  # (absent from pickles of older versions)
        rest = self._rest
        if record is None or not rest or rest[-1] is not record.view(ScalerState._fields[-1]):
            return False
        config = self._config
        loss_bad = None if self._loss_bad_on_host else list(self._loss_bad.values())
        if not _torch_cuda._update_fields(config, scale, tracker, record, self._found_infs, loss_bad):
            return False
        bound = getattr(self, "_scale_bound", None)
        if bound is not None and bound[0] is scale and bound[1] == scale._version:
            # the kernel wrote the scale without torch's version counter: the bound follows it
            self._scale_bound = (scale, scale._version, float(self._lowest_after_update(bound[2])))
        if config.on_floor != "ignore" and bool(record.view("floor_event")):  # the documented host read
            return BACKEND.read_state(record)
        return None

    def _update_on_device(self, scale: torch.Tensor, tracker: torch.Tensor) -> ScalerState | None:
        done = self._update_in_place(scale, tracker)
        if done is not False:
            return done  # type: ignore[return-value]
        self._record = None  # the eager transition makes new tensors: _rest no longer views it
        home = scale.device
        combined: torch.Tensor | None = None
        for flag in self._found_infs():
            moved = flag.to(device=home, non_blocking=True)
            combined = moved if combined is None else combined + moved  # torch adds in place
        assert combined is not None
        loss_finite: Any = None
        if self._loss_bad_on_host or self._loss_bad:
            loss_finite = torch.tensor(not self._loss_bad_on_host, device=home)
            for bad in self._loss_bad.values():
                loss_finite = loss_finite & bad.to(home, non_blocking=True).logical_not()
        config = self._config
        assert self._rest is not None
        state = ScalerState(scale, tracker, *self._rest)
        ops = BACKEND.ops(config, state)
        # the generic tensor transition: torch's two tensors stay the ones updated in place (the
        # backend's packed one-launch record would hold the state in a buffer of its own)
        new, _, floor_event = Backend.run_transition(BACKEND, config, state, combined == 0, loss_finite, ops)
        bound = getattr(self, "_scale_bound", None)
        valid = bound is not None and bound[0] is scale and bound[1] == scale._version
        scale.copy_(new.scale)  # in place, as torch's kernel: held references see the new scale
        if valid:  # the lowest the scale can now be: one backoff below (never below the floor)
            assert bound is not None
            self._scale_bound = (scale, scale._version, float(self._lowest_after_update(bound[2])))
        tracker.copy_(new.growth_tracker)
        self._rest = tuple(new[2:])
        if config.on_floor != "ignore" and bool(floor_event):  # the documented host read
            return BACKEND.read_state(new)
        return None

    def _host_transition(self) -> HostOps:
        """The compiled host transition of the current settings (cached on them and here)."""
        ops = self._host_ops
        config = self._config
        if ops is None or ops.config is not config:
            ops = self._host_ops = host_ops(config)
        return ops

    def _lowest_after_update(self, scale: float) -> float:
        return float(self._host_transition().shrink(scale)) if self._config.dynamic else scale

    def _react_to_floor(self, values: ScalerState) -> None:
        Scaler(self._config)._react_to_floor(values)

    def _fill_scale(self, scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
        """torch's ``update(new_scale)``: the scale filled in place, the tracker kept.

        Checked first, and nothing changes on a refusal: a tensor as torch checks it (on the
        scaler's device type, one element, no ``requires_grad``: ``AssertionError`` with
        torch's message; not bool or complex), a number that is a real number and no bool;
        then the value as the scale will hold it (rounded to its dtype: finite, > 0, within
        ``[min_scale, max_scale]``), so 0, nan, inf and negatives are refused here rather than
        dividing by zero in the next ``unscale_``. A tensor's value is read for the check (on
        an accelerator, one sync in this rare call).
        """
        if isinstance(new_scale, torch.Tensor):
            reason = (
                "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                "torch.FloatTensor with requires_grad=False."
            )
            if new_scale.device.type != self._device:
                raise AssertionError(reason)
            if new_scale.numel() != 1:
                raise AssertionError(reason)
            if new_scale.requires_grad is True:
                raise AssertionError(reason)
            if new_scale.dtype is torch.bool or new_scale.is_complex():
                raise TypeError(
                    f"new_scale must be a real number or a real 1-element tensor; got a {new_scale.dtype} tensor"
                )
            value: Any = new_scale.item()
        elif isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
            raise TypeError(
                "new_scale must be a float (or an int) or a 1-element tensor with requires_grad=False; got "
                f"{type(new_scale).__name__} {shown(new_scale)}"
            )
        else:
            value = new_scale
        try:
            checked = check_scale("new_scale", value, self._config, what="update() argument")
        except StateDictError as exc:
            raise SettingError(str(exc)) from None
        scale.fill_(checked)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``{}`` when disabled), plus an ``"ampscale"`` entry when the
        settings use what torch lacks (another preset, hysteresis, a floor or ceiling, ...)."""
        if not self._enabled:
            return {}
        out = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        if not torch_compatible(self._config):
            out["ampscale"] = to_state_dict(self._config, self._host_values())["ampscale"]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from this class, from ``torch.amp.GradScaler``, from an ampscale scaler
        (a dict holding only the ``"ampscale"`` entry too) or from apex's ``LossScaler``.

        All or nothing: the dict is checked first, value by value, and the new tensors are
        made before anything is replaced; a bad one raises ``ampscale.StateDictError`` (a
        ``ValueError``) naming the key, and changes nothing. Loading after the first
        ``scale()`` gives the state loading before it would have: the scale tensor keeps its
        dtype when the loaded settings keep theirs, and filled in place (as torch); when they
        change it (a float64 checkpoint of the ``deepspeed`` or ``apex`` preset into a float32
        scaler, or back), ``_scale`` becomes a new tensor of the loaded dtype on the same
        device, so the run resumes exactly (references to the old tensor see no later change).
        """
        if not self._enabled:
            return
        if isinstance(state_dict, dict) and len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        config, values = from_state_dict(state_dict, self._config)
        # torch's attributes: as the dict gives them, else as the loaded settings say
        given = {
            name: state_dict[name] if name in state_dict else getattr(config, name)
            for name in ("growth_factor", "backoff_factor", "growth_interval")
        }
        scale, tracker = self._scale, self._growth_tracker
        new_scale: torch.Tensor | None = None
        rest: tuple[Any, ...] = tuple(values[2:])
        record: PackedState | None = None
        if scale is not None and tracker is not None:
            dtype = self._scale_dtype(config, scale.device)
            if scale.dtype != dtype:
                new_scale = torch.full((), values.scale, dtype=dtype, device=scale.device)
            if not _on_host(scale):
                rest, record = self._device_fields(values, config, new_scale if new_scale is not None else scale)
        # nothing above changed the scaler; from here on nothing can fail
        self._config = config
        self._preset = config.preset
        self._init_scale = values.scale
        self._set_given(**given)
        self._init_growth_tracker = values.growth_tracker
        self._init_rest = tuple(values[2:])
        if scale is not None and tracker is not None:
            if new_scale is None:
                scale.fill_(values.scale)
            else:
                self._scale = new_scale
            tracker.fill_(values.growth_tracker)
            self._rest = rest
            self._record = record

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pickles written before the device record existed lack it: a copy builds it lazily
        state.setdefault("_record", None)
        self.__dict__.update(state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end "
                    "after scaler.update()."
                )
            # as torch: the copy re-creates its tensors lazily from these values
            values = self._host_values()
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_rest"] = tuple(values[2:])
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_rest"] = None
            state["_record"] = None
            state["_scale_view"], state["_tracker_view"] = _HostView(), _HostView()
            state["_host_ops"] = None
            state["_plain_scale"] = _UNCHECKED
            state["_scale_bound"] = None
            state["_loss_bad_on_host"] = False
            state["_loss_bad"] = {}
            state.pop("_last_step", None)  # an outcome of this process's steps, with a tensor
        return state

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        c = self._config
        return (
            f"{type(self).__name__}(device={self._device!r}, preset={c.preset!r}, scale={self.get_scale()!r}, "
            f"growth_factor={self._growth_factor!r}, backoff_factor={self._backoff_factor!r}, "
            f"growth_interval={self._growth_interval!r})"
        )


#: the drop-in's own _maybe_opt_step (step() inlines it unless a subclass overrides it)
_OWN_MAYBE_OPT_STEP = GradScaler._maybe_opt_step
