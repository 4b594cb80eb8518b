"""JAX helpers: flax's ``DynamicScale`` on ampscale, ``value_and_grad``, and an optax wrapper.

The scaler itself (``ampscale.create_scaler(backend="jax")``) is a pytree: pass it through
``jax.jit``, ``lax.scan`` or ``shard_map`` like any other state. Three conveniences build on it:

* :class:`DynamicScale` takes ``flax.training.dynamic_scale.DynamicScale``'s arguments and gives
  its results bit for bit (float32 gradients divided by the scale, averaged over ``axis_name``,
  the scale updated inside ``value_and_grad``): a flax program ports by changing the import.
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
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from ampscale._info import missing_framework

try:
    import jax
    import jax.numpy as jnp
except ModuleNotFoundError as exc:  # say what to install, not only what is missing
    raise missing_framework(__name__, exc) from exc

from ampscale._config import _UNSET, FLOAT32_TINY, INT32_MAX, INT32_MIN, _round_to, make_config
from ampscale._core import ScalerState, initial_values
from ampscale._errors import ScaleAtFloorError
from ampscale._scaler import TRACED_FLOOR_ERRORS, Scaler
from ampscale.backends.jax import BACKEND

__all__ = [
    "DynamicScale",
    "DynamicScaleResult",
    "LossScaleState",
    "ScaledGrad",
    "floor_errors",
    "loss_scaled",
    "scaler_of",
    "value_and_grad",
]


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
            every device gets the same gradients and flags. (For flax's float32 arithmetic,
            bit for bit, use :class:`DynamicScale`.) ``None``: no averaging and no agreement.
            Left out, the gradients are not averaged and the flags are agreed over the
            scaler's own ``axis_name`` setting, if it has one (as :meth:`Scaler.unscale`).
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
        else:
            # Averaged first, then checked: a non-finite gradient on any device makes the mean
            # non-finite on all of them, and so does a sum that overflows.
            grads, _, loss_finite, backend = scaler._unscale(grads, scaled_loss, None)
            grads = jax.lax.pmean(grads, axis_name)
            grads_finite = _all_finite(grads)
            loss_finite = backend.agree(loss_finite, axis_name)
        finite = backend.logical_and(grads_finite, loss_finite)
        return ScaledGrad(loss, aux, grads, finite, loss_finite)

    return wrapped


def _shift(argnums: int | Sequence[int]) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums + 1
    return tuple(a + 1 for a in argnums)


def _all_finite(tree: Any) -> Any:
    return BACKEND.all_finite(jax.tree_util.tree_leaves(tree))


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


class DynamicScale:
    """``flax.training.dynamic_scale.DynamicScale``, driven by an ampscale scaler (``preset="flax"``).

    Same arguments, same defaults, same pytree use (a field of a flax ``TrainState``,
    replicated for ``pmap``, passed through ``jit``, ``scan`` and ``shard_map``), same
    :meth:`value_and_grad`, same results bit for bit: the trajectory of :attr:`scale`, the
    flag, the loss and the float32 gradients. Port a flax program by changing the import::

        # from flax.training.dynamic_scale import DynamicScale
        from ampscale.jax import DynamicScale

    What ampscale adds: the scaled loss is checked too (``check_loss``), the settings are
    validated (a ``ValueError`` names the argument), ``on_floor=`` and the other ampscale
    settings are accepted, and :attr:`scaler` gives the counters, the step outcome and a
    checkpoint (``scaler.state_dict()``).

    Args:
        growth_factor: the scale is multiplied by it after ``growth_interval + 1`` finite steps
            in a row (flax's count; > 1).
        backoff_factor: the scale is multiplied by it on a non-finite step (in (0, 1)).
        growth_interval: see ``growth_factor`` (>= 0).
        fin_steps: finite steps already counted (flax's ``fin_steps``).
        scale: the current scale (finite, > 0). A Python number stays one until the first
            step, as in flax, so the first scaled loss follows JAX's weak typing exactly.
        minimum_scale: the floor of the backoff (``None``: no floor).
        check_loss: a scaled loss that is not finite also makes the step non-finite
            (``False``: only the gradients decide, as in flax; they differ only on a step whose
            scaled loss overflows while every gradient stays finite).
        **settings: any other ``ampscale.create_scaler`` setting (``on_floor``,
            ``hysteresis``, ``max_scale``, ...).

    Raises:
        ValueError: an argument is outside its accepted range (the message names it).
        TypeError: an unknown setting.

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
    """

    __slots__ = ("_check_loss", "_scale", "_scaler")
    _check_loss: bool
    _scale: Any
    _scaler: Scaler

    def __init__(
        self,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        fin_steps: Any = 0,
        scale: Any = 65536.0,
        minimum_scale: float | None = FLOAT32_TINY,
        *,
        check_loss: bool = True,
        **settings: Any,
    ) -> None:
        reserved = sorted(set(settings) & {"init_scale", "min_scale", "preset", "axis_name", "grad_dtype"})
        if reserved:
            raise TypeError(
                f"DynamicScale takes flax's arguments {list(_FLAX_NAMES)}; {reserved} have no meaning "
                "here (the scale is scale=, the floor minimum_scale=, the axis is value_and_grad's "
                "axis_name=, and gradients are always float32, as in flax)"
            )
        if not isinstance(check_loss, bool):
            raise TypeError(f"check_loss must be True or False; got {check_loss!r}")
        known = _concrete(scale)
        if known is not None and not (
            math.isfinite(known) and known > 0 and _round_to(known, "float32") not in (0.0, math.inf)
        ):
            raise ValueError(f"scale must be a finite number > 0 inside the float32 range; got {scale!r}")
        if minimum_scale is not None and not (
            isinstance(minimum_scale, numbers.Real) and math.isfinite(minimum_scale) and minimum_scale >= 0
        ):
            raise ValueError(f"minimum_scale must be None or a finite number >= 0; got {minimum_scale!r}")
        steps = _concrete(fin_steps)
        if steps is not None and not (steps == int(steps) and INT32_MIN < steps < INT32_MAX):
            raise ValueError(f"fin_steps must be an integer in the int32 range; got {fin_steps!r}")
        config = make_config(
            "flax",
            init_scale=65536.0 if known is None else known,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=minimum_scale,
            **settings,
        )
        values = initial_values(config)
        fields = ScalerState(
            *(jnp.asarray(v, dtype=jnp.int32 if isinstance(v, int) else jnp.float32) for v in values)
        )._replace(growth_tracker=jnp.asarray(fin_steps, dtype=jnp.int32))
        if known is None:  # a traced scale: the state takes its value
            traced = jnp.asarray(scale, dtype=jnp.float32)
            fields = fields._replace(scale=traced, last_scale=traced)
        _set(self, Scaler(config, BACKEND.pack(fields), BACKEND), scale, check_loss)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DynamicScale is immutable; use replace() ({name!r})")

    def __repr__(self) -> str:
        c = self._scaler.config
        return (
            f"DynamicScale(growth_factor={c.growth_factor}, backoff_factor={c.backoff_factor}, "
            f"growth_interval={c.growth_interval}, minimum_scale={c.min_scale}, check_loss={self._check_loss})"
        )

    # -- flax's fields --------------------------------------------------------------------------
    @property
    def scale(self) -> Any:
        """The current scale: a 0-d float32 array (a Python number before the first step).

        Traced under ``jit``/``pmap``: log it from inside the step (``metrics["scale"] =
        dynamic_scale.scale``), as flax programs do.
        """
        return self._scale

    @property
    def fin_steps(self) -> Any:
        """Finite steps counted towards the next growth (0-d int32)."""
        return self._scaler.state.growth_tracker  # type: ignore[union-attr]

    @property
    def growth_factor(self) -> float:
        """The growth factor (static)."""
        return float(self._scaler.config.growth_factor)

    @property
    def backoff_factor(self) -> float:
        """The backoff factor (static)."""
        return float(self._scaler.config.backoff_factor)

    @property
    def growth_interval(self) -> int:
        """Finite steps, plus one, between growths (flax's count; static)."""
        return int(self._scaler.config.growth_interval)

    @property
    def minimum_scale(self) -> float | None:
        """The floor of the scale (static)."""
        return self._scaler.config.min_scale

    # -- what ampscale adds ---------------------------------------------------------------------
    @property
    def scaler(self) -> Scaler:
        """The ampscale scaler holding the state: ``outcome``, ``get_stats()``, ``state_dict()``."""
        return self._scaler

    @property
    def check_loss(self) -> bool:
        """Whether a non-finite scaled loss makes the step non-finite."""
        return self._check_loss

    def replace(self, **changes: Any) -> DynamicScale:
        """A copy with some of flax's fields changed (``flax.struct``'s ``replace``).

        Raises:
            TypeError: a name that is not one of flax's fields or ``check_loss``.
        """
        unknown = sorted(set(changes) - {*_FLAX_NAMES, "check_loss"})
        if unknown:
            raise TypeError(f"unknown field(s) {unknown}; DynamicScale has {[*_FLAX_NAMES, 'check_loss']}")
        settings: dict[str, Any] = {
            key: changes[key] for key in ("growth_factor", "backoff_factor", "growth_interval") if key in changes
        }
        if "minimum_scale" in changes:
            settings["min_scale"] = changes["minimum_scale"]
            if changes["minimum_scale"] is not None and not (
                isinstance(changes["minimum_scale"], numbers.Real) and math.isfinite(changes["minimum_scale"])
            ):
                raise ValueError(
                    f"minimum_scale must be None or a finite number >= 0; got {changes['minimum_scale']!r}"
                )
        scaler = self._scaler.replace(**settings) if settings else self._scaler
        scale = self._scale
        if "scale" in changes or "fin_steps" in changes:
            fields = BACKEND.unpack(scaler._state)
            if "scale" in changes:
                scale = changes["scale"]
                known = _concrete(scale)
                if known is not None and not (math.isfinite(known) and known > 0):
                    raise ValueError(f"scale must be a finite number > 0; got {scale!r}")
                wide = jnp.asarray(scale, dtype=jnp.float32)
                fields = fields._replace(scale=wide, last_scale=wide)
            if "fin_steps" in changes:
                fields = fields._replace(growth_tracker=jnp.asarray(changes["fin_steps"], dtype=jnp.int32))
            scaler = Scaler(scaler.config, BACKEND.pack(fields), BACKEND)
        out = object.__new__(DynamicScale)
        _set(out, scaler, scale, changes.get("check_loss", self._check_loss))
        return out

    # -- the gradient --------------------------------------------------------------------------
    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: Any = None,
    ) -> Callable[..., DynamicScaleResult]:
        """flax's ``value_and_grad``: ``fn(*args) -> (dynamic_scale, finite, aux, grad)``.

        The loss is multiplied by :attr:`scale` and differentiated; the gradients are cast to
        float32 and divided by the scale; with ``axis_name`` they are averaged over that
        mapped axis (``lax.pmean``, under ``pmap`` or ``shard_map``; under ``jit`` with
        sharded arrays none is needed) and checked after the averaging, so every device gets
        the same gradients and flag. The returned ``dynamic_scale`` is already updated.

        Args:
            fun: the loss function (its first output is the loss with ``has_aux``).
            argnums: which positional arguments to differentiate.
            has_aux: whether ``fun`` returns ``(loss, aux)``; ``aux`` is then ``(loss, aux)``.
            axis_name: the mapped axis to average the gradients over (``None``: none).
        """
        scale = self._scale

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
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)
            finite = _all_finite(grads)
            loss_finite = None
            if self._check_loss:
                loss_finite = BACKEND.all_finite([scaled_loss])
                if axis_name is not None:
                    loss_finite = BACKEND.agree(loss_finite, axis_name)
                finite = jnp.logical_and(finite, loss_finite)
            scaler = self._scaler._update(BACKEND, finite, loss_finite)
            new = object.__new__(DynamicScale)
            _set(new, scaler, BACKEND.scale_of(scaler._state), self._check_loss)
            return DynamicScaleResult(new, finite, (loss, value[1]) if has_aux else loss, grads)

        return run


def _set(target: DynamicScale, scaler: Scaler, scale: Any, check_loss: bool) -> None:
    object.__setattr__(target, "_scaler", scaler)
    object.__setattr__(target, "_scale", scale)
    object.__setattr__(target, "_check_loss", check_loss)


def _concrete(value: Any) -> float | None:
    """``value`` as a Python float, or ``None`` when it is traced (its value is not known)."""
    if isinstance(value, jax.core.Tracer):
        return None
    numeric = isinstance(value, numbers.Real) or hasattr(value, "dtype")
    if isinstance(value, bool) or not numeric:
        raise TypeError(f"expected a number or a 0-d array; got {type(value).__name__} {value!r}")
    return float(value)


def _register_dynamic_scale() -> None:
    keys = (jax.tree_util.GetAttrKey("scale"), jax.tree_util.GetAttrKey("scaler"))

    def flatten(ds: DynamicScale) -> tuple[tuple[Any, Scaler], bool]:
        return (ds._scale, ds._scaler), ds._check_loss

    def flatten_with_keys(ds: DynamicScale) -> tuple[tuple[tuple[Any, Any], ...], bool]:
        return tuple(zip(keys, (ds._scale, ds._scaler), strict=True)), ds._check_loss

    def unflatten(check_loss: bool, children: Any) -> DynamicScale:
        ds = object.__new__(DynamicScale)
        scale, scaler = children
        _set(ds, scaler, scale, check_loss)
        return ds

    jax.tree_util.register_pytree_with_keys(DynamicScale, flatten_with_keys, unflatten, flatten)


_register_dynamic_scale()


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
