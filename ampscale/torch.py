"""``ampscale.torch.GradScaler``: a drop-in for ``torch.amp.GradScaler``, and what it lacks.

Same constructor, methods, call order rules, error messages and ``state_dict`` keys as
``torch.amp.GradScaler``, so existing loops run unchanged::

    scaler = ampscale.torch.GradScaler("cuda")
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        result = scaler.step(optimizer)        # torch returns optimizer.step()'s value
        scaler.update()

Differences, all additions:

* ``step`` returns a :class:`StepResult` saying whether the update was applied (a device
  tensor on the fused path, so there is still no sync), with the optimizer's own return value
  in ``.retval``.
* float16 and bfloat16 gradients are accepted (torch refuses float16 and, on CUDA, bfloat16).
* ``preset=``, ``hysteresis=``, ``min_scale=``, ``max_scale=``, ``on_floor=`` and the other
  ampscale settings; a ``process_group`` whose ranks agree on overflow before anything changes.
* a scaled loss that is not finite counts as an overflow (``check_loss=False`` turns it off).
* with a fused optimizer (``Adam(fused=True)``) nothing is read on the host, as in torch.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ampscale._config import _UNSET, ScalerConfig, make_config
from ampscale._core import ScalerState, initial_values
from ampscale._scaler import Scaler, _PendingScaler
from ampscale._state_dict import from_state_dict, to_state_dict
from ampscale.backends.torch import BACKEND, UncoalescedSparseError

__all__ = ["GradScaler", "OptState", "StepResult"]


class OptState(enum.Enum):
    """Where an optimizer is in the current iteration (torch's names)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class SettingError(ValueError, AssertionError):
    """A bad setting: a ``ValueError`` naming it, and an ``AssertionError`` like torch's checks."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What :meth:`GradScaler.step` did.

    Attributes:
        applied: whether ``optimizer.step()`` took effect: a Python bool, or a 0-d bool tensor
            on the fused path (read it only when you need it: that read is a sync).
        retval: the return value of ``optimizer.step()`` (``None`` if it was skipped).
        found_inf: 0-d float32 tensor, 1.0 when this optimizer's step overflowed.
    """

    applied: bool | torch.Tensor
    retval: Any
    found_inf: torch.Tensor

    def __bool__(self) -> bool:
        return bool(self.applied)


def _grads_of(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's gradients, each ``.grad`` read once (with thousands of parameters the
    reads are a large part of the step)."""
    return [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]


def _fresh_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler:
    """Drop-in ``torch.amp.GradScaler`` on ampscale's state machine.

    Args:
        device: ``"cuda"`` (torch's default; disabled with a warning when CUDA is absent),
            ``"cpu"``, or another device type.
        init_scale: initial scale (preset default; torch: ``2.0**16``).
        growth_factor: growth factor (torch: 2.0).
        backoff_factor: backoff factor (torch: 0.5).
        growth_interval: finite steps between growths (torch: 2000).
        enabled: ``False`` makes every method a no-op, as in torch.
        preset: whose exact policy to follow (see ``ampscale.PRESETS``); default ``"torch"``.
        check_loss: count a non-finite scaled loss as an overflow (default ``True``).
        process_group: a ``torch.distributed`` process group (or ``"world"``) whose ranks must
            agree on overflow; the flag is all-reduced in ``unscale_``.
        **settings: any other ``ampscale.create_scaler`` setting (``hysteresis``,
            ``min_scale``, ``max_scale``, ``on_floor``, ...).
    """

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
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        self._check_loss = check_loss
        self._process_group = process_group
        self._per_optimizer_states: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._losses: list[torch.Tensor] = []
        self._last_loss_finite: torch.Tensor | None = None
        self._disabled_settings: dict[str, Any] = {}  # what setters store while disabled, as torch
        if not self._enabled:
            return
        try:
            config = make_config(
                preset,
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                **settings,
            )
        except ValueError as exc:
            raise SettingError(str(exc)) from None
        self._scaler: Scaler = Scaler(config, None, BACKEND)

    # -- internals --------------------------------------------------------------------------
    @property
    def scaler(self) -> Scaler:
        """The immutable ``ampscale.Scaler`` behind this object (its state and outcome)."""
        return self._scaler

    @property
    def config(self) -> ScalerConfig:
        """The settings in use."""
        return self._scaler.config

    def _initialized(self) -> bool:
        return self._scaler.state is not None

    def _lazy_init(self, device: torch.device) -> None:
        scaler = self._scaler
        values = scaler._values if isinstance(scaler, _PendingScaler) else initial_values(scaler.config)
        state = BACKEND.make_state(values, scaler.config, torch.empty((), device=device))
        self._scaler = Scaler(scaler.config, state, BACKEND)

    def _require_initialized(self, funcname: str) -> ScalerState:
        state: ScalerState | None = self._scaler._state
        if state is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return state

    def _scale_tensor(self, device: torch.device) -> torch.Tensor:
        state = self._require_initialized("scale")
        scale = state.scale
        if isinstance(scale, torch.Tensor):
            tensor = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
            return tensor if tensor.device == device else tensor.to(device, non_blocking=True)
        return BACKEND.constant(float(scale), device)

    def _state_for(self, optimizer: Any) -> dict[str, Any]:
        state = self._per_optimizer_states.get(optimizer)
        if state is None:
            state = self._per_optimizer_states[optimizer] = _fresh_state()
        return state

    # -- scale ------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor or an iterable of tensors by the scale (torch's semantics).

        With ``check_loss`` (the default) the scaled values are remembered, detached, so that a
        non-finite scaled loss counts as an overflow of this iteration.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if not self._initialized():
                self._lazy_init(outputs.device)
            scaled = outputs * self._scale_tensor(outputs.device)
            if self._check_loss:
                self._losses.append(scaled.detach())
            return scaled

        def apply_scale(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self.scale(value)
            if isinstance(value, Iterable):
                mapped = map(apply_scale, value)
                if isinstance(value, (list, tuple)):
                    return type(value)(mapped)
                return mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _loss_found_inf(self, device: torch.device) -> torch.Tensor | None:
        """1.0 on ``device`` if a scaled loss of this iteration was not finite (no sync)."""
        if not self._losses:
            return None
        flags = [torch.logical_not(torch.isfinite(loss).all()).to(device, non_blocking=True) for loss in self._losses]
        return torch.stack(flags).any().to(torch.float32)

    # -- unscale ----------------------------------------------------------------------------
    def _unscale_grads_(self, optimizer: Any, inv_scale: Any, allow_fp16: bool = True) -> dict[torch.device, Any]:
        grads = _grads_of(optimizer)
        try:
            found = BACKEND.found_inf_and_unscale(grads, inv_scale)
        except UncoalescedSparseError:
            # torch coalesces float16 sparse gradients first: duplicates may overflow when summed
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None and p.grad.is_sparse and p.grad.dtype is torch.float16:
                            p.grad = p.grad.coalesce()
            found = BACKEND.found_inf_and_unscale(_grads_of(optimizer), inv_scale)
        state = self._require_initialized("unscale_")
        home = state.scale.device if isinstance(state.scale, torch.Tensor) else torch.device("cpu")
        if not found:
            found[home] = torch.zeros((), dtype=torch.float32, device=home)
        loss_inf = self._loss_found_inf(home) if self._check_loss else None
        if loss_inf is not None:
            target = home if home in found else next(iter(found))
            found[target] = torch.maximum(found[target], loss_inf.to(target, non_blocking=True))
        if self._process_group is not None:
            found = {device: self._agree(flag) for device, flag in found.items()}
        return found

    def _agree(self, found_inf: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        group = None if self._process_group in (True, "world") else self._process_group
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf

    def unscale_(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients in place and record whether they overflowed.

        Optional, as in torch: use it to clip or inspect unscaled gradients before ``step``.
        Calling it twice before ``update`` raises, as in torch. Does not sync.
        """
        if not self._enabled:
            return
        state = self._require_initialized("unscale_")
        optimizer_state = self._state_for(optimizer)
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = BACKEND.inverse_scale(state.scale)
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale)
        optimizer_state["stage"] = OptState.UNSCALED

    # -- step -------------------------------------------------------------------------------
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

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> StepResult:
        """Unscale (if not done yet) and call ``optimizer.step()`` unless the step overflowed.

        Returns a :class:`StepResult`; ``torch.amp.GradScaler.step`` returns what
        ``optimizer.step()`` returns, found here in ``.retval``. With an optimizer that unscales
        in its own fused kernel (``_step_supports_amp_scaling``, e.g. ``Adam(fused=True)``), the
        scale and the flag are handed to it as tensors (``grad_scale``, ``found_inf``) and the
        host reads nothing; otherwise the skip decision reads the flag, as torch does.
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            return StepResult(True, retval, torch.zeros(()))
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._require_initialized("step")
        optimizer_state = self._state_for(optimizer)
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        home = state.scale.device if isinstance(state.scale, torch.Tensor) else torch.device("cpu")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if optimizer_state["stage"] is OptState.READY:
                optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, None)
            scale = self._scale_tensor(home)
            found_inf = self._sum_found(optimizer_state["found_inf_per_device"], home)
            # Keep a scale the user set on the optimizer: multiply it in (as torch does).
            optimizer.grad_scale = (
                getattr(optimizer, "grad_scale", None)
                if optimizer_state["stage"] is OptState.UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs)
            optimizer_state["stage"] = OptState.STEPPED
            del optimizer.grad_scale
            del optimizer.found_inf
            return StepResult(found_inf == 0, retval, found_inf)

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        found_inf = self._sum_found(optimizer_state["found_inf_per_device"], home)
        retval = None
        applied = not bool(found_inf)  # torch reads the flag here too (a sync on GPUs)
        if applied:
            retval = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return StepResult(applied, retval, found_inf)

    # -- update -----------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's overflow flags (or set it to ``new_scale``).

        Like torch: backs off once if any optimizer overflowed, grows after ``growth_interval``
        finite iterations, and ``new_scale`` replaces the scale without touching the growth
        tracker. Raises :class:`ampscale.ScaleAtFloorError` when the preset's ``on_floor`` says
        so. Does not sync (except for an ``on_floor`` reaction, which reads one flag).
        """
        if not self._enabled:
            return
        state = self._require_initialized("update")
        if new_scale is not None:
            self._set_scale(state, new_scale)
        else:
            home = state.scale.device if isinstance(state.scale, torch.Tensor) else torch.device("cpu")
            found_infs = [
                flag if flag.device == home else flag.to(home, non_blocking=True)
                for opt_state in self._per_optimizer_states.values()
                for flag in opt_state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found_infs[0]
            for flag in found_infs[1:]:
                combined = combined + flag
            loss_inf = self._loss_found_inf(home) if self._check_loss else None
            loss_finite = None if loss_inf is None else loss_inf == 0
            if loss_inf is not None:
                combined = torch.maximum(combined, loss_inf)
            if BACKEND.host(state):
                finite: Any = not bool(combined)  # host memory: a plain read, no device involved
            else:
                finite = combined == 0
            self._scaler = self._scaler._update(BACKEND, finite, loss_finite)
        self._per_optimizer_states.clear()
        if self._losses:
            self._losses = []

    def _set_scale(self, state: ScalerState, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            reason = (
                "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                "torch.FloatTensor with requires_grad=False."
            )
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError(reason)
        if isinstance(state.scale, torch.Tensor):
            value = (
                new_scale.to(state.scale)
                if isinstance(new_scale, torch.Tensor)
                else torch.full_like(state.scale, float(new_scale))
            )
            new_state = state._replace(scale=value.reshape(()).clone())
        else:
            value_f = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            new_state = state._replace(scale=float(torch.tensor(value_f, dtype=torch.float32)))
        self._scaler = Scaler(self._scaler.config, new_state, BACKEND)

    # -- getters and setters ------------------------------------------------------------------
    def get_scale(self) -> float:
        """The scale as a Python float (1.0 if disabled): an explicit host read."""
        if not self._enabled:
            return 1.0
        return self._scaler.get_scale()

    def get_growth_factor(self) -> float:
        return float(self._setting("growth_factor"))

    def set_growth_factor(self, new_factor: float) -> None:
        self._replace_setting("growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return float(self._setting("backoff_factor"))

    def set_backoff_factor(self, new_factor: float) -> None:
        self._replace_setting("backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        return int(self._setting("growth_interval"))

    def set_growth_interval(self, new_interval: int) -> None:
        self._replace_setting("growth_interval", new_interval)

    def _setting(self, name: str) -> Any:
        if self._enabled:
            return getattr(self.config, name)
        # torch keeps no settings when disabled: only what a setter stored since
        if name not in self._disabled_settings:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_{name}'")
        return self._disabled_settings[name]

    def _replace_setting(self, name: str, value: Any) -> None:
        if not self._enabled:  # as torch: stored, unchecked and unused
            self._disabled_settings[name] = value
            return
        try:
            self._scaler = self._scaler.replace(**{name: value})
        except ValueError as exc:
            raise SettingError(str(exc)) from None

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return int(self._values().growth_tracker)

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def _values(self) -> ScalerState:
        scaler = self._scaler
        if isinstance(scaler, _PendingScaler):
            return scaler._values
        if scaler._state is None:
            return initial_values(scaler.config)
        return BACKEND.read_state(scaler._state)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``{}`` when disabled), plus an ``"ampscale"`` entry when the
        settings use what torch lacks (another preset, hysteresis, a floor or ceiling, ...)."""
        if not self._enabled:
            return {}
        full = to_state_dict(self.config, self._values())
        torch_keys = {
            k: full[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        }
        if not _torch_compatible(self.config):
            torch_keys["ampscale"] = full["ampscale"]
        return torch_keys

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from this class, from ``torch.amp.GradScaler`` or from an ampscale scaler."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        config, values = from_state_dict(state_dict, self.config)
        current = self._scaler._state
        if current is None:
            self._scaler = _PendingScaler(config, values, BACKEND)
        else:
            like = current.scale if isinstance(current.scale, torch.Tensor) else None
            self._scaler = Scaler(config, BACKEND.make_state(values, config, like), BACKEND)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and len(self._per_optimizer_states) != 0:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after "
                "scaler.update()."
            )
        state = {k: v for k, v in self.__dict__.items() if k not in ("_per_optimizer_states", "_scaler", "_losses")}
        state["_saved"] = self.state_dict() if self._enabled else None
        state["_config"] = self.config if self._enabled else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved, config = state.pop("_saved"), state.pop("_config")
        self.__dict__.update(state)
        self._per_optimizer_states = weakref.WeakKeyDictionary()
        self._losses = []
        if config is not None:
            pending = _PendingScaler(config, initial_values(config), BACKEND)
            self._scaler = pending.load_state_dict(saved)

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        c = self.config
        return (
            f"GradScaler(device={self._device!r}, preset={c.preset!r}, scale={self.get_scale()!r}, "
            f"growth_factor={c.growth_factor}, backoff_factor={c.backoff_factor}, growth_interval={c.growth_interval})"
        )


def _torch_compatible(config: ScalerConfig) -> bool:
    """Whether torch's five keys describe ``config`` completely."""
    reference = make_config(
        "torch",
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )
    ignore = {"init_scale", "on_floor", "floor_patience"}
    ours, theirs = config.settings(), reference.settings()
    return config.preset == "torch" and all(ours[k] == theirs[k] for k in ours if k not in ignore)
