"""jmp's loss scales on ampscale (framework helpers' layer; public as :mod:`ampscale.jax`).

``jmp.NoOpLossScale``, ``StaticLossScale`` and ``DynamicLossScale``, with jmp's constructors,
fields, methods, pytree structure, warnings and dtypes, driven by ampscale: ``adjust`` runs the
jmp preset's transition, ``unscale`` (for the float32 scales jmp's docs use) the JAX backend's
check + unscale, and ``all_finite`` its exact flag. ``import ampscale.jax as jmp`` ports a jmp
program; jmp's precision policies (``get_policy``, ...) are jmp's own, forwarded by
:mod:`ampscale.jax`, which re-exports everything here under its own name (reprs, pickles).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from ampscale._config import as_float, make_config, shown
from ampscale._core import INT_FIELDS, ScalerState, initial_values, transition
from ampscale.backends.jax import BACKEND

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "all_finite", "select_tree"]

T = TypeVar("T")

#: jmp's policy API, forwarded from jmp itself by this module's ``__getattr__``
_JMP_POLICY_NAMES = ("Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype")
_NARROW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_UNSCALED_BY_KERNEL = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _dtype_of(value: Any) -> Any:
    """The canonical dtype JAX gives ``value`` (a Python number: its default dtype)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return jnp.result_type(value)
    return jax.dtypes.canonicalize_dtype(dtype)


def _warn_if_not_floating(value: Any, name: str) -> None:
    """jmp's warning for a loss scale that is not a floating value (``UserWarning``)."""
    if not isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray, np.generic, numbers.Number)):
        # what JAX and orbax put in a pytree while they build its structure (object(), abstract
        # values, SaveArgs, restore templates): no value to warn about (jmp's check skips the
        # first and raises on the others, which JAX catches and orbax does not)
        return
    dtype = _dtype_of(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        # jmp's warning, from one place, as jmp's is: shown once per process by default
        warnings.warn(f"Expected floating type for {name}, got {dtype}")  # noqa: B028


def _is_strong_float32(value: Any) -> bool:
    """Whether ``value`` is a float32 array or NumPy scalar (not weakly typed): jmp's scale then
    unscales every floating leaf exactly as ampscale's kernel does (``x * (1 / scale)``)."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        aval = jax.typeof(value)
        return aval.dtype == np.float32 and not aval.weak_type and aval.shape == ()
    return isinstance(value, (np.ndarray, np.generic)) and value.dtype == np.float32 and value.shape == ()


def _unscale_tree(tree: Any, loss_scale: Any) -> Any:
    """jmp's ``tree_map(lambda x: x * (1 / loss_scale), tree)``, bit for bit and dtype for dtype.

    With a float32 scale, the floating JAX leaves go through the backend's check + unscale (float16
    and bfloat16 ones promoted to float32, as jmp's multiply promotes them); every other leaf,
    and every leaf under another scale (a Python number, a weakly typed or narrower one), is
    multiplied as jmp multiplies it.
    """
    inverse = 1 / loss_scale
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    kernel = []
    if _is_strong_float32(loss_scale):
        kernel = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, (jax.Array, jax.core.Tracer))
            and np.dtype(x.dtype) in _UNSCALED_BY_KERNEL
            and not jax.typeof(x).weak_type  # jmp's product of a weak leaf is a strong float32
        ]
    out = [None] * len(leaves)
    if kernel:
        chosen = BACKEND.promote([leaves[i] for i in kernel])
        inv = BACKEND.inverse_scale(jnp.asarray(loss_scale))
        unscaled, _finite = BACKEND.check_and_unscale(chosen, inv)
        for i, x in zip(kernel, unscaled, strict=True):
            out[i] = x
    for i, x in enumerate(leaves):
        if out[i] is None:
            out[i] = x * inverse
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """``jmp.NoOpLossScale``: no scaling; ``scale`` and ``unscale`` return their argument itself.

    A pytree without leaves, as jmp's.
    """

    @property
    def loss_scale(self) -> int:
        """``1``, as in jmp."""
        return 1

    def scale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def unscale(self, tree: T) -> T:
        """``tree`` itself."""
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """This loss scale (nothing to adjust)."""
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """``jmp.StaticLossScale``: scales and unscales by a fixed constant.

    A pytree without leaves (the loss scale is part of its structure), as jmp's.

    Attributes:
        loss_scale: the constant (any number or 0-d array).
    """

    loss_scale: Any

    def scale(self, tree: T) -> T:
        """Every leaf multiplied by :attr:`loss_scale` (JAX's promotion: a float32 array scale
        makes float16 leaves float32; a Python number keeps each leaf's dtype)."""
        return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)  # type: ignore[no-any-return]

    def unscale(self, tree: T) -> T:
        """Every leaf multiplied by ``1 / loss_scale`` (with the same promotion)."""
        return _unscale_tree(tree, self.loss_scale)  # type: ignore[no-any-return]

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """This loss scale (a static one does not change)."""
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """``jmp.DynamicLossScale``, driven by ampscale's scaler (``preset="jmp"``).

    Every ``period`` finite steps in a row the scale is multiplied by ``factor`` (unless that
    overflows its dtype); on a non-finite step it is divided by ``factor``, never below
    ``min_loss_scale``, and the counter restarts. Same constructor, fields, methods, pytree
    structure and results, bit for bit and dtype for dtype, as jmp's; a jmp checkpoint restores
    into it and back. Port a jmp program by its import::

        # import jmp
        import ampscale.jax as jmp

    The pytree is jmp's exactly: the leaves are ``loss_scale`` and ``counter`` (in that order,
    unnamed), the static structure is ``(period, factor)``, and ``min_loss_scale`` is in neither:
    as in jmp, a loss scale that crosses a ``jit``, ``pmap``, ``scan``, ``cond`` or
    ``tree_map`` boundary comes back with the default floor of 1, so a floor other than 1 holds
    only where ``adjust`` is called on the object that was built with it (inside the trace
    that built it, or eagerly). For a floor that survives every round trip use
    ``ampscale.create_scaler(preset="jmp", min_scale=...)``.

    Where jmp's arithmetic would leave the finite range, ampscale's does not: a
    ``min_loss_scale`` of 0 (or below float32's smallest normal value) stops the scale at that
    smallest normal value, where jmp's reaches 0 and every later step overflows.

    Attributes:
        loss_scale: the current scale (a float32 array, as jmp's docs build it; any floating
            value: float16 and bfloat16 ones follow jmp's arithmetic in their dtype, float64
            under ``jax_enable_x64``). A value that is not floating warns, as in jmp, each time
            one is built (pytree unflattens included).
        counter: finite steps counted towards the next growth (int32).
        period: finite steps in a row between growths (a whole number >= 1).
        factor: the growth factor; the backoff divides by it (>= 1; 1 never moves the scale).
        min_loss_scale: the floor of the scale (any value, traced ones included).

    Raises:
        ValueError: ``period``, ``factor`` or a concrete ``min_loss_scale`` out of range (the
            message names it).

    Example:
        >>> import jax.numpy as jnp
        >>> import ampscale.jax as jmp
        >>> loss_scale = jmp.DynamicLossScale(jnp.float32(2**15), period=2)
        >>> grads = loss_scale.unscale({"w": jnp.full(2, 2.0**15)})
        >>> loss_scale = loss_scale.adjust(jmp.all_finite(grads))
        >>> grads["w"].tolist(), int(loss_scale.counter)
        ([1.0, 1.0], 1)
        >>> float(loss_scale.adjust(jnp.bool_(True)).loss_scale)
        65536.0
    """

    loss_scale: Any
    counter: Any = dataclasses.field(default_factory=lambda: np.zeros([], np.int32))
    period: int = 2000
    factor: int = 2
    min_loss_scale: Any = dataclasses.field(default_factory=lambda: np.ones([], np.float32))

    def __post_init__(self) -> None:
        _warn_if_not_floating(self.loss_scale, "loss_scale")
        _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
        _check_jmp_settings(self.period, self.factor, self.min_loss_scale)

    def scale(self, tree: T) -> T:
        """Every leaf multiplied by :attr:`loss_scale` (JAX's promotion)."""
        return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)  # type: ignore[no-any-return]

    def unscale(self, tree: T) -> T:
        """Every leaf multiplied by ``1 / loss_scale``, as jmp's (float16 leaves become float32
        with a float32 scale); with a float32 scale through ampscale's check + unscale."""
        return _unscale_tree(tree, self.loss_scale)  # type: ignore[no-any-return]

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """jmp's flatten: the leaves ``(loss_scale, counter)`` and the static ``(period, factor)``
        (``min_loss_scale`` is in neither, as in jmp)."""
        return (self.loss_scale, self.counter), (self.period, self.factor)

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, Any], data: Sequence[Any]) -> DynamicLossScale:
        """jmp's unflatten: a new loss scale with the default ``min_loss_scale`` (built through
        the constructor, so its warnings come again, as jmp's do)."""
        loss_scale, counter = data
        period, factor = meta
        return cls(loss_scale, counter, period, factor)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were finite (a 0-d bool).

        Raises:
            AssertionError: ``grads_finite`` is not 0-d (jmp's check).
            TypeError: ``loss_scale`` and ``min_loss_scale`` have dtypes jmp cannot combine
                (jmp's ``lax.select`` error).
        """
        assert grads_finite.ndim == 0, "Expected boolean scalar"
        floor = self.min_loss_scale
        scale_type, counter_type = _jmp_types(
            self.loss_scale, floor, self.counter, grads_finite, self.period, self.factor
        )
        dtype = np.dtype(scale_type.dtype)
        config = _jmp_config(self.period, self.factor, dtype)
        args = (self.loss_scale, self.counter, grads_finite, floor)
        # Compiled, XLA divides by a constant factor by multiplying with its reciprocal (jmp's
        # adjust under jit does too); op by op it divides. The two differ only for a factor that
        # is not a power of two, where an eager call runs op by op, as jmp's eager call does.
        eager_exact = config is None or _is_power_of_two(float(config.growth_value))
        traced = any(isinstance(a, jax.core.Tracer) for a in args)
        adjust = _jmp_adjust_jit if not traced and eager_exact else _jmp_adjust
        scale, counter = adjust(config, *args, dtype, int(self.period))
        # through the constructor, as jmp's adjust: the same warnings, the same checks
        return DynamicLossScale(
            _typed(scale, scale_type), _typed(counter, counter_type), self.period, self.factor, floor
        )


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007 - jmp's alias


def _check_jmp_settings(period: Any, factor: Any, floor: Any) -> None:
    """Refuse the settings under which jmp's own arithmetic breaks (before anything runs)."""
    real = isinstance(period, numbers.Real) and not isinstance(period, bool)
    if not real or not math.isfinite(as_float(period)) or float(period) != int(float(period)) or float(period) < 1:
        # jmp takes them: 0 divides the counter by zero and never grows, a fraction never grows
        raise ValueError(f"period must be a whole number >= 1 (finite steps between growths); got {shown(period)}")
    real = isinstance(factor, numbers.Real) and not isinstance(factor, bool)
    if not real or not (math.isfinite(as_float(factor)) and float(factor) >= 1):
        # jmp takes them: below 1 every overflow grows the scale, until it is inf or 0
        raise ValueError(
            f"factor must be a finite number >= 1 (the growth factor; backoff divides by it, and "
            f"1 never moves the scale); got {shown(factor)}"
        )
    if not isinstance(floor, (np.ndarray, np.generic, numbers.Real)) or isinstance(floor, bool):
        # a JAX array is not read on the host here (a sync on every adjust): adjust ignores a nan
        # floor and stops an infinite one at the largest finite value, on the device
        return
    value = np.asarray(floor)
    if value.shape == () and value.dtype.kind == "f" and not np.isfinite(value):
        # jmp takes it: a nan floor makes the scale nan, an infinite one inf, at the first overflow
        raise ValueError(f"min_loss_scale must be a finite number (the floor of the scale); got {shown(floor)}")


def _is_jax(value: Any) -> bool:
    return isinstance(value, (jax.Array, jax.core.Tracer))


def _aval(value: Any) -> jax.ShapeDtypeStruct:
    """The abstract value of a JAX array: dtype, shape and weak type."""
    aval = jax.typeof(value)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _jmp_types(scale: Any, floor: Any, counter: Any, finite: Any, period: Any, factor: Any) -> tuple[Any, Any]:
    """The dtypes (and weak types) jmp's ``adjust`` gives the scale and the counter.

    The grown scale has the scale's type, the backed-off one that of ``maximum(min_loss_scale,
    scale / factor)``, and the two must agree (jmp selects between them with ``lax.select``,
    which raises jmp's ``TypeError`` otherwise); the counter's is that of ``((counter + 1) %
    period) * finite``. NumPy and Python values take part as themselves (jmp computes with them
    on the host before JAX sees them), JAX arrays by their abstract values; the latter case,
    every step after the first, is cached.
    """
    values = (scale, floor, counter, finite)
    if all(_is_jax(v) for v in values):
        return _jmp_types_cached(*(_aval(v) for v in values), period, factor)
    traced = [i for i, v in enumerate(values) if _is_jax(v)]

    def types(*args: Any) -> tuple[Any, Any]:
        scale, floor, counter, finite = (args[traced.index(i)] if i in traced else v for i, v in enumerate(values))
        return _jmp_type_rule(scale, floor, counter, finite, period, factor)

    return jax.eval_shape(types, *(_aval(values[i]) for i in traced))  # type: ignore[no-any-return]


def _jmp_type_rule(scale: Any, floor: Any, counter: Any, finite: Any, period: Any, factor: Any) -> tuple[Any, Any]:
    grown = jax.lax.select(jnp.asarray(counter == period - 1), scale * factor, scale)
    new_scale = jax.lax.select(finite, grown, jnp.maximum(floor, scale / factor))
    return new_scale, ((counter + 1) % period) * finite


@functools.lru_cache(maxsize=256)
def _jmp_types_cached(*args: Any) -> tuple[Any, Any]:
    return jax.eval_shape(lambda *v: _jmp_type_rule(*v, *args[4:]), *args[:4])  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _jmp_config(period: Any, factor: Any, dtype: Any) -> Any:
    """The ``jmp`` preset's settings for a loss scale of ``dtype`` (float16 and bfloat16 scales
    run in float32, with the factor rounded to their dtype, as jmp's multiply rounds it);
    ``None`` for a factor of 1, which never moves the scale (the preset's growth is > 1).

    The floor is not a setting: it is an operand of :func:`_jmp_adjust` (jmp's
    ``min_loss_scale`` may be traced), applied after the transition, whose own floor is the
    smallest normal value of the scale's storage dtype.
    """
    wide = np.dtype(dtype) == np.float64
    if np.dtype(dtype) in _NARROW:
        factor = float(np.asarray(factor, dtype))
    if float(factor) == 1.0:
        return None
    return make_config(
        "jmp",
        init_scale=1.0,
        growth_interval=int(period),
        growth_factor=float(factor),
        min_scale=None,
        scale_dtype="float64" if wide else "float32",
        factor_precision="float64" if wide else "float32",
    )


def _is_power_of_two(value: float) -> bool:
    return math.frexp(value)[0] == 0.5


def _jmp_adjust(
    config: Any, loss_scale: Any, counter: Any, finite: Any, floor: Any, dtype: Any, period: int
) -> tuple[Any, Any]:
    """One step of the jmp preset's transition from jmp's two leaves and its floor; the new
    ``(scale, counter)``.

    The transition backs off to ``max(scale / factor, smallest normal)``; jmp's floor is then
    ``max(min_loss_scale, that)``, which is jmp's ``max(min_loss_scale, scale / factor)`` for
    every floor at or above the smallest normal value. A traced floor that is nan is ignored
    and an infinite one stops at the largest finite value (a concrete one is refused at
    construction), so the scale never becomes nan or inf.
    """
    wide = dtype == np.float64 or (config is not None and config.scale_dtype == "float64")
    storage = jnp.float64 if wide else jnp.float32
    scale = jnp.asarray(loss_scale, storage)
    finite = jnp.asarray(finite, jnp.bool_)
    if config is None:  # factor 1: jmp's scale * 1 and scale / 1 leave it as it is
        new_scale = scale
        new_counter = jnp.where(finite, (jnp.asarray(counter, jnp.int32) + 1) % period, 0).astype(jnp.int32)
    else:
        ops = BACKEND.ops(config, None)
        values = initial_values(config)
        fields = ScalerState(
            *(
                jnp.asarray(v, dtype=jnp.int32 if f in INT_FIELDS else storage)
                for f, v in zip(ScalerState._fields, values, strict=True)
            )
        )
        fields = fields._replace(scale=scale, last_scale=scale, growth_tracker=jnp.asarray(counter, jnp.int32))
        new, _floor_event = transition(ops.config, fields, finite, True, ops)
        new_scale, new_counter = new.scale, new.growth_tracker
        if dtype in _NARROW:
            # jmp grows in the scale's own dtype and keeps the old scale where that overflows it
            narrow = new_scale.astype(dtype)
            new_scale = jnp.where(jnp.isinf(narrow) & ~jnp.isinf(scale), scale, new_scale)
    bounded = jnp.minimum(jnp.asarray(floor, storage), jnp.finfo(storage).max)
    new_scale = jnp.where(finite, new_scale, jnp.fmax(bounded, new_scale))
    return new_scale, new_counter


_jmp_adjust_jit = jax.jit(_jmp_adjust, static_argnums=(0, 5, 6))


def _typed(value: Any, aval: Any) -> Any:
    """``value`` converted to ``aval``'s dtype and weak type."""
    out = jnp.asarray(value).astype(aval.dtype)
    if aval.weak_type:
        from jax._src.lax.lax import _convert_element_type

        out = _convert_element_type(out, aval.dtype, weak_type=True)
    return out


def all_finite(tree: Any) -> Any:
    """``jmp.all_finite``: a 0-d bool array, whether every element of every leaf is finite.

    Floating JAX arrays are checked by ampscale's exact flag (fused by XLA); any other leaf (an
    integer array, a NumPy array, a Python number) as jmp checks it. An empty tree is finite.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.array(True)
    checked = [
        x for x in leaves if isinstance(x, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    flags = [BACKEND.all_finite(checked)] if checked else []
    flags += [jnp.all(jnp.isfinite(x)) for x in leaves if not any(x is y for y in checked)]
    return jnp.stack(flags).all()


def select_tree(pred: Any, a: T, b: T) -> T:
    """``jmp.select_tree``: ``a`` where the 0-d bool ``pred`` is true, else ``b``, leaf by leaf
    (``lax.select``: the two trees' leaves must have the same shapes and dtypes).

    Raises:
        AssertionError: ``pred`` is not a 0-d bool array (jmp's check).
    """
    assert pred.ndim == 0 and pred.dtype == jnp.bool_, "expected boolean scalar"  # noqa: PT018 - jmp's message
    return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)  # type: ignore[no-any-return]


def _register_jmp_classes() -> None:
    for cls in (NoOpLossScale, StaticLossScale):  # no leaves: the object is its own structure
        jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)
    # jmp's registration: its tree_flatten / tree_unflatten, without keys (the leaves' paths are
    # their indices, 0 and 1)
    jax.tree_util.register_pytree_node_class(DynamicLossScale)


_register_jmp_classes()
