"""JAX helpers: a loss-scaling ``value_and_grad`` and an optax wrapper.

The scaler itself (``ampscale.create_scaler(backend="jax")``) is a pytree: pass it through
``jax.jit``, ``lax.scan`` or ``shard_map`` like any other state. Two conveniences build on it:

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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ampscale._config import _UNSET
from ampscale._scaler import Scaler
from ampscale.backends.jax import BACKEND

__all__ = ["LossScaleState", "ScaledGrad", "loss_scaled", "scaler_of", "value_and_grad"]


class ScaledGrad(NamedTuple):
    """The result of a function made by :func:`value_and_grad`.

    Attributes:
        loss: the (unscaled) value of the function.
        aux: its auxiliary output (``None`` without ``has_aux``).
        grads: the gradients, unscaled.
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
        axis_name: agree on ``finite`` across this axis (``shard_map``/``pmap``); defaults to
            the scaler's ``axis_name`` setting.
    """

    def scaled(scaler: Scaler, *args: Any) -> tuple[Any, tuple[Any, Any, Any]]:
        out = fun(*args)
        loss, aux = out if has_aux else (out, None)
        scaled_loss = scaler.scale(loss)
        return scaled_loss, (loss, aux, scaled_loss)

    grad_fn = jax.grad(scaled, argnums=_shift(argnums), has_aux=True)

    def wrapped(scaler: Scaler, *args: Any) -> ScaledGrad:
        grads, (loss, aux, scaled_loss) = grad_fn(scaler, *args)
        grads, grads_finite, loss_finite, backend = scaler._unscale(grads, scaled_loss, axis_name)
        finite = backend.logical_and(grads_finite, loss_finite)
        return ScaledGrad(loss, aux, grads, finite, loss_finite)

    return wrapped


def _shift(argnums: int | Sequence[int]) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums + 1
    return tuple(a + 1 for a in argnums)


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
