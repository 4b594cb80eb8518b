"""FP8 matrix products for JAX and flax: a flax-compatible ``fp8_dot_general`` and a plain one.

Two ways to carry the FP8 state through a JAX training step:

* :func:`fp8_dot_general` (and the flax modules :class:`Fp8DotGeneral`,
  :class:`Fp8QdqDotGeneral`, built on first use) follows ``flax.linen.fp8_ops``: each operand
  (``input``, ``kernel``, ``output_grad``) has variables in the ``_overwrite_with_gradient``
  collection, and their "gradients" are their next values, which a flax trainer writes back in
  place of an optimizer update. Variables stored as flax's ``fm32`` (``fp32_max_grad``) are
  accumulated by ``max`` when a layer is used several times in one step (``scan``), as flax's.
* :func:`fp8_dot` takes the scales of an :class:`~ampscale.fp8.Fp8Scaler` (a pytree argument)
  and returns the amaxes as the gradient of an ``amax_sink`` argument: combine them over
  micro-batches (:func:`ampscale.fp8.combine_amax`) and call ``update`` once per optimizer
  step, with the loss scaler's flag (:func:`ampscale.fp8.unscale_and_update`).

How the overwrite variables stay exact under accumulation. A flax trainer sums (or, with
``fm32``, max-merges) the overwrite "gradients" of every micro-batch and every use. flax's own
cotangents are each use's new scale and rolled history, which merge into a history no single
step wrote. Here each operand has one more variable, ``{operand}_amax``: the amax seen since
the last update (``-inf``: none), and the history is written at the *next* call::

    call t:   state = transition(scale, amax_history, pending amax a_{t-1})   # the preset's rule
              cast x with state's scale
              cotangents: state's scale, state's history (the same for every micro-batch and
                          every use of the step), and amax(x) for {operand}_amax (max-merged)

So the merged variables are exactly one update with the step's largest amax, written once per
optimizer step, and the scale a call casts with is the one flax casts with: with the ``flax``
preset, outputs, gradients and the ``*_scale`` variables equal flax's bit for bit (its history
holds the same amaxes, newest first and one step later). On a step the loss scaler skips,
keep the old variables (``on_skipped_step="freeze"``) or take the new ones (``"record"``):
:func:`select_overwrite` does it from the preset.

The stored ``{operand}_scale`` is the preset's own: the dequantization scale for presets that
store the inverse (flax, Keras), the quantization scale for the others (TE); the other one
is derived as the transition derives it. Counters (``filled``, ``nonfinite``, ...) are kept by
:class:`~ampscale.fp8.Fp8Scaler` only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ampscale.fp8._cast import fp8_dtype
from ampscale.fp8._config import FORMATS, Fp8Config, make_fp8_config
from ampscale.fp8._scaler import Fp8Scaler
from ampscale.fp8._transition import Fp8State
from ampscale.fp8._update import canonical_history, update_state

__all__ = [
    "OPERANDS",
    "OVERWRITE_WITH_GRADIENT",
    "fp8_dot",
    "fp8_dot_general",
    "init_fp8_vars",
    "select_overwrite",
]

#: the collection flax trainers overwrite with the "gradients" (flax.linen.fp8_ops's name)
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
#: the operands of a product, and their roles (the role picks the FP8 format)
OPERANDS = ("input", "kernel", "output_grad")
_ROLES = {"input": "forward", "kernel": "forward", "output_grad": "backward"}
_NO_AMAX = -math.inf  # a pending amax not yet seen (and the identity of flax's max-merge)


# ------------------------------------------------------------------------------ the variables


@functools.lru_cache(maxsize=64)
def operand_config(preset: str, operand: str, history_len: int) -> Fp8Config:
    """The one-slot config of ``operand`` (``input``, ``kernel``, ``output_grad``) under ``preset``."""
    if operand not in _ROLES:
        raise ValueError(f"operand must be one of {list(OPERANDS)}; got {operand!r}")
    return make_fp8_config(preset, {operand: _ROLES[operand]}, history_len=history_len)


def init_fp8_vars(preset: str = "flax", history_len: int = 1024, dtype: Any = jnp.float32) -> dict[str, Any]:
    """The initial overwrite variables of one product: per operand ``{operand}_scale`` ``(1,)``,
    ``{operand}_amax_history`` ``(history_len,)`` and ``{operand}_amax`` ``(1,)``.

    ``dtype``: ``float32``, or flax's ``fm32`` to have autodiff merge several uses by ``max``.
    """
    for operand in OPERANDS:
        operand_config(preset, operand, history_len)  # validates preset and history_len
    out = {}
    for operand in OPERANDS:
        out[f"{operand}_scale"] = _as(jnp.ones((1,), jnp.float32), dtype)
        out[f"{operand}_amax_history"] = _as(jnp.zeros((history_len,), jnp.float32), dtype)
        out[f"{operand}_amax"] = _as(jnp.full((1,), _NO_AMAX, jnp.float32), dtype)
    return out


def _is_extended(dtype: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def _as(value: Any, dtype: Any) -> Any:
    return lax.convert_element_type(value, dtype) if _is_extended(dtype) else value.astype(dtype)


def _f32(value: Any) -> Any:
    return lax.convert_element_type(value, jnp.float32) if _is_extended(value.dtype) else value.astype(jnp.float32)


def _derived(config: Fp8Config, stored: Any) -> tuple[Any, Any]:
    """``(scale, scale_inv)`` from the stored one, as the transition derives the other
    (:func:`ampscale.fp8._transition.slot_transition`: ``1/x``, flushed where the preset flushes)."""
    one = jnp.float32(1.0)
    if config.storage == "scale":
        inverse = one / stored
        if config.subnormals == "flush":
            inverse = jnp.where(jnp.abs(inverse) < jnp.finfo(jnp.float32).tiny, jnp.float32(0.0), inverse)
        return stored, inverse
    return one / stored, stored


def advance(config: Fp8Config, scale_var: Any, history_var: Any, amax_var: Any) -> tuple[Any, Any, Any]:
    """``(scale, scale_inv, history)`` after the pending amax (none: unchanged), in float32."""
    stored = _f32(scale_var).reshape(())
    history = _f32(history_var)
    pending = _f32(amax_var).reshape(())
    scale, inverse = _derived(config, stored)
    zeros = jnp.zeros((1,), jnp.int32)
    # the variable holds the history oldest first, as flax's layout is fixed (an export): the
    # state's ring starts at head 0, and the written ring is read back in that order
    state = Fp8State(scale[None], inverse[None], history[None], zeros, zeros, zeros, jnp.zeros((), jnp.int32), zeros)
    nxt, _updated = update_state(config, state, pending[None], True)
    none = pending == jnp.float32(_NO_AMAX)
    return (
        jnp.where(none, scale, nxt.scale[0]),
        jnp.where(none, inverse, nxt.scale_inv[0]),
        jnp.where(none, history, canonical_history(nxt)[0]),
    )


def select_overwrite(preset: str, old: Any, new: Any, step_ok: Any) -> Any:
    """The overwrite variables after a step: ``new``, or ``old`` where the loss scaler skipped
    the step and the preset freezes on a skipped step (``on_skipped_step="freeze"``).

    ``old`` and ``new`` are trees of the same structure (a whole collection or one product's).
    """
    if make_fp8_config(preset, 1).on_skipped_step == "record":
        return new
    return jax.tree_util.tree_map(lambda a, b: jnp.where(step_ok, b, a), old, new)


# ------------------------------------------------------------------------------ casts


def _amax(x: Any) -> Any:
    if x.size == 0:
        return jnp.zeros((1,), jnp.float32)
    return jnp.max(jnp.abs(x)).astype(jnp.float32).reshape((1,))


def quantize(x: Any, scale: Any, scale_inv: Any, fmt: str, divide: bool, compute_dtype: Any) -> Any:
    """``x`` saturated into ``fmt``: ``x / scale_inv`` in ``compute_dtype`` (flax, Keras) or
    ``x * scale`` in float32 (TE, torchao), clipped before the cast (which does not saturate)."""
    bound = FORMATS[fmt]
    if divide:
        wide = x / jnp.broadcast_to(scale_inv.astype(compute_dtype), x.shape)
        limit = jnp.asarray(bound, compute_dtype)
    else:
        wide = x.astype(jnp.float32) * scale
        limit = jnp.asarray(bound, jnp.float32)
    return jnp.clip(wide, -limit, limit).astype(fp8_dtype(fmt, "jax"))


def dequantize(q: Any, scale_inv: Any, dtype: Any) -> Any:
    """``q * scale_inv`` in ``dtype``."""
    return q.astype(dtype) * jnp.broadcast_to(scale_inv.astype(dtype), q.shape)


def _qdq(x: Any, scale: Any, scale_inv: Any, fmt: str, divide: bool, compute_dtype: Any) -> Any:
    if divide:
        return dequantize(quantize(x, scale, scale_inv, fmt, True, compute_dtype), scale_inv, x.dtype)
    q = quantize(x, scale, scale_inv, fmt, False, compute_dtype)
    return dequantize(q, scale_inv, jnp.float32).astype(x.dtype)


# ------------------------------------------------------------------------------ the core products


def _transpose_lhs(
    g: Any, x: Any, y: Any, dimension_numbers: Any, precision: Any, preferred: Any, swap: bool = False
) -> Any:
    """The cotangent of ``lhs`` of ``dot_general(lhs, y)`` for output cotangent ``g`` (the
    transpose rule of ``lax.dot_general``, as flax's ``fp8_ops`` writes it, so that fp8
    operands go into the product as they are)."""

    def remaining(original: Any, *removed_lists: Any) -> list[int]:
        removed = {i for removed in removed_lists for i in removed}
        return [i for i in original if i not in removed]

    def ranges_like(*xs: Any) -> Iterator[range]:
        start = 0
        for x_ in xs:
            yield range(start, start + len(x_))
            start += len(x_)

    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = remaining(range(x.ndim), x_contract, x_batch)
    y_kept = remaining(range(np.ndim(y)), y_contract, y_batch)
    if swap:
        ans_batch, ans_y, _ = ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, y_kept), (ans_batch, y_batch))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    product = lax.dot_general(g, y, dims, precision=precision, preferred_element_type=preferred)
    return lax.transpose(product, tuple(int(a) for a in out_axes))


def _transpose_rhs(g: Any, x: Any, y: Any, dimension_numbers: Any, precision: Any, preferred: Any) -> Any:
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, y, x, swapped, precision, preferred, swap=True)


class _Static:
    """The static part of one product (hashable: a ``nondiff_argnum``)."""

    __slots__ = ("compute_dtype", "dimension_numbers", "divide", "formats", "preferred")

    def __init__(self, dimension_numbers: Any, preferred: Any, formats: tuple[str, str], divide: bool, compute: Any):
        self.dimension_numbers = jax.tree_util.tree_map(int, dimension_numbers)
        self.preferred = preferred
        self.formats = formats
        self.divide = divide
        self.compute_dtype = compute

    def _key(self) -> tuple[Any, ...]:
        dims = jax.tree_util.tree_leaves(self.dimension_numbers)
        return (str(self.dimension_numbers), tuple(dims), self.preferred, self.formats, self.divide, self.compute_dtype)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key() == other._key()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _direct(static: _Static, lhs: Any, rhs: Any, lhs_meta: Any, rhs_meta: Any, grad_meta: Any) -> Any:
    out, _ = _direct_fwd(static, lhs, rhs, lhs_meta, rhs_meta, grad_meta)
    return out


def _direct_fwd(static: _Static, lhs: Any, rhs: Any, lhs_meta: Any, rhs_meta: Any, grad_meta: Any) -> tuple[Any, Any]:
    forward_format = static.formats[0]
    q_lhs = quantize(lhs, lhs_meta[0], lhs_meta[1], forward_format, static.divide, static.compute_dtype)
    q_rhs = quantize(rhs, rhs_meta[0], rhs_meta[1], forward_format, static.divide, static.compute_dtype)
    product = lax.dot_general(
        q_lhs,
        q_rhs,
        static.dimension_numbers,
        preferred_element_type=static.preferred,
        precision=lax.Precision.DEFAULT,
    )
    out = dequantize(product, lhs_meta[1] * rhs_meta[1], static.preferred)
    return out, (lhs, rhs, q_lhs, q_rhs, lhs_meta, rhs_meta, grad_meta)


def _direct_bwd(static: _Static, residuals: Any, g: Any) -> tuple[Any, ...]:
    lhs, rhs, q_lhs, q_rhs, lhs_meta, rhs_meta, grad_meta = residuals
    q_g = quantize(g, grad_meta[0], grad_meta[1], static.formats[1], static.divide, static.preferred)
    highest = lax.Precision.HIGHEST
    grad_lhs = _transpose_lhs(q_g, lhs, q_rhs, static.dimension_numbers, highest, static.preferred)
    grad_lhs = dequantize(grad_lhs, rhs_meta[1] * grad_meta[1], static.preferred)
    grad_rhs = _transpose_rhs(q_g, q_lhs, rhs, static.dimension_numbers, highest, static.preferred)
    grad_rhs = dequantize(grad_rhs, lhs_meta[1] * grad_meta[1], static.preferred)

    def meta_cotangent(meta: Any, amax: Any) -> Any:
        return (jnp.zeros_like(meta[0]), jnp.zeros_like(meta[1]), amax)

    return (
        grad_lhs.astype(lhs.dtype),
        grad_rhs.astype(rhs.dtype),
        meta_cotangent(lhs_meta, _amax(lhs)),
        meta_cotangent(rhs_meta, _amax(rhs)),
        meta_cotangent(grad_meta, _amax(g)),
    )


_direct.defvjp(_direct_fwd, _direct_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _in_qdq(fmt: str, static: _Static, x: Any, meta: Any) -> Any:
    return _qdq(x, meta[0], meta[1], fmt, static.divide, static.compute_dtype)


def _in_qdq_fwd(fmt: str, static: _Static, x: Any, meta: Any) -> tuple[Any, Any]:
    return _in_qdq(fmt, static, x, meta), (x, meta)


def _in_qdq_bwd(fmt: str, static: _Static, residuals: Any, g: Any) -> tuple[Any, Any]:
    x, meta = residuals
    return g, (jnp.zeros_like(meta[0]), jnp.zeros_like(meta[1]), _amax(x))  # straight through


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _out_qdq(fmt: str, static: _Static, y: Any, meta: Any) -> Any:
    return y


def _out_qdq_fwd(fmt: str, static: _Static, y: Any, meta: Any) -> tuple[Any, Any]:
    return y, meta


def _out_qdq_bwd(fmt: str, static: _Static, meta: Any, g: Any) -> tuple[Any, Any]:
    q_g = _qdq(g, meta[0], meta[1], fmt, static.divide, static.compute_dtype)
    return q_g, (jnp.zeros_like(meta[0]), jnp.zeros_like(meta[1]), _amax(g))


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dot_with_precision(lhs: Any, rhs: Any, dimension_numbers: Any) -> Any:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=lax.Precision.DEFAULT)


def _dot_with_precision_jvp(dimension_numbers: Any, primals: Any, tangents: Any) -> tuple[Any, Any]:
    lhs, rhs = primals
    lhs_dot, rhs_dot = tangents
    out = lax.dot_general(lhs, rhs, dimension_numbers, precision=lax.Precision.DEFAULT)
    highest = lax.Precision.HIGHEST
    tangent = lax.dot_general(lhs_dot, rhs, dimension_numbers, precision=highest) + lax.dot_general(
        lhs, rhs_dot, dimension_numbers, precision=highest
    )
    return out, tangent


_dot_with_precision.defjvp(_dot_with_precision_jvp)


def _product(static: _Static, direct: bool, lhs: Any, rhs: Any, metas: tuple[Any, Any, Any]) -> Any:
    if direct:
        return _direct(static, lhs, rhs, *metas)
    forward_format, backward_format = static.formats
    lhs_qdq = _in_qdq(forward_format, static, lhs, metas[0])
    rhs_qdq = _in_qdq(forward_format, static, rhs, metas[1])
    return _out_qdq(backward_format, static, _dot_with_precision(lhs_qdq, rhs_qdq, static.dimension_numbers), metas[2])


# ------------------------------------------------------------------------------ the flax-style route


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overwrite_meta(config: Fp8Config, scale_var: Any, history_var: Any, amax_var: Any) -> Any:
    return _overwrite_meta_fwd(config, scale_var, history_var, amax_var)[0]


def _overwrite_meta_fwd(config: Fp8Config, scale_var: Any, history_var: Any, amax_var: Any) -> tuple[Any, Any]:
    scale, inverse, history = advance(config, scale_var, history_var, amax_var)
    sink = jnp.zeros((1,), jnp.float32)
    return (scale, inverse, sink), (scale, inverse, history, scale_var, history_var, amax_var)


def _overwrite_meta_bwd(config: Fp8Config, residuals: Any, cotangents: Any) -> tuple[Any, Any, Any]:
    scale, inverse, history, scale_var, history_var, amax_var = residuals
    stored = scale if config.storage == "scale" else inverse
    seen = cotangents[2]  # the amax of this use (the product's cotangent of the sink)
    return (
        _as(stored.reshape((1,)), scale_var.dtype),
        _as(history, history_var.dtype),
        _as(seen.reshape(amax_var.shape), amax_var.dtype),
    )


_overwrite_meta.defvjp(_overwrite_meta_fwd, _overwrite_meta_bwd)


def _static_for(preset: str, history_len: int, dimension_numbers: Any, preferred: Any, compute: Any) -> _Static:
    forward = operand_config(preset, "input", history_len)
    backward = operand_config(preset, "output_grad", history_len)
    formats = (forward.slot_formats[0], backward.slot_formats[0])
    return _Static(dimension_numbers, preferred, formats, forward.storage == "inverse", compute)


def fp8_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    fp8_vars: dict[str, Any],
    preset: str = "flax",
    direct: bool = True,
    compute_dtype: Any = None,
) -> Any:
    """``lax.dot_general`` in FP8 whose overwrite variables' "gradients" are their next values.

    Args:
        lhs, rhs, dimension_numbers, preferred_element_type: as ``lax.dot_general``
            (``precision`` is set by the FP8 product, as in flax's ``fp8_ops``).
        fp8_vars: this product's variables (:func:`init_fp8_vars`): differentiate with respect
            to them, and replace them with their "gradients" after the step (a flax trainer does
            it for the ``_overwrite_with_gradient`` collection); merge micro-batches' by max
            (:func:`ampscale.fp8.combine_amax`, or ``fm32`` variables).
        preset: the FP8 preset whose rules update the variables (``"flax"``: flax's own).
        direct: fp8 operands into the product (flax's ``Fp8DirectDotGeneralOp``), or the
            quantize-dequantized operands in ``compute_dtype`` (``Fp8DotGeneralOp``).
        compute_dtype: where the flax and Keras presets divide by the scale (default: ``rhs``'s
            dtype, as flax).

    Returns:
        The product, in ``preferred_element_type`` (default: ``lhs``'s dtype).
    """
    history_len = int(fp8_vars["input_amax_history"].shape[0])
    compute = jnp.dtype(compute_dtype or rhs.dtype)
    lhs = jnp.asarray(lhs, compute)
    preferred = jnp.dtype(preferred_element_type or lhs.dtype)
    static = _static_for(preset, history_len, dimension_numbers, preferred, compute)
    metas = tuple(
        _overwrite_meta(
            operand_config(preset, operand, history_len),
            fp8_vars[f"{operand}_scale"],
            fp8_vars[f"{operand}_amax_history"],
            fp8_vars[f"{operand}_amax"],
        )
        for operand in OPERANDS
    )
    return _product(static, direct, lhs, rhs, metas)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the plain route


def fp8_dot(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    scaler: Fp8Scaler,
    slots: tuple[str, str, str],
    amax_sink: Any,
    *,
    preferred_element_type: Any = None,
    direct: bool = True,
) -> Any:
    """``lax.dot_general`` in FP8 with the scales of ``scaler``; the amaxes come back as the
    gradient of ``amax_sink``.

    Args:
        lhs, rhs, dimension_numbers, preferred_element_type: as ``lax.dot_general``.
        scaler: the :class:`~ampscale.fp8.Fp8Scaler` (a pytree: pass it through ``jit``).
        slots: the slots of ``(lhs, rhs, output gradient)`` in ``scaler`` (the first two
            forward, the third backward).
        amax_sink: a float32 ``(3,)`` array (zeros): its gradient is ``[amax(lhs), amax(rhs),
            amax(output gradient)]``, for ``scaler.update`` once per optimizer step. (Each use
            of the product needs its own sink, or gradients of several uses add up.)
        direct: fp8 operands into the product, or quantize-dequantized ones in float32.

    Example:
        >>> import jax, jax.numpy as jnp, ampscale.fp8 as fp8
        >>> from ampscale.fp8.jax import fp8_dot
        >>> f8 = fp8.create_fp8_scaler("te_delayed", {"x": "forward", "w": "forward", "dy": "backward"},
        ...                            backend="jax", history_len=4)
        >>> x, w = jnp.full((2, 3), 2.0), jnp.full((3, 4), 0.5)
        >>> loss = lambda x, w, sink: fp8_dot(x, w, (((1,), (0,)), ((), ())), f8, ("x", "w", "dy"), sink).sum()
        >>> amax = jax.grad(loss, argnums=2)(x, w, jnp.zeros(3))
        >>> amax.tolist()
        [2.0, 0.5, 1.0]
        >>> f8.update(amax).scales_sync()
        {'x': 224.0, 'w': 896.0, 'dy': 57344.0}
    """
    indices = [scaler.index(slot) for slot in slots]
    roles = tuple(scaler.config.roles[i] for i in indices)
    if roles != ("forward", "forward", "backward"):
        raise ValueError(
            f"slots must name a forward, a forward and a backward slot of the scaler (lhs, rhs, output "
            f"gradient); got {tuple(slots)} with roles {roles}"
        )
    sink = jnp.asarray(amax_sink)
    if sink.shape != (3,):
        raise ValueError(f"amax_sink must have shape (3,) (one value per operand); got shape {sink.shape}")
    formats = (scaler.config.slot_formats[indices[0]], scaler.config.slot_formats[indices[2]])
    if scaler.config.slot_formats[indices[1]] != formats[0]:
        raise ValueError(f"lhs and rhs slots must share one format; got {scaler.format_of(indices[1])}")
    state = scaler.state
    preferred = jnp.dtype(preferred_element_type or lhs.dtype)
    static = _Static(dimension_numbers, preferred, formats, scaler.config.storage == "inverse", jnp.dtype(rhs.dtype))
    metas = tuple(
        (lax.stop_gradient(state.scale[i]), lax.stop_gradient(state.scale_inv[i]), sink[k : k + 1])
        for k, i in enumerate(indices)
    )
    return _product(static, direct, lhs, rhs, metas)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ flax modules


def _flax_modules() -> dict[str, Any]:
    from flax import linen as nn

    class Fp8DotGeneral(nn.Module):
        """A drop-in for ``flax.linen.Fp8DirectDotGeneralOp`` (``nn.Dense(dot_general_cls=...)``)
        whose variables follow an ampscale preset and stay exact under accumulation (see
        :mod:`ampscale.fp8.jax`). ``direct=False``: as ``Fp8DotGeneralOp`` (qdq operands)."""

        amax_history_length: int = 1024
        preset: str = "flax"
        direct: bool = True
        variable_dtype: Any = jnp.float32

        @nn.compact
        def __call__(
            self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None, preferred: Any = None
        ) -> Any:
            initial = init_fp8_vars(self.preset, self.amax_history_length, self.variable_dtype)
            variables = {
                name: self.variable(OVERWRITE_WITH_GRADIENT, name, lambda value=value: value).value
                for name, value in initial.items()
            }
            compute = rhs.dtype
            lhs = jnp.asarray(lhs, compute)
            return fp8_dot_general(
                lhs,
                rhs,
                dimension_numbers,
                preferred_element_type=lhs.dtype if self.direct else None,
                fp8_vars=variables,
                preset=self.preset,
                direct=self.direct,
                compute_dtype=compute,
            )

    class Fp8QdqDotGeneral(Fp8DotGeneral):
        """:class:`Fp8DotGeneral` with ``direct=False``: the operands quantize-dequantized."""

        direct: bool = False

    return {"Fp8DotGeneral": Fp8DotGeneral, "Fp8QdqDotGeneral": Fp8QdqDotGeneral}


_built: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    # the flax modules are made on first use: importing this module must not import flax
    if name in ("Fp8DotGeneral", "Fp8QdqDotGeneral"):
        if not _built:
            _built.update(_flax_modules())
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
