"""JAX helpers: drop-ins for flax's ``DynamicScale`` and for jmp, ``value_and_grad``, and an optax wrapper.

Framework helpers' layer, over the scaler and the JAX adapter; jmp's classes live in
:mod:`ampscale._jmp` and are public here.

The scaler itself (``ampscale.create_scaler(backend="jax")``) is a pytree: pass it through
``jax.jit``, ``lax.scan`` or ``shard_map`` like any other state. Four conveniences build on it:

* :class:`DynamicScale` takes ``flax.training.dynamic_scale.DynamicScale``'s arguments and gives
  its results bit for bit (float32 gradients divided by the scale, averaged over ``axis_name``,
  the scale updated inside ``value_and_grad``), with flax's pytree leaves (``fin_steps``,
  ``scale``): a flax program ports by changing the import, and its checkpoints restore.
* jmp's loss scales (:class:`DynamicLossScale`, :class:`StaticLossScale`,
  :class:`NoOpLossScale`, :func:`all_finite`, :func:`select_tree`), with jmp's fields, pytree
  leaves, warnings and dtypes, driven by the ``jmp`` preset; jmp's policies are forwarded, so
  ``import ampscale.jax as jmp`` ports a jmp program.
* :func:`value_and_grad` scales the loss, differentiates, unscales the gradients and checks
  them and the scaled loss, in one call (the patent's scale and optimizer-iteration interfaces
  for JAX). It does not update the scaler: pass its ``finite`` to ``scaler.update``.
* :func:`loss_scaled` wraps any ``optax.GradientTransformation``: it unscales the incoming
  (scaled) gradients, skips non-finite steps (the inner optimizer state is left untouched, so
  its step count does not advance, and the returned updates leave the parameters bitwise
  unchanged), and carries the scaler in its state (:func:`scaler_of` finds it).

Example:
    >>> import jax, jax.numpy as jnp, optax, ampscale
    >>> import ampscale.jax as ajax
    >>> params = {"w": jnp.ones(3)}
    >>> opt = ajax.loss_scaled(optax.sgd(0.1), ampscale.create_scaler(backend="jax", init_scale=1024.0))
    >>> state = opt.init(params)
    >>> def loss_fn(p):
    ...     return jnp.sum(p["w"] ** 2)
    >>> @jax.jit
    ... def train_step(params, state):
    ...     scaler = ajax.scaler_of(state)
    ...     grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(params)
    ...     updates, state = opt.update(grads, state, params)
    ...     return optax.apply_updates(params, updates), state
    >>> params, state = train_step(params, state)
    >>> params["w"]
    Array([0.8, 0.8, 0.8], dtype=float32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ampscale._info import missing_framework

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
except ModuleNotFoundError as exc:  # say what to install, not only what is missing
    raise missing_framework(__name__, exc) from exc

from ampscale._after_import import when_imported
from ampscale._config import _UNSET, INT32_MAX, INT32_MIN, _round_to, as_float, make_config, shown
from ampscale._core import INT_FIELDS, ScalerState, initial_values
from ampscale._errors import ScaleAtFloorError
from ampscale._jmp import (
    _JMP_POLICY_NAMES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    _aval,
    _is_jax,
    _typed,
    all_finite,
    select_tree,
)
from ampscale._scaler import TRACED_FLOOR_ERRORS, Scaler
from ampscale.backends.jax import BACKEND, restore_fields

__all__ = [
    "DynamicLossScale",
    "DynamicScale",
    "DynamicScaleResult",
    "LossScale",
    "LossScaleState",
    "NoOpLossScale",
    "ScaledGrad",
    "StaticLossScale",
    "all_finite",
    "floor_errors",
    "loss_scaled",
    "scaler_of",
    "select_tree",
    "value_and_grad",
]


# the public home of jmp's classes and functions (reprs, pickles, the API reference)
for _public in (DynamicLossScale, NoOpLossScale, StaticLossScale, all_finite, select_tree):
    _public.__module__ = __name__
del _public


class ScaledGrad(NamedTuple):
    """The result of a function made by :func:`value_and_grad`.

    Attributes:
        loss: the (unscaled) value of the function, as ``fun`` returned it.
        aux: its auxiliary output (``None`` without ``has_aux``).
        grads: the gradients, unscaled (each in its own dtype, or float32 for float16 and
            bfloat16 ones with the scaler's ``grad_dtype="promote"``), averaged over
            ``axis_name`` when one is given.
        finite: 0-d bool, false if the scaled loss or any gradient was not finite.
        loss_finite: 0-d bool, false if the scaled loss was not finite.
    """

    loss: Any
    aux: Any
    grads: Any
    finite: Any
    loss_finite: Any


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: Any = _UNSET,
    *,
    agree_axes: Any = None,
) -> Callable[..., ScaledGrad]:
    """``jax.value_and_grad`` with loss scaling: ``fn(scaler, *args) -> ScaledGrad``.

    The returned function multiplies ``fun``'s value by ``scaler``'s scale before
    differentiating, unscales the gradients in their own dtypes and checks them (and the
    scaled loss) for inf/nan. Update the scaler with the result::

        grad_fn = ampscale.jax.value_and_grad(loss_fn)
        out = grad_fn(scaler, params, batch)
        params = jax.tree.map(lambda p, g: p - lr * g, params, out.grads)   # or skip
        scaler = scaler.update(out.finite, loss_finite=out.loss_finite)

    Args:
        fun: the loss function; its first output is the loss.
        argnums: which positional arguments (after ``scaler``) to differentiate.
        has_aux: whether ``fun`` returns ``(loss, aux)``.
        axis_name: a mapped axis (``pmap``/``shard_map``) to average the gradients over, as
            flax's ``DynamicScale.value_and_grad`` does: the unscaled gradients are replaced by
            their ``lax.pmean`` and checked after it, and the scaled loss's flag is agreed, so
            every device gets the same gradients and flags. The scaled loss's flag travels
            in the gradients' own all-reduce (no second collective), and under ``shard_map``
            on a mesh with more axes (data x model) the flags are also agreed over every axis
            the averaged gradients still vary over (their model shards), in one more
            reduction, so devices holding different shards never skip different steps. (For
            flax's float32 arithmetic, bit for bit, use :class:`DynamicScale`.) ``None``: no
            averaging and no agreement. Left out, the gradients are not averaged and the
            flags are agreed over the scaler's own ``axis_name`` setting, if it has one (as
            :meth:`Scaler.unscale`: one ``pmin`` for both flags).
        agree_axes: mesh axes to agree on the flags over as well (a name or a tuple): for
            ``shard_map(..., check_vma=False)``, where JAX does not record which axes a value
            varies over, name the model axes here.
    """

    def scaled(scaler: Scaler, *args: Any) -> tuple[Any, tuple[Any, Any, Any]]:
        out = fun(*args)
        loss, aux = out if has_aux else (out, None)
        scaled_loss = scaler.scale(loss)
        return scaled_loss, (loss, aux, scaled_loss)

    grad_fn = jax.grad(scaled, argnums=_shift(argnums), has_aux=True)

    def wrapped(scaler: Scaler, *args: Any) -> ScaledGrad:
        grads, (loss, aux, scaled_loss) = grad_fn(scaler, *args)
        if axis_name is _UNSET or axis_name is None:
            grads, grads_finite, loss_finite, backend = scaler._unscale(grads, scaled_loss, axis_name)
            if agree_axes is not None:
                grads_finite, loss_finite = _agree_over_varying(grads_finite, loss_finite, agree_axes)
        else:
            # Averaged first, then checked: a non-finite gradient on any device makes the mean
            # non-finite on all of them, and so does a sum that overflows. The loss's flag
            # travels in the same all-reduce; what still varies (model shards) is agreed after.
            grads, _, loss_finite, backend = scaler._unscale(grads, scaled_loss, None)
            grads, loss_finite = _average(grads, loss_finite, axis_name)
            grads_finite = _all_finite(grads)
            grads_finite, loss_finite = _agree_over_varying(grads_finite, loss_finite, agree_axes)
        finite = backend.logical_and(grads_finite, loss_finite)
        return ScaledGrad(loss, aux, grads, finite, loss_finite)

    return wrapped


def _shift(argnums: int | Sequence[int]) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums + 1
    return tuple(a + 1 for a in argnums)


def _all_finite(tree: Any) -> Any:
    return BACKEND.all_finite(jax.tree_util.tree_leaves(tree))


def _average(grads: Any, loss_finite: Any, axis_name: Any) -> tuple[Any, Any]:
    """``lax.pmean(grads, axis_name)``, and the scaled loss's flag agreed in the same all-reduce.

    The flag travels as one more operand of the gradients' reduction: 0 where the loss was
    finite, nan where not (in the first gradient's dtype, so that XLA keeps it in the same
    all-reduce), and the mean is nan if any device's loss overflowed. So the step costs the
    gradients' one all-reduce, not a second one for the flag.
    """
    if axis_name is None:
        return grads, loss_finite
    if loss_finite is None:
        return jax.lax.pmean(grads, axis_name), None
    leaves = [x for x in jax.tree_util.tree_leaves(grads) if jnp.issubdtype(x.dtype, jnp.floating)]
    dtype = leaves[0].dtype if leaves else jnp.float32
    marker = jnp.where(loss_finite, jnp.zeros((), dtype), jnp.full((), jnp.nan, dtype))
    grads, marker = jax.lax.pmean((grads, marker), axis_name)
    return grads, jnp.logical_not(jnp.isnan(marker))


def _agree_over_varying(grads_finite: Any, loss_finite: Any, agree_axes: Any) -> tuple[Any, Any]:
    """The two flags agreed over every mesh axis they still vary over (the model axis of a data
    x model mesh, after the gradients were averaged over data) and over ``agree_axes``: one
    ``pmin`` of both, and none at all where they vary over no axis (a 1-D mesh, ``pmap``)."""
    group = () if agree_axes is None else agree_axes  # () still agrees over the varying axes
    if loss_finite is None:
        return (
            BACKEND.agree(grads_finite, group) if _needs_agreement(grads_finite, agree_axes) else grads_finite
        ), None
    if not (_needs_agreement(grads_finite, agree_axes) or _needs_agreement(loss_finite, agree_axes)):
        return grads_finite, loss_finite
    return BACKEND.agree_flags(grads_finite, loss_finite, group)  # type: ignore[no-any-return]


def _needs_agreement(flag: Any, agree_axes: Any) -> bool:
    from ampscale.backends.jax import axis_names, varying_axes

    return bool(varying_axes(flag)) or bool(axis_names(agree_axes))


# -- flax's DynamicScale ------------------------------------------------------------------------


class DynamicScaleResult(NamedTuple):
    """What a function made by :meth:`DynamicScale.value_and_grad` returns (flax's fields).

    Attributes:
        dynamic_scale: the :class:`DynamicScale` for the next step (already updated).
        finite: 0-d bool: false when a gradient (after the averaging over ``axis_name``) or,
            with ``check_loss``, the scaled loss was not finite; skip the step then.
        aux: the loss (the scaled loss divided by the scale), or with ``has_aux``
            ``(loss, aux)``.
        grad: the gradients, as float32, divided by the scale (and averaged over
            ``axis_name``).
    """

    dynamic_scale: DynamicScale
    finite: Any
    aux: Any
    grad: Any


_FLAX_NAMES = ("growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale", "minimum_scale")
#: flax's default floor, as flax writes it (``jnp.finfo(jnp.float32).tiny``, a NumPy float32)
_FLAX_TINY = np.finfo(np.float32).tiny
#: settings whose state would need more than flax's two leaves
_STATEFUL = {"hysteresis": 1, "floor_patience": 1}


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class DynamicScale:
    """``flax.training.dynamic_scale.DynamicScale``, driven by an ampscale scaler (``preset="flax"``).

    Same arguments, same defaults, same dataclass (flax's six fields, in flax's order, compared
    by ``==`` as flax's are; ``dataclasses.replace`` and ``.replace()``; flax's ``repr``), same
    pytree (its leaves are flax's, ``fin_steps`` and ``scale``, in that order and with those
    names, so a flax checkpoint restores into it and back: orbax, ``flax.training.checkpoints``
    and ``flax.serialization``), the same use (a field of a flax ``TrainState``, replicated for
    ``pmap``, passed through ``jit``, ``scan`` and ``shard_map``), the same
    :meth:`value_and_grad`, the same results bit for bit: the trajectory of :attr:`scale`, the
    flag, the loss and the float32 gradients. Port a flax program by changing the import::

        # from flax.training.dynamic_scale import DynamicScale
        from ampscale.jax import DynamicScale

    What ampscale adds, all opt-in or where flax's fails: ``check_loss=True`` checks the scaled
    loss too; with ``axis_name`` on a mesh with more axes (data x model) the flag is agreed
    over every axis the gradients vary over (flax's devices skip different steps there), and
    ``agree_axes`` names more; the settings are validated (a ``ValueError`` names the
    argument); ``on_floor=`` and ``max_scale=`` are accepted; :attr:`scaler` gives the state as
    an ampscale scaler (``state_dict()``).

    Args:
        growth_factor: the scale is multiplied by it after ``growth_interval + 1`` finite steps
            in a row (flax's count; > 1).
        backoff_factor: the scale is multiplied by it on a non-finite step (in (0, 1)).
        growth_interval: see ``growth_factor`` (>= 0).
        fin_steps: finite steps already counted (flax's ``fin_steps``).
        scale: the current scale (finite, > 0). A Python number stays one until the first
            step, as in flax, so the first scaled loss follows JAX's weak typing exactly.
        minimum_scale: the floor of the backoff (``None``: no floor).
        check_loss: a scaled loss that is not finite also makes the step non-finite. Off by
            default, as in flax, where only the gradients decide; the two differ only on a step
            whose scaled loss overflows while every gradient stays finite.
        settings: other ``ampscale.create_scaler`` settings whose state fits in flax's two
            leaves (``on_floor``, ``max_scale``, ...), as keyword arguments (or, as
            ``dataclasses.replace`` passes them, this field's own value). ``hysteresis`` and
            ``floor_patience`` need counters of their own: use ``create_scaler(preset="flax",
            ...)`` for them.

    Raises:
        ValueError: an argument is outside its accepted range (the message names it).
        TypeError: an unknown setting, or one that needs more state than flax's.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from ampscale.jax import DynamicScale
        >>> ds = DynamicScale(growth_interval=1, scale=1024.0)
        >>> step = jax.jit(lambda ds, w: ds.value_and_grad(lambda w: jnp.sum(w * w))(w))
        >>> ds, is_fin, loss, grad = step(ds, jnp.ones(2))
        >>> bool(is_fin), float(loss), grad.tolist(), float(ds.scale)
        (True, 2.0, [2.0, 2.0], 1024.0)
        >>> ds, is_fin, loss, grad = step(ds, jnp.ones(2))
        >>> float(ds.scale)
        2048.0
        >>> DynamicScale() == DynamicScale()
        True
    """

    # flax's fields, defaults and order; static ones are in the pytree's structure, the other
    # two are its leaves (see _register_dynamic_scale)
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = _FLAX_TINY
    # ampscale's: keyword-only, after flax's
    check_loss: bool = dataclasses.field(default=False, kw_only=True)
    settings: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), kw_only=True)
    if TYPE_CHECKING:  # not a field: the ampscale settings made from the fields, set by _set
        _config: ClassVar[Any]  # per instance in truth; ClassVar keeps it out of the fields

    def __init__(
        self,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        fin_steps: Any = 0,
        scale: Any = 65536.0,
        minimum_scale: float | None = _FLAX_TINY,
        *,
        check_loss: bool = False,
        settings: Any = (),
        **more_settings: Any,
    ) -> None:
        merged = dict(settings.items() if isinstance(settings, Mapping) else settings)
        merged.update(more_settings)
        reserved = sorted(set(merged) & {"init_scale", "min_scale", "preset", "axis_name", "grad_dtype"})
        if reserved:
            raise TypeError(
                f"DynamicScale takes flax's arguments {list(_FLAX_NAMES)}; {reserved} have no meaning "
                "here (the scale is scale=, the floor minimum_scale=, the axis is value_and_grad's "
                "axis_name=, and gradients are always float32, as in flax)"
            )
        stateful = sorted(name for name, plain in _STATEFUL.items() if merged.get(name, plain) != plain)
        if stateful:
            raise TypeError(
                f"DynamicScale keeps flax's state only (fin_steps and scale, so that flax checkpoints "
                f"restore into it); {stateful} need counters of their own: use "
                "ampscale.create_scaler(preset='flax', ...) with ampscale.jax.value_and_grad"
            )
        if not isinstance(check_loss, bool):
            raise TypeError(f"check_loss must be True or False; got {shown(check_loss)}")
        _check_scale(scale)
        _check_minimum_scale(minimum_scale)
        _check_fin_steps(fin_steps)
        ordered = tuple(sorted(merged.items(), key=lambda item: item[0]))
        config = _flax_config(growth_factor, backoff_factor, growth_interval, minimum_scale, ordered)
        static = (growth_factor, backoff_factor, growth_interval, minimum_scale, check_loss)
        _set(self, config, static, ordered, fin_steps, scale)

    def __repr__(self) -> str:
        # flax's repr (a dataclass's), with ampscale's fields only where they are not the default
        shown = [f"{name}={getattr(self, name)!r}" for name in _FLAX_NAMES]
        if self.check_loss:
            shown.append("check_loss=True")
        if self.settings:
            shown.append(f"settings={self.settings!r}")
        return f"DynamicScale({', '.join(shown)})"

    # -- what ampscale adds ---------------------------------------------------------------------
    @property
    def scaler(self) -> Scaler:
        """This state as an ampscale scaler (the flax preset with these settings): ``get_scale()``,
        ``state_dict()``. Only ``scale`` and ``fin_steps`` are state here (flax's two leaves), so
        its step counters start from zero: count skipped steps from ``value_and_grad``'s flag."""
        config = self._config
        return Scaler(config, BACKEND.pack(_fields(config, self.fin_steps, self.scale)), BACKEND)

    def replace(self, **changes: Any) -> DynamicScale:
        """A copy with some fields changed (``flax.struct``'s ``replace``: ``dataclasses.replace``).

        Raises:
            TypeError: a name that is not one of the fields.
            ValueError: a value out of range (named).
        """
        unknown = sorted(set(changes) - set(_FIELD_NAMES))
        if unknown:
            raise TypeError(f"unknown field(s) {unknown}; DynamicScale has {list(_FIELD_NAMES)}")
        if set(changes) <= {"fin_steps", "scale"}:
            # the state only (every step, under a trace): the settings stay, as they were checked
            if "scale" in changes:
                _check_scale(changes["scale"])
            if "fin_steps" in changes:
                _check_fin_steps(changes["fin_steps"])
            return _with_state(self, changes.get("fin_steps", self.fin_steps), changes.get("scale", self.scale))
        return dataclasses.replace(self, **changes)

    # -- the gradient --------------------------------------------------------------------------
    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: Any = None,
        *,
        agree_axes: Any = None,
    ) -> Callable[..., DynamicScaleResult]:
        """flax's ``value_and_grad``: ``fn(*args) -> (dynamic_scale, finite, aux, grad)``.

        The loss is multiplied by :attr:`scale` and differentiated; the gradients are cast to
        float32 and divided by the scale; with ``axis_name`` they are averaged over that
        mapped axis (``lax.pmean``, under ``pmap`` or ``shard_map``; under ``jit`` with
        sharded arrays none is needed) and checked after the averaging, so the flag is the
        same on every device of that axis. The returned ``dynamic_scale`` is already updated.

        Agreement, as in flax, comes from the averaging only: with ``axis_name=None`` (and no
        ``agree_axes``) each device checks its own gradients and no collective runs, so under
        ``pmap`` or ``shard_map`` devices may skip different steps, exactly as flax's do. What
        ampscale adds: with ``axis_name``, under ``shard_map`` on a mesh with more axes (data x
        model), the flag is also agreed over every axis the averaged gradients still vary over
        (their model shards), in one more reduction, so no two devices skip different steps;
        with ``check_loss``, the scaled loss's flag travels in the gradients' own all-reduce.

        Args:
            fun: the loss function (its first output is the loss with ``has_aux``).
            argnums: which positional arguments to differentiate.
            has_aux: whether ``fun`` returns ``(loss, aux)``; ``aux`` is then ``(loss, aux)``.
            axis_name: the mapped axis to average the gradients over (``None``: none, and no
                agreement, as in flax).
            agree_axes: mesh axes to agree on the flag over besides (a name or a tuple; with it
                the flag is agreed over these and over every axis it varies over, whatever
                ``axis_name`` is; for ``shard_map(..., check_vma=False)``, where JAX does not
                record which axes a value varies over, name the model axes here).
        """
        scale = self.scale
        check_loss = self.check_loss

        def scaled(*args: Any) -> Any:
            out = fun(*args)
            if has_aux:
                return scale * out[0], out[1]
            return scale * out

        differentiate = jax.value_and_grad(scaled, argnums, has_aux)

        def run(*args: Any) -> DynamicScaleResult:
            value, grads = differentiate(*args)
            scaled_loss = value[0] if has_aux else value
            loss = scaled_loss / scale
            grads = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / scale, grads)
            loss_ok = BACKEND.all_finite([scaled_loss]) if check_loss else None
            grads, loss_ok = _average(grads, loss_ok, axis_name)
            grads_ok = _all_finite(grads)
            if axis_name is not None or agree_axes is not None:
                # flax agrees through the pmean alone: without axis_name nothing is agreed
                grads_ok, loss_ok = _agree_over_varying(grads_ok, loss_ok, agree_axes)
            finite = grads_ok if loss_ok is None else jnp.logical_and(grads_ok, loss_ok)
            config = self._config
            state = _fields(config, self.fin_steps, scale)
            updated = Scaler(config, BACKEND.pack(state), BACKEND)._update(BACKEND, finite, loss_ok)
            fields = BACKEND.unpack(updated._state)
            # flax's jnp.where(..., 0, fin_steps + 1): weakly typed when fin_steps was
            fin_steps = _typed(fields.growth_tracker, _flax_fin_steps_type(self.fin_steps))
            new = _with_state(self, fin_steps, fields.scale)
            return DynamicScaleResult(new, finite, (loss, value[1]) if has_aux else loss, grads)

        return run


def _flax_config(
    growth_factor: Any, backoff_factor: Any, growth_interval: Any, minimum_scale: Any, settings: tuple[Any, ...]
) -> Any:
    """The flax preset's settings for these fields: the same object for equal fields (cached),
    whatever the scale, so that two DynamicScales that differ only in their leaves have the same
    pytree structure, as flax's do (``tree_map``, ``lax.cond`` branches, ``jit``'s cache)."""
    key = (growth_factor, backoff_factor, growth_interval, minimum_scale, settings)
    try:
        return _flax_config_cached(*key)
    except TypeError as exc:  # a setting that cannot be hashed (a callable that is not): made anew
        if "unhashable" not in str(exc):
            raise
        return _make_flax_config(*key)


def _make_flax_config(
    growth_factor: Any, backoff_factor: Any, growth_interval: Any, minimum_scale: Any, settings: tuple[Any, ...]
) -> Any:
    floor = None if minimum_scale is None else float(minimum_scale)
    named = dict(settings)
    # the scale is a leaf, not a setting: any value is taken, below the floor too, as in flax
    start = 65536.0 if floor is None else max(65536.0, floor)
    ceiling = named.get("max_scale")
    if isinstance(ceiling, numbers.Real) and not isinstance(ceiling, bool):
        start = min(start, float(ceiling))
    return make_config(
        "flax",
        init_scale=start,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=floor,
        **named,
    )


_flax_config_cached = functools.lru_cache(maxsize=256)(_make_flax_config)


#: every field of DynamicScale: flax's six, then ampscale's two
_FIELD_NAMES = (*_FLAX_NAMES, "check_loss", "settings")


def _set(target: DynamicScale, config: Any, static: tuple[Any, ...], settings: Any, fin_steps: Any, scale: Any) -> None:
    """Fill a DynamicScale's fields (it is frozen: ``object.__setattr__``), and its config."""
    growth_factor, backoff_factor, growth_interval, minimum_scale, check_loss = static
    values = {
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "fin_steps": fin_steps,
        "scale": scale,
        "minimum_scale": minimum_scale,
        "check_loss": check_loss,
        "settings": settings,
        "_config": config,
    }
    for name, value in values.items():
        object.__setattr__(target, name, value)


def _static(ds: DynamicScale) -> tuple[Any, ...]:
    return (ds.growth_factor, ds.backoff_factor, ds.growth_interval, ds.minimum_scale, ds.check_loss)


def _flax_fin_steps_rule(fin_steps: Any) -> Any:
    return jnp.where(jnp.bool_(True), 0, fin_steps + 1)


@functools.lru_cache(maxsize=64)
def _flax_fin_steps_cached(aval: Any) -> Any:
    return jax.eval_shape(_flax_fin_steps_rule, aval)


def _flax_fin_steps_type(fin_steps: Any) -> Any:
    """The dtype and weak type of flax's next ``fin_steps`` (a Python ``0`` gives a weakly typed
    int32, and so does every step after it)."""
    if _is_jax(fin_steps):
        return _flax_fin_steps_cached(_aval(fin_steps))
    return jax.eval_shape(_flax_fin_steps_rule, fin_steps)


def _with_state(ds: DynamicScale, fin_steps: Any, scale: Any) -> DynamicScale:
    """``ds`` with new leaves, made without ``__init__`` (its settings were checked already)."""
    out = object.__new__(DynamicScale)
    _set(out, ds._config, _static(ds), ds.settings, fin_steps, scale)
    return out


def _fields(config: Any, fin_steps: Any, scale: Any) -> ScalerState:
    """The flax preset's state with flax's two leaves in it (the other fields at their start)."""
    values = initial_values(config)
    wide = jnp.asarray(scale, dtype=jnp.float32)
    fields = ScalerState(
        *(
            jnp.asarray(v, dtype=jnp.int32 if f in INT_FIELDS else jnp.float32)
            for f, v in zip(ScalerState._fields, values, strict=True)
        )
    )
    return fields._replace(scale=wide, last_scale=wide, growth_tracker=jnp.asarray(fin_steps, dtype=jnp.int32))


def _check_scale(scale: Any) -> float | None:
    known = _concrete(scale, "scale")
    if known is not None and not (
        math.isfinite(known) and known > 0 and _round_to(known, "float32") not in (0.0, math.inf)
    ):
        raise ValueError(f"scale must be a finite number > 0 inside the float32 range; got {shown(scale)}")
    return known


def _check_minimum_scale(minimum_scale: Any) -> None:
    if minimum_scale is not None and not (
        isinstance(minimum_scale, numbers.Real) and math.isfinite(as_float(minimum_scale)) and float(minimum_scale) >= 0
    ):
        raise ValueError(f"minimum_scale must be None or a finite number >= 0; got {shown(minimum_scale)}")


def _check_fin_steps(fin_steps: Any) -> None:
    steps = _concrete(fin_steps, "fin_steps")
    if steps is not None and not (math.isfinite(steps) and steps == int(steps) and INT32_MIN < steps < INT32_MAX):
        raise ValueError(f"fin_steps must be an integer in the int32 range; got {shown(fin_steps)}")


def _concrete(value: Any, name: str) -> float | None:
    """``value`` as a Python float, or ``None`` when it is traced (its value is not known)."""
    if isinstance(value, jax.core.Tracer):
        return None
    numeric = isinstance(value, numbers.Real) or (hasattr(value, "dtype") and np.shape(value) == ())
    if isinstance(value, bool) or not numeric:
        raise TypeError(f"{name} must be a number or a 0-d array; got {type(value).__name__} {shown(value)}")
    return as_float(value)


def _register_dynamic_scale() -> None:
    keys = (jax.tree_util.GetAttrKey("fin_steps"), jax.tree_util.GetAttrKey("scale"))

    def parts(ds: DynamicScale) -> tuple[Any, ...]:
        return (ds._config, _static(ds), ds.settings)

    def flatten(ds: DynamicScale) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
        return (ds.fin_steps, ds.scale), parts(ds)

    def flatten_with_keys(ds: DynamicScale) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        return tuple(zip(keys, (ds.fin_steps, ds.scale), strict=True)), parts(ds)

    def unflatten(aux: tuple[Any, ...], children: Any) -> DynamicScale:
        ds = object.__new__(DynamicScale)
        config, static, settings = aux
        fin_steps, scale = children
        _set(ds, config, static, settings, fin_steps, scale)
        return ds

    jax.tree_util.register_pytree_with_keys(DynamicScale, flatten_with_keys, unflatten, flatten)


_register_dynamic_scale()


def _register_flax_serialization(serialization: Any) -> None:
    """``flax.serialization`` for :class:`DynamicScale` (flax's fields, ``fin_steps`` and
    ``scale``, and flax's errors) and :class:`DynamicLossScale` (``loss_scale``, ``counter``)."""

    def fields(*names: str) -> tuple[Any, Any]:
        def to_state(value: Any) -> dict[str, Any]:
            return {name: serialization.to_state_dict(getattr(value, name)) for name in names}

        def from_state(target: Any, state: dict[str, Any]) -> Any:
            template = {name: getattr(target, name) for name in names}
            values = restore_fields(serialization, type(target).__name__, template, state)
            if isinstance(target, DynamicScale):
                return target.replace(**values)
            return dataclasses.replace(target, **values)

        return to_state, from_state

    serialization.register_serialization_state(DynamicScale, *fields("fin_steps", "scale"), override=True)
    serialization.register_serialization_state(DynamicLossScale, *fields("loss_scale", "counter"), override=True)


when_imported("flax.serialization", _register_flax_serialization)


def __getattr__(name: str) -> Any:
    if name in _JMP_POLICY_NAMES:
        try:
            import jmp  # type: ignore[import-untyped]
        except ModuleNotFoundError as exc:
            raise AttributeError(
                f"ampscale.jax.{name} is jmp's precision policy API, forwarded from jmp, which is not "
                "installed (pip install jmp); loss scaling needs no policy"
            ) from exc
        return getattr(jmp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- optax --------------------------------------------------------------------------------------


class LossScaleState(NamedTuple):
    """The state of :func:`loss_scaled`: the scaler and the inner optimizer's state."""

    scaler: Scaler
    inner_state: Any


def loss_scaled(inner: Any, scaler: Scaler) -> Any:
    """Wrap an optax ``GradientTransformation`` so it takes scaled gradients.

    ``update(grads, state, params=None, *, scaled_loss=None, **extra)`` unscales ``grads`` with
    the scaler in ``state``, checks them (and ``scaled_loss`` if given) for inf/nan and, on a
    finite step, returns the inner transformation's updates; on an overflow it returns updates
    of ``-0.0`` (``p + (-0.0)`` is ``p`` bitwise, for every ``p``) and leaves the inner state
    untouched, so counters such as Adam's step do not advance. Either way the scaler in the
    returned state has been updated. Works under ``jax.jit`` with no host transfer.

    Args:
        inner: the optimizer to wrap (an ``optax.GradientTransformation``).
        scaler: the initial scaler (``ampscale.create_scaler(backend="jax", ...)``).
    """
    import optax

    if scaler.backend is None:
        scaler = Scaler(scaler.config, None, BACKEND)

    def init(params: Any) -> LossScaleState:
        return LossScaleState(scaler, inner.init(params))

    def update(
        updates: Any, state: LossScaleState, params: Any = None, *, scaled_loss: Any = None, **extra: Any
    ) -> tuple[Any, LossScaleState]:
        current = state.scaler
        grads, grads_finite, loss_finite, backend = current._unscale(updates, scaled_loss, _UNSET)
        finite = grads_finite if loss_finite is None else backend.logical_and(grads_finite, loss_finite)

        def apply(_: None) -> tuple[Any, Any]:
            return _call_inner(inner, grads, state.inner_state, params, extra)

        shapes = jax.eval_shape(apply, None)

        def skip(_: None) -> tuple[Any, Any]:
            skipped = jax.tree_util.tree_map(lambda u: jnp.full(u.shape, -0.0, u.dtype), shapes[0])
            return skipped, state.inner_state

        new_updates, new_inner = jax.lax.cond(finite, apply, skip, None)
        return new_updates, LossScaleState(current.update(finite, loss_finite=loss_finite), new_inner)

    return optax.GradientTransformationExtraArgs(init, update)


def _call_inner(inner: Any, grads: Any, inner_state: Any, params: Any, extra: dict[str, Any]) -> tuple[Any, Any]:
    import optax

    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner.update(grads, inner_state, params, **extra)  # type: ignore[no-any-return]
    return inner.update(grads, inner_state, params)  # type: ignore[no-any-return]


def scaler_of(opt_state: Any) -> Scaler:
    """The scaler held by a :func:`loss_scaled` state (searched through chained states).

    Raises:
        ValueError: ``opt_state`` holds no ``LossScaleState``.
    """
    found: list[Scaler] = []

    def visit(node: Any) -> None:
        if isinstance(node, LossScaleState):
            found.append(node.scaler)
        elif isinstance(node, (tuple, list)):
            for child in node:
                visit(child)
        elif isinstance(node, dict):
            for child in node.values():
                visit(child)

    visit(opt_state)
    if not found:
        raise ValueError("opt_state holds no LossScaleState: build the optimizer with ampscale.jax.loss_scaled")
    return found[0]


@contextlib.contextmanager
def floor_errors() -> Iterator[None]:
    """Raise :class:`ampscale.ScaleAtFloorError` for an ``on_floor="raise"`` inside ``jax.jit``.

    Under ``jax.jit`` the floor reaction runs in a host callback, and JAX reports an exception
    raised there as its own ``jax.errors.JaxRuntimeError``, at the next point that waits for the
    result (``block_until_ready``, a host read, or a later dispatch). Around the code that
    waits, this context manager raises the original ``ScaleAtFloorError`` in its place, chained
    to JAX's error; other errors pass through unchanged::

        with ampscale.jax.floor_errors():
            params, scaler = train_step(params, scaler, batch)
            jax.block_until_ready(scaler)

    Without it, catch ``jax.errors.JaxRuntimeError``: its message holds the reaction's message.
    Eagerly (no ``jit``) the ``ScaleAtFloorError`` is raised directly by ``update``/``step``.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        original = _floor_error_in(exc)
        if original is None:
            raise
        raise original from exc


def _floor_error_in(exc: BaseException) -> ScaleAtFloorError | None:
    """The ``ScaleAtFloorError`` that JAX's error ``exc`` reports, if any (taken off the record)."""
    text = str(exc)
    for error in reversed(TRACED_FLOOR_ERRORS):
        if str(error) in text:
            TRACED_FLOOR_ERRORS.remove(error)
            return error
    return None
