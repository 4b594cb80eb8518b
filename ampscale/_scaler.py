"""The immutable :class:`Scaler` and :func:`create_scaler`: the three patent interfaces.

Scaler layer: the public calls over config and state. Trees go down through the backend
registry, which flattens each once (:func:`ampscale.backends.flatten_tree`), and the adapters do
the work.

* creation: :func:`create_scaler` builds a scaler from construction parameters;
* scale: :meth:`Scaler.scale` multiplies the loss; :meth:`Scaler.unscale` (given the scaled loss)
  counts a scaled loss that overflowed as an overflow of the step;
* optimizer iteration: :meth:`Scaler.unscale` + :meth:`Scaler.update`, or the one-call
  :meth:`Scaler.step`, unscale the gradients, skip the update on overflow and adjust the scale.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from ampscale import _tree
from ampscale._after_import import when_imported
from ampscale._config import _SCALER_SETTING, _UNSET, FloorEvent, ScalerConfig, _Default, make_config
from ampscale._core import REASONS, ScalerState, initial_values
from ampscale._errors import AmpscaleWarning, ScaleAtFloorError, ScaleAtFloorWarning
from ampscale._in_place import check_before_the_step, checked_update, watch
from ampscale._ops import host_ops
from ampscale.backends import _base, backend_of, backend_of_leaves, flatten_tree, get_backend, probe_leaves
from ampscale.backends._base import WIDE_DTYPES, check_flag, check_loss, name_leaves, when_adapter_ready

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale.backends._base import Backend

__all__ = ["Scaler", "StepOutcome", "create_scaler"]

#: ScaleAtFloorErrors raised inside traced (jitted) steps, newest last (see ampscale.jax.floor_errors)
TRACED_FLOOR_ERRORS: collections.deque[ScaleAtFloorError] = collections.deque(maxlen=64)


class StepOutcome(NamedTuple):
    """What happened at the last step, as 0-d values on the scaler's device (no host sync).

    Read them with ``bool(...)``/``float(...)`` (a sync on GPUs), or gate other updates on
    ``applied`` without leaving the device, e.g. ``where(outcome.applied, new_ema, ema)``.

    Attributes:
        applied: whether the last step's update was applied.
        reason: 0 applied, 1 the scaled loss was not finite, 2 a gradient was not finite,
            -1 no step yet (see :meth:`reason_name`).
        scale_before: the scale the step ran with.
        scale_after: the scale for the next step.
        steps: steps so far.
        skipped_steps: steps skipped so far.
        loss_overflows: steps skipped because the scaled loss was not finite.
        grad_overflows: steps skipped because a gradient was not finite.
    """

    applied: Any
    reason: Any
    scale_before: Any
    scale_after: Any
    steps: Any
    skipped_steps: Any
    loss_overflows: Any
    grad_overflows: Any

    @staticmethod
    def reason_name(code: int) -> str:
        """``"applied"``, ``"loss"``, ``"gradients"`` or ``"no step yet"`` for a reason code."""
        return REASONS[int(code)]

    def to_dict(self) -> dict[str, Any]:
        """Host values (a sync on GPUs): Python bools, ints and floats, and the reason's name."""
        out: dict[str, Any] = {
            "applied": bool(self.applied),
            "reason": self.reason_name(int(self.reason)),
            "scale_before": float(self.scale_before),
            "scale_after": float(self.scale_after),
        }
        for name in ("steps", "skipped_steps", "loss_overflows", "grad_overflows"):
            out[name] = int(getattr(self, name))
        return out


class Scaler:
    """A loss scaler: static settings plus a :class:`~ampscale._core.ScalerState` of 0-d arrays.

    Immutable: :meth:`update`, :meth:`step` and :meth:`load_state_dict` return a new scaler.
    Create one with :func:`create_scaler`.

    Example:
        >>> import numpy as np, ampscale
        >>> scaler = ampscale.create_scaler(init_scale=1024.0, growth_interval=2)
        >>> loss = np.float32(0.5)
        >>> float(scaler.scale(loss))
        512.0
        >>> grads, finite = scaler.unscale([np.full(3, 1024.0, np.float32)])
        >>> grads[0], bool(finite)
        (array([1., 1., 1.], dtype=float32), True)
        >>> scaler = scaler.update(finite)
        >>> scaler.get_scale()
        1024.0
    """

    __slots__ = ("_backend", "_config", "_flags", "_scale_floor", "_state")
    #: ``(flag the latest unscale() returned, flag the update() that made this scaler consumed)``
    #: or ``None``: not part of the state, only to refuse an update() given one step's flag twice
    _flags: tuple[Any, Any] | None
    _config: ScalerConfig
    _state: Any  # a ScalerState, or a backend's packed form of one (see Backend.pack)
    _backend: Backend | None
    #: a lower bound of the scale known on the host, for a state on a device (None: unknown);
    #: it lets a backend whose kernel checks the inputs skip checking the unscaled values while
    #: the scale is at least 1 (see Backend.check_and_unscale_bounded). Not part of the state.
    _scale_floor: float | None

    def __init__(
        self, config: ScalerConfig, state: Any = None, backend: Backend | None = None, scale_floor: float | None = None
    ):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_scale_floor", scale_floor)
        _set_flags(self, None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Scaler is immutable; use update(), step() or replace() ({name!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        backend = None if self._backend is None else self._backend.name
        return (_restore, (self.config, self.state_dict(), backend))

    # -- properties -------------------------------------------------------------------------
    @property
    def config(self) -> ScalerConfig:
        """The static settings."""
        return self._config

    @property
    def state(self) -> ScalerState | None:
        """The dynamic state as 0-d values of the backend (``None`` until the backend is known)."""
        if self._state is None or self._backend is None:
            return None if self._state is None else ScalerState(*self._state)
        return self._backend.public_state(self._state, self._config)

    @property
    def backend(self) -> Backend | None:
        """The backend adapter (``None`` until detected from the first arrays seen)."""
        return self._backend

    @property
    def outcome(self) -> StepOutcome:
        """The last step's :class:`StepOutcome`, on device (no sync)."""
        state = self._state
        if state is None:
            values = initial_values(self._config)
            return StepOutcome(False, -1, values.scale, values.scale, 0, 0, 0, 0)
        backend = self._require_backend()
        host = backend.host(state)
        state = backend.public_state(state, self._config)
        applied = state.last_reason == 0
        if host:
            applied = backend.as_bool(bool(applied))
        return StepOutcome(
            applied,
            state.last_reason,
            state.last_scale,
            state.scale,
            state.steps,
            state.skipped_steps,
            state.loss_overflows,
            state.grad_overflows,
        )

    def __repr__(self) -> str:
        backend = "undetected" if self._backend is None else self._backend.name
        c = self._config
        return (
            f"Scaler(preset={c.preset!r}, mode={c.mode!r}, backend={backend}, "
            f"growth_interval={c.growth_interval}, growth_factor={c.growth_factor}, "
            f"backoff_factor={c.backoff_factor}, hysteresis={c.hysteresis})"
        )

    # -- internals --------------------------------------------------------------------------
    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the scaler's backend is not known yet")
        return self._backend

    def _backend_for(self, leaves: Any, what: str) -> Backend:
        """The backend for arrays the caller passed; must match the one holding the state."""
        own = self._backend
        if own is not None:
            return own
        found = backend_of_leaves(leaves, what)
        return found if found is not None else get_backend("numpy")

    def _state_on(self, backend: Backend, like: Any) -> Any:
        """The (backend-stored) state, created on ``like``'s device the first time it is needed."""
        state = self._state
        if state is None:
            return backend.make_state(initial_values(self._config), self._config, like)
        return state

    def _floor_hint(self) -> float | None:
        """A lower bound of the current scale known on the host (``None``: unknown)."""
        if self._state is None:
            return self._config.initial_scale
        return self._scale_floor

    def _next_floor_hint(self, floor: float | None) -> float | None:
        """The bound after one more update whose outcome the host does not know: one backoff."""
        if floor is None or not self._config.dynamic:
            return floor
        # shrink() is monotone and never above its argument, and growth never lowers the scale
        return float(host_ops(self._config).shrink(floor))

    # -- the scale interface ------------------------------------------------------------
    def scale(self, loss: Any) -> Any:
        """Multiply ``loss`` by the current scale (same array type and device as ``loss``).

        The result follows the framework's type promotion with a float32 scale (a float16 loss
        becomes float32, as with ``torch.amp.GradScaler`` and jmp). In ``guard`` mode the loss
        is returned unchanged. Pass the result to :meth:`unscale` as ``loss=`` (or to
        :meth:`step`) so that a scaled loss that overflowed counts as an overflow of the step.
        """
        check_loss(loss)
        if not self._config.scales:
            return loss
        backend = self._backend_for((loss,), "loss")
        backend.validate((loss,), None, "loss")
        state = self._state_on(backend, loss)
        return backend.multiply_by_scale(loss, backend.to_device_of(backend.scale_of(state), loss))

    # -- the optimizer-iteration interface --------------------------------------------------
    def unscale(
        self, grads: Any, loss: Any = None, *, axis_name: Any = _SCALER_SETTING, underflow: bool = False
    ) -> Any:
        """Unscale ``grads`` and check them (and the scaled ``loss``, if given) for inf/nan.

        Args:
            grads: a tree (list, tuple, dict, named tuple, nested; any pytree under JAX) of
                floating arrays; writable NumPy/CuPy/torch arrays are unscaled in place and
                returned.
            loss: the scaled loss from :meth:`scale`; if it is not finite the step counts as an
                overflow even when every gradient is finite.
            axis_name: devices or processes that must agree on the flag (a JAX axis name, a
                ``torch.distributed`` process group, a CuPy NCCL communicator, or a callable
                ``bool -> bool``); defaults to the scaler's ``axis_name`` setting.
            underflow: also return the fraction of (scaled) gradient values that are zero or
                subnormal in their dtype: a high fraction means the scale is too low. Counted in
                the same pass as the check by the NumPy kernel; off, it costs nothing.

        Returns:
            ``(grads, finite)``: the unscaled tree and a 0-d bool array on the gradients' device,
            false if the loss or any gradient held inf or nan; with ``underflow=True``,
            ``(grads, finite, underflow_fraction)``.
        """
        grads, finite, _loss_finite, _backend = self._unscale(grads, loss, axis_name, underflow)
        if underflow:
            grads, fraction = grads
            return grads, finite, fraction
        return grads, finite

    def _unscale(
        self,
        grads: Any,
        loss: Any,
        axis_name: Any,
        underflow: bool = False,
        *,
        flat: tuple[Backend, list[Any], Any] | None = None,
    ) -> tuple[Any, Any, Any, Backend]:
        """``(tree, finite, loss_finite, backend)``: ``finite`` covers the gradients and the loss.

        ``flat``: what :func:`~ampscale.backends.flatten_tree` returned for ``grads``, where the
        caller has it; otherwise the tree is flattened here (by the scaler's backend, once known).
        """
        config = self._config
        if flat is not None:
            backend, leaves, spec = flat
        elif self._backend is not None:
            backend = self._backend
            leaves, spec = backend.flatten(grads)  # (flatten_tree's own first line, one call less)
        else:
            backend, leaves, spec = flatten_tree(grads, also=loss)
        try:
            dtypes = backend.validate(leaves, spec)
            if not leaves:
                if _tree.holds_none(grads):
                    warnings.warn(
                        "every gradient in the tree is None (no array at all): was backward() not called, or "
                        "were the gradients cleared before unscale? The step counts as finite and updates nothing",
                        AmpscaleWarning,
                        stacklevel=3,
                    )
            elif not _base._HALF_KEPT_WARNED and dtypes is not None and not dtypes <= WIDE_DTYPES:
                backend.warn_if_half_kept(config, dtypes)
            if loss is not None:
                check_loss(loss)
                backend.validate((loss,), None, "loss")
            like = leaves[0] if leaves else loss
            state = self._state_on(backend, like)
            group = config.axis_name if isinstance(axis_name, _Default) else axis_name
            if group is None and not underflow and leaves and backend.packed_state:
                # CUDA: check, unscale and the state transition in one launch (or two on torch)
                fused = backend.fused_unscale(config, state, leaves, loss, self._floor_hint())
                if fused is not None:
                    new_leaves, finite, loss_finite = fused
                    finite = backend.own_flag(finite)
                    _set_flags(self, (finite, None))  # see update()
                    return backend.unflatten(spec, new_leaves), finite, loss_finite, backend
            inv = backend.inverse_of(state) if config.scales else None
            fraction = None
            count = underflow
            if config.grad_dtype == "promote" and leaves:
                if count:  # tiny values are counted in the gradients' own dtypes, before promotion
                    fraction = backend.check_unscale_and_count(leaves, None)[2]
                    count = False
                leaves = backend.promote(leaves)
            if not leaves:
                new_leaves, finite = leaves, backend.as_bool(True, like)
            elif count:
                new_leaves, finite, fraction = backend.check_unscale_and_count(leaves, inv)
            else:
                new_leaves, finite = backend.check_and_unscale_bounded(leaves, inv, self._floor_hint())
            loss_finite = None if loss is None else backend.all_finite([loss])
            if group is not None:  # one collective for both flags where the backend has them
                if loss_finite is None:
                    finite = backend.agree(finite, group)
                else:
                    finite, loss_finite = backend.agree_flags(finite, loss_finite, group)
            tree = backend.unflatten(spec, new_leaves)
            if underflow:
                tree = (tree, 0.0 if fraction is None else fraction)
            if loss_finite is not None:
                finite = backend.logical_and(finite, loss_finite)
            finite = backend.own_flag(finite)
            _set_flags(self, (finite, None))  # see update()
            return tree, finite, loss_finite, backend
        except Exception as exc:  # an error naming leaves by index: name them by path too
            name_leaves(exc, functools.partial(backend.leaf_paths, spec))  # (a closure would slow the call)
            raise

    def update(self, finite: Any, *, loss_finite: Any = None) -> Scaler:
        """Return the scaler for the next step, given whether this step was finite.

        Args:
            finite: 0-d bool (array or Python bool): false when the step overflowed.
            loss_finite: optional 0-d bool: false when the scaled loss itself overflowed. The
                step is then an overflow whatever ``finite`` says, and the outcome and counters
                record the reason (:meth:`step` passes it for you).

        Raises:
            ScaleAtFloorError: with ``on_floor="raise"``, when the step overflowed with the scale
                already at its floor (this scaler is left unchanged).
        """
        backend = self._backend
        if backend is None:
            backend = backend_of(finite) or get_backend("numpy")
        check_flag(finite, "finite")
        flags = self._flags
        if flags is not None and finite is flags[1]:
            raise ValueError(
                "update() was given the flag that the update() which made this scaler already counted (the "
                "same object, returned by the same unscale()): that step would count twice (two steps, a "
                "second backoff or an early growth). Call unscale() (or step()) once per step, and update() "
                "once with its flag; this scaler is unchanged"
            )
        if loss_finite is not None:
            check_flag(loss_finite, "loss_finite")
        return self._update(backend, finite, loss_finite)

    def _update(self, backend: Backend, finite: Any, loss_finite: Any) -> Scaler:
        config = self._config
        state = self._state_on(backend, finite)
        ops = backend.ops(config, state)
        if backend.host(state):
            values = backend.read_state(state)
            loss_ok = True if loss_finite is None else bool(loss_finite)
            new_values, floor_event = ops.run(values, bool(finite), loss_ok)  # type: ignore[union-attr]
            if floor_event and config.on_floor != "ignore":
                self._react_to_floor(new_values)
            new_state = backend.make_state(new_values, config, state.scale, (state, values))
            nxt = Scaler(config, new_state, backend)
            flags = self._flags
            if flags is not None and finite is flags[0]:  # (unscale never returns a Python bool)
                _set_flags(nxt, (None, finite))  # see update()
            return nxt
        new_state, new_fields, floor_event = backend.run_transition(config, state, finite, loss_finite, ops)
        if config.on_floor != "ignore":
            if backend.is_tracing(floor_event):
                assert new_fields is not None
                backend.host_callback(  # type: ignore[attr-defined]
                    self._react_to_floor_traced, floor_event, *new_fields, setting=f"on_floor={config.on_floor!r}"
                )
            elif bool(floor_event):  # an explicit, documented host read
                self._react_to_floor(backend.read_state(new_state))
        nxt = Scaler(config, new_state, backend, self._next_floor_hint(self._floor_hint()))
        flags = self._flags
        if flags is not None and finite is flags[0]:  # (unscale never returns a Python bool)
            _set_flags(nxt, (None, finite))  # see update()
        return nxt

    def _react_to_floor_traced(self, floor_event: Any, *values: Any) -> None:
        if bool(floor_event):
            try:
                self._react_to_floor(ScalerState(*(v.item() for v in values)))
            except ScaleAtFloorError as exc:
                # JAX reports it as its own runtime error; ampscale.jax.floor_errors() finds the
                # original here and raises it in its place
                TRACED_FLOOR_ERRORS.append(exc)
                raise

    def _react_to_floor(self, values: ScalerState) -> None:
        config = self._config
        consecutive = int(values.floor_overflows)
        if consecutive < config.floor_patience:
            return
        event = FloorEvent(
            scale=float(values.last_scale),
            consecutive=consecutive,
            step=int(values.steps) - 1,
            reason=REASONS[int(values.last_reason)],
        )
        reaction = config.on_floor
        if callable(reaction):
            reaction(event)
            return
        message = (
            f"loss scale already at its floor ({event.scale!r}) and step {event.step} overflowed "
            f"again ({consecutive} in a row, cause: non-finite {event.reason}); lowering the "
            "scale cannot help: look for inf/nan produced by the forward pass (ampscale.diagnose), "
            "or train in bfloat16"
        )
        if reaction == "raise":
            raise ScaleAtFloorError(message, scale=event.scale, consecutive=consecutive, step=event.step)
        # warn at the first event, then at 2x, 4x, ... patience so overflow storms stay readable
        excess = consecutive // config.floor_patience
        if excess & (excess - 1) == 0:
            warnings.warn(message, ScaleAtFloorWarning, stacklevel=4)

    def step(
        self,
        update_fn: Callable[..., tuple[Any, Any]],
        params: Any,
        grads: Any,
        opt_state: Any,
        *,
        loss: Any = None,
        axis_name: Any = _SCALER_SETTING,
        in_place: bool = False,
    ) -> tuple[Any, Any, Scaler]:
        """One optimizer iteration: unscale, check, apply ``update_fn`` unless overflowed, update.

        Args:
            update_fn: ``(params, grads, opt_state) -> (params, opt_state)``, e.g. one SGD or Adam
                step, functional: it returns new arrays and writes none it was given. On backends
                whose flag lives on a device (JAX, CuPy, torch on a GPU) it is evaluated on every
                step and its result discarded leaf by leaf on overflow; on host backends it is
                not called at all on overflow. Where arrays can be written (NumPy, CuPy, torch,
                array-API namespaces) a new ``update_fn`` is first run once on copies of
                ``params``, ``opt_state`` and the (still scaled) ``grads``, and one that writes
                into the copies of ``params`` or ``opt_state`` (or, on backends that cannot watch
                writes: CuPy, returns them) raises :class:`InPlaceUpdateError` before anything
                changes. That first run is one more call (side effects outside its arguments
                happen twice then), a copy of the three trees, and on CuPy one host read; its
                verdict is kept for the function's code, closure cells and bound instance, so a
                function made once is checked once (see :mod:`ampscale._in_place` for what is
                and is not seen). Every real call is watched too (a write found there has
                happened on the device path). With ``in_place=True``: ``(params, grads,
                opt_state, finite) -> (params, opt_state)``, an update in place that applies
                itself only where the 0-d flag ``finite`` is true, with :func:`masked_add_` and
                :func:`masked_copy_` (as torch's fused optimizers take ``found_inf``): no host
                sync, no check on copies, and on host backends not called on overflow.
            params: a tree of arrays, the parameters.
            grads: a tree of arrays, the (still scaled) gradients.
            opt_state: a tree of arrays, the optimizer state.
            loss: the scaled loss, so that its overflow skips the step too.
            axis_name: see :meth:`unscale`.
            in_place: ``update_fn`` writes in place and takes the flag (above). Not for JAX,
                whose arrays cannot be written.

        Returns:
            ``(params, opt_state, scaler)``: on an overflowing step ``params`` and ``opt_state``
            are the inputs, bitwise, and the returned scaler has backed off.

        Raises:
            InPlaceUpdateError: ``update_fn`` wrote into the arrays it was given (or returned
                them, where writes cannot be watched); found on its first run, on copies,
                nothing has changed; the scaler is never updated.
            TypeError: ``in_place`` is not a bool, or ``in_place=True`` on JAX.
            Exception: whatever ``update_fn`` raises, with a note (Python 3.11+) saying what
                state things are in: raised on its first run, on copies, nothing has changed;
                raised on a real call, writable gradients were already unscaled in place and
                stay so (they cannot be restored exactly). The scaler is not updated.
        """
        if not isinstance(in_place, bool):
            raise TypeError(f"in_place must be True or False; got {in_place!r}")
        # every tree is flattened once: the gradients here, params and opt_state when first needed
        backend = self._backend
        if backend is None:
            backend, leaves, spec = flatten_tree(grads, also=loss)
        else:
            leaves, spec = backend.flatten(grads)  # (flatten_tree's own first line, one call less)
        if in_place and not backend.mutable_arrays:
            raise TypeError(
                f"in_place=True writes into the parameters, which {backend.name} arrays do not allow: "
                "use a functional update_fn (in_place=False)"
            )
        watched = None
        if not in_place and backend.mutable_arrays:
            # a new update_fn runs once on copies first: one written in place is refused before
            # anything changes (its first real call, on a device, would write an overflowed step)
            watched = check_before_the_step(update_fn, backend, params, grads, opt_state, (leaves, spec))
        grads, finite, loss_finite, backend = self._unscale(grads, loss, axis_name, flat=(backend, leaves, spec))
        try:
            if in_place:
                new_params, new_opt_state = backend.apply_in_place(finite, update_fn, params, grads, opt_state)
            elif not backend.mutable_arrays:  # JAX arrays cannot be written: nothing to watch
                new_params, new_opt_state = backend.apply_if(finite, update_fn, params, grads, opt_state)
            else:
                # params and opt_state flattened once (after the unscale: torch's validation of
                # the gradients reuses what their flatten learnt), for the watch and the select
                if watched is None:
                    watched = watch(backend, params, opt_state)
                checked = checked_update(update_fn, backend, params, opt_state, watched)
                new_params, new_opt_state = backend.apply_if(finite, checked, params, grads, opt_state, flat=watched[1])
        except Exception as exc:
            _note_unscaled(exc, backend)
            raise
        return new_params, new_opt_state, self._update(backend, finite, loss_finite)

    # -- host reads ---------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float: an explicit host read (a sync on GPUs).

        Raises:
            TypeError: under a trace (``jax.jit``, ``pmap``, ``scan``), where no value can be
                read on the host: use ``scaler.state.scale`` there, a traced 0-d array.
        """
        if self._state is None or self._backend is None:
            return self._config.initial_scale
        scale = self._backend.scale_of(self._state)
        if self._backend.is_tracing(scale):
            raise TypeError(
                "get_scale() reads the scale on the host, which is impossible under a trace "
                "(jax.jit, pmap, scan, vmap); inside the trace use scaler.state.scale, a 0-d array "
                "(log it by returning it from the traced function)"
            )
        value = float(scale)
        if not self._backend.host(self._state):
            object.__setattr__(self, "_scale_floor", value)  # a read is exact: refresh the hint
        return value

    def get_stats(self) -> dict[str, Any]:
        """The counters as plain Python values, for logging (a host read, like ``get_scale``).

        Keys: ``steps``, ``applied_steps``, ``skipped_steps``, ``skip_rate``, ``loss_overflows``,
        ``grad_overflows``, ``growths``, ``backoffs``, ``floor_overflows`` (overflows in a row at
        the floor), ``scale``, ``initial_scale``, ``scale_change`` (scale / initial scale),
        ``growth_tracker``, ``hysteresis_tracker`` and ``last_step`` (``"applied"``, ``"loss"``,
        ``"gradients"`` or ``"no step yet"``).
        """
        values = self._host_values()
        steps, skipped = int(values.steps), int(values.skipped_steps)
        initial = self._config.initial_scale
        return {
            "steps": steps,
            "applied_steps": steps - skipped,
            "skipped_steps": skipped,
            "skip_rate": skipped / steps if steps else 0.0,
            "loss_overflows": int(values.loss_overflows),
            "grad_overflows": int(values.grad_overflows),
            "growths": int(values.growths),
            "backoffs": int(values.backoffs),
            "floor_overflows": int(values.floor_overflows),
            "scale": float(values.scale),
            "initial_scale": initial,
            "scale_change": float(values.scale) / initial if initial else float("nan"),
            "growth_tracker": int(values.growth_tracker),
            "hysteresis_tracker": int(values.hysteresis_tracker),
            "last_step": REASONS[int(values.last_reason)],
        }

    def _host_values(self) -> ScalerState:
        if self._state is None or self._backend is None:
            return initial_values(self._config)
        values = self._backend.read_state(self._state)
        if not self._backend.host(self._state):
            object.__setattr__(self, "_scale_floor", float(values.scale))  # refresh the hint
        return values

    def replace(self, **settings: Any) -> Scaler:
        """A scaler with some settings changed and the same state (settings are validated)."""
        return Scaler(self._config.replace(**settings), self._state, self._backend, self._scale_floor)

    def state_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable, versioned dict of the settings and state (a host read).

        It holds ``torch.amp.GradScaler``'s five keys at the top level, so
        ``torch.amp.GradScaler`` can load it, and everything else under ``"ampscale"``: the
        format ``version`` (``ampscale.FORMAT_VERSION``), the ``preset``, every setting and
        every state field.
        """
        from ampscale._state_dict import to_state_dict

        return to_state_dict(self._config, self._host_values())

    def load_state_dict(self, state_dict: dict[str, Any]) -> Scaler:
        """Return a scaler with the settings and state of ``state_dict`` (this one is unchanged).

        Accepts dicts from :meth:`state_dict` (any backend, any version up to the current one)
        and from ``torch.amp.GradScaler.state_dict()``. Like torch, loading replaces the
        growth/backoff settings with the saved ones.

        Raises:
            StateDictError: missing or ill-typed keys, or a newer format version.
        """
        from ampscale._state_dict import from_state_dict

        config, values = from_state_dict(state_dict, self._config)
        backend = self._backend
        if self._state is None and (backend is None or backend.lazy_state):
            # No device yet: the state is placed by the first arrays the scaler sees.
            return _PendingScaler(config, values, backend)
        assert backend is not None
        like = None if self._state is None else backend.scale_of(self._state)
        return Scaler(config, backend.make_state(values, config, like), backend, float(values.scale))


#: ``ampscale.fp8._combined`` finds a tree's backend with this name (``flatten_tree`` does it
#: with one flatten: the way to go there too)
_probe_leaves = probe_leaves

#: sets the ``_flags`` slot directly (the slot's own setter: cheaper than object.__setattr__)
_set_flags: Callable[[Any, Any], None] = Scaler.__dict__["_flags"].__set__


def _note_unscaled(exc: BaseException, backend: Backend) -> None:
    """Tell the user of an exception from ``update_fn`` what state the gradients are in.

    Restoring them exactly is impossible in general (``x / s * s`` is not always ``x``, and a
    copy would cost memory on every step), so the exception says it (``add_note``; Python 3.10
    has none, and the docs say it there).
    """
    if backend.in_place:
        note = (
            "ampscale: update_fn raised inside Scaler.step(); the gradients had already been unscaled "
            "in place (multiplied by 1/scale) and stay so; the scaler was not updated. Do not unscale "
            "them again."
        )
    else:
        note = (
            "ampscale: update_fn raised inside Scaler.step(); the gradients passed in are unchanged "
            "(unscaled copies were made) and the scaler was not updated."
        )
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)


class _PendingScaler(Scaler):
    """A scaler loaded from a state dict before its backend is known (state kept on the host)."""

    __slots__ = ("_values",)
    _values: ScalerState

    def __init__(self, config: ScalerConfig, values: ScalerState, backend: Backend | None = None) -> None:
        super().__init__(config, None, backend)
        object.__setattr__(self, "_values", values)

    def _state_on(self, backend: Backend, like: Any) -> Any:
        return backend.make_state(self._values, self._config, like)

    def get_scale(self) -> float:
        return float(self._values.scale)

    def _floor_hint(self) -> float | None:
        return float(self._values.scale)

    def _host_values(self) -> ScalerState:
        return self._values

    def state_dict(self) -> dict[str, Any]:
        from ampscale._state_dict import to_state_dict

        return to_state_dict(self._config, self._values)

    def replace(self, **settings: Any) -> Scaler:
        return _PendingScaler(self._config.replace(**settings), self._values, self._backend)

    def load_state_dict(self, state_dict: dict[str, Any]) -> Scaler:
        from ampscale._state_dict import from_state_dict

        config, values = from_state_dict(state_dict, self._config)
        return _PendingScaler(config, values, self._backend)

    @property
    def outcome(self) -> StepOutcome:
        v = self._values
        return StepOutcome(
            v.last_reason == 0,
            v.last_reason,
            v.last_scale,
            v.scale,
            v.steps,
            v.skipped_steps,
            v.loss_overflows,
            v.grad_overflows,
        )


def _restore(config: ScalerConfig, state_dict: dict[str, Any] | None, backend: str | None) -> Scaler:
    scaler = Scaler(config, None, None if backend is None else get_backend(backend))
    if state_dict is None:
        return scaler
    return scaler.load_state_dict(state_dict)


def create_scaler(
    backend: Any = None,
    preset: str = "torch",
    *,
    mode: str = _UNSET,  # type: ignore[assignment]
    init_scale: float = _UNSET,  # type: ignore[assignment]
    growth_factor: float = _UNSET,  # type: ignore[assignment]
    backoff_factor: float = _UNSET,  # type: ignore[assignment]
    growth_interval: int = _UNSET,  # type: ignore[assignment]
    hysteresis: int = _UNSET,  # type: ignore[assignment]
    min_scale: float | None = _UNSET,  # type: ignore[assignment]
    max_scale: float | None = _UNSET,  # type: ignore[assignment]
    on_floor: Any = _UNSET,
    floor_patience: int = _UNSET,  # type: ignore[assignment]
    axis_name: Any = _UNSET,
    **rules: Any,
) -> Scaler:
    """Create a loss scaler (the patent's *creation* interface).

    Every setting left out takes ``preset``'s own default; settings given are read in that
    system's own terms (flax's ``growth_interval`` grows on the N+1-th finite step, Paddle's
    ``hysteresis`` is ``decr_every_n_nan_or_inf``, ...).

    Args:
        backend: ``"numpy"``, ``"cupy"``, ``"jax"``, ``"torch"``, an array-API namespace, or
            ``None`` to detect it from the first arrays the scaler sees.
        preset: whose exact policy to reproduce: ``"torch"`` (default), ``"jmp"``, ``"flax"``,
            ``"keras"``, ``"megatron"``, ``"deepspeed"``, ``"apex"``, ``"paddle"``,
            ``"mindspore"``, ``"tf_keras"``.
        mode: ``"dynamic"`` (default), ``"static"`` (fixed scale, still skips non-finite
            steps) or ``"guard"`` (bf16: no scaling at all, only skips non-finite steps).
        init_scale: initial scale (finite, > 0).
        growth_factor: factor applied after ``growth_interval`` finite steps (> 1).
        backoff_factor: factor applied on overflow, in (0, 1).
        growth_interval: finite steps between growths (>= 1).
        hysteresis: overflows tolerated before a backoff (>= 1; 1 = back off on every one).
        min_scale: floor of the scale (``None``: none).
        max_scale: ceiling of the scale (``None``: only the float range).
        on_floor: what to do when a step overflows with the scale already at its floor:
            ``"ignore"``, ``"warn"``, ``"raise"`` (:class:`ScaleAtFloorError`) or a callable
            taking a :class:`FloorEvent`. Reactions other than ``"ignore"`` read one flag from
            the device at each ``update`` (a sync on GPUs).
        floor_patience: overflows in a row at the floor before ``on_floor`` reacts.
        axis_name: default group for agreement across devices (see :meth:`Scaler.unscale`).
        **rules: the orthogonal rule settings ``counter_rule``, ``interval_offset``,
            ``first_growth_delay``, ``hysteresis_mode``, ``backoff_rule``, ``ceiling``,
            ``scale_dtype``, ``factor_precision`` (see ``docs/presets.md``), and
            ``grad_dtype``: ``"keep"`` (default: each gradient is unscaled in its own dtype)
            or ``"promote"`` (float16 and bfloat16 gradients come back as float32, as jmp's
            ``unscale`` returns them).

    Raises:
        ValueError: a setting is out of its accepted range (the message names it and the range),
            or the preset or backend is unknown.
    """
    config = make_config(
        preset,
        mode=mode,
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        on_floor=on_floor,
        floor_patience=floor_patience,
        axis_name=axis_name,
        **rules,
    )
    resolved = None if backend is None else get_backend(backend)
    if resolved is None:
        return Scaler(config)  # a pytree for JAX whenever JAX is imported (_register_with_jax)
    state = None if resolved.lazy_state else resolved.make_state(initial_values(config), config)
    return Scaler(config, state, resolved, config.initial_scale)


def _register_with_jax(jax: Any) -> None:
    """Make :class:`Scaler` a JAX pytree (called as soon as JAX is imported, before or after
    ampscale), so that a scaler created before ``import jax`` passes through ``jax.jit``."""
    try:
        get_backend("jax")  # the adapter registers the Scaler classes with jax.tree_util
    except Exception:  # a JAX the adapter cannot use: its first use will say why
        return


when_adapter_ready(lambda backend: backend.adopt_scaler(Scaler, _PendingScaler))
when_imported("jax", _register_with_jax)
