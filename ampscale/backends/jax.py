"""JAX backend: jit-native, no host transfer, fused by XLA, pytrees everywhere.

Adapters' layer.

The scaler is a registered pytree: its settings are static auxiliary data (hashed once, never
leaves, so no jit round trip can drop one), its state the leaves. ``scale``, ``unscale``,
``update`` and ``step`` trace under ``jax.jit``, ``lax.scan`` and ``vmap`` and run eagerly too.

The check + unscale computes each gradient in float32 opmath (float64 for float64) and keeps
its dtype, so donated gradient buffers are reused in place. The flag is exact: it is the sum
of ``out * 0`` over every unscaled value, which is 0 when all are finite and nan otherwise (no
finite value can make it overflow), taken as an elementwise tree of additions per shape and
one reduction each. On XLA's CPU backend a reduction over the *inputs* of an in-place (donated)
multiply forces a full copy of every gradient, so the unscaled outputs are checked. For a
scale >= 1 (inverse <= 1) that is exactly the check of the inputs; below 1 a finite gradient
whose unscaled value overflows to inf is flagged as well (applying it would write inf).

On the CPU and on CUDA GPUs the check + unscale is one XLA custom call per group of leaves
(``_jax_custom_call``: ampscale's native kernels on the CPU, its multi-tensor CUDA kernel on the
GPU, in place, bit for bit the same as the XLA path), wherever the call site allows it;
``custom_call_status()`` says whether it is in use and why (not).

Agreement: sharded arrays under ``jit`` are global by construction (the reduction spans every
shard); under ``shard_map``/``pmap`` pass ``axis_name`` and the flag is reduced with ``pmin``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ampscale._after_import import when_imported
from ampscale._config import ScalerConfig, _round_to
from ampscale._core import ScalerState, initial_values
from ampscale._ops import ArrayOps, PlainNamespace
from ampscale.backends import _jax_custom_call
from ampscale.backends._base import Backend, adapter_ready
from ampscale.backends._jax_custom_call import CustomCallStatus, use_custom_call
from ampscale.backends._jax_xla import all_finite as _all_finite
from ampscale.backends._jax_xla import check_and_unscale_xla as _check_and_unscale_xla

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "BACKEND",
    "CustomCallStatus",
    "JaxBackend",
    "PackedState",
    "axis_names",
    "custom_call_status",
    "register_custom_call",
    "restore_fields",
    "use_custom_call",
    "varying_axes",
    "when_imported",
]

_IMMUTABLE = (
    "JAX arrays cannot be written in place: use a functional update (Scaler.step(update_fn, ...) keeps "
    "or discards its result on the device, jnp.where(finite, new, old) or jmp's select_tree)"
)

# ScalerState fields, split by dtype: two buffers instead of twelve. Every separate buffer a
# jitted call takes or returns costs a few microseconds on XLA's CPU runtime.
_SCALE_FIELDS = ("scale", "last_scale")
_COUNTER_FIELDS = tuple(f for f in ScalerState._fields if f not in _SCALE_FIELDS)


def custom_call_status() -> CustomCallStatus:
    """Whether the check + unscale runs as ampscale's fused XLA custom call, and why (not).

    Loads the handlers (compiling them on first use if they were not built at install) and
    reports where they came from, the CPU kernel family, whether the CUDA kernels are loaded
    for this process's GPUs (or why not), whether it is turned off, and the latest lowering's
    choice (the custom call, or the pure-XLA path and why: another platform, automatic
    sharding over several devices, ``jax.export``, ...). Shown by ``python -m ampscale info``.
    """
    return _jax_custom_call.status()


def register_custom_call() -> CustomCallStatus:
    """Register the custom call with XLA in this process (for deserialized ``jax.export`` code).

    Registers the CPU and CUDA handlers and, where JAX has CUDA devices, loads the CUDA kernels
    on each. Tracing with the JAX backend does this by itself; a process that only runs an
    exported artifact built with ``use_custom_call(in_exports=True)`` must call this first.
    """
    return _jax_custom_call.register()


class PackedState(NamedTuple):
    """The JAX backend's storage of a :class:`ampscale.ScalerState`: two arrays.

    Attributes:
        scales: ``[scale, last_scale]`` in the scale's dtype.
        counters: the ten int32 fields, in ``ScalerState`` order.
    """

    scales: Any
    counters: Any


class JaxBackend(Backend):
    """The JAX adapter."""

    name: ClassVar[str] = "jax"
    mutable_arrays: ClassVar[bool] = False  # JAX arrays cannot be written in place

    def masked_add_(self, finite: Any, targets: Sequence[Any], updates: Sequence[Any], alpha: float) -> None:
        raise TypeError(_IMMUTABLE)

    def masked_copy_(self, finite: Any, targets: Sequence[Any], values: Sequence[Any]) -> None:
        raise TypeError(_IMMUTABLE)

    # -- arrays and trees -------------------------------------------------------------------
    def owns(self, value: Any) -> bool:
        return isinstance(value, jax.Array)

    def owns_type(self, kind: type) -> bool:
        return issubclass(kind, jax.Array) or issubclass(kind, jax.core.Tracer)

    def is_floating_dtype(self, dtype: Any) -> bool:
        return bool(jnp.issubdtype(dtype, jnp.floating))

    def validate(self, leaves: Sequence[Any], spec: Any, what: str = "gradient") -> set[Any] | None:
        dtypes = super().validate(leaves, spec, what)
        # Eagerly, leaves committed to different devices cannot meet in one computation: say so
        # here, naming the devices, rather than let XLA fail later. (Traced values have none.)
        placements = {
            frozenset(leaf.devices())
            for leaf in leaves
            if not isinstance(leaf, jax.core.Tracer) and getattr(leaf, "committed", False)
        }
        if len(placements) > 1:
            names = sorted(str(d) for group in placements for d in group)
            raise ValueError(
                f"{what}s are committed to different devices ({', '.join(names)}); one call takes arrays "
                "on one device or with one sharding: jax.device_put them together first"
            )
        return dtypes

    def flatten(self, tree: Any) -> tuple[list[Any], Any]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return leaves, treedef

    def unflatten(self, spec: Any, leaves: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(spec, leaves)

    def leaf_paths(self, spec: Any) -> list[str]:
        dummy = jax.tree_util.tree_unflatten(spec, [0] * spec.num_leaves)
        return [jax.tree_util.keystr(path) or "<root>" for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]

    def namespace(self) -> Any:
        return jnp

    def has_float64(self, like: Any) -> bool:
        return bool(jax.config.jax_enable_x64)

    def device_of(self, like: Any) -> Any:
        return None  # let JAX place constants and state (and follow shardings under jit)

    def is_tracing(self, value: Any) -> bool:
        return isinstance(value, jax.core.Tracer)

    def host_callback(self, fn: Callable[..., None], *args: Any, setting: str = "") -> None:
        """Call ``fn(*args)`` on the host when the traced computation runs.

        ``setting`` names what asked for the callback (``on_floor='warn'``): a host callback
        cannot be part of a ``jax.export`` artifact, and the export then fails naming it rather
        than with JAX's generic refusal.
        """
        first, *rest = args
        jax.debug.callback(fn, _no_export(first, setting), *rest)

    # -- the fused hot path -----------------------------------------------------------------
    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        leaves = list(leaves)
        if inv_scale is None:
            return leaves, self.all_finite(leaves)
        if _eager(leaves) and not isinstance(inv_scale, jax.core.Tracer):
            # One compiled computation (cached by jit per tree of shapes and dtypes) rather than
            # op-by-op dispatch, which compiles a small program per op and distinct shape. The
            # custom call setting is part of the cache key, so turning it off takes effect.
            outs, finite = _check_and_unscale_jit(leaves, inv_scale, _jax_custom_call.enabled())
            return list(outs), finite
        return _check_and_unscale(leaves, inv_scale)

    def all_finite(self, leaves: Sequence[Any]) -> Any:
        leaves = list(leaves)
        if _eager(leaves):
            return _all_finite_jit(leaves)
        return _all_finite(leaves)

    def check_unscale_and_count(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any, Any]:
        leaves = list(leaves)
        total = sum(int(x.size) for x in leaves)
        tiny = jnp.float32(0)
        for x in leaves:
            tiny = tiny + jnp.sum(jnp.abs(x) < jnp.finfo(x.dtype).smallest_normal, dtype=jnp.float32)
        out, finite = self.check_and_unscale(leaves, inv_scale)
        return out, finite, tiny / max(total, 1)

    def count_nonfinite(self, leaves: Sequence[Any]) -> list[tuple[int, int, int]]:
        return [
            (int(jnp.sum(jnp.isnan(x))), int(jnp.sum(jnp.isposinf(x))), int(jnp.sum(jnp.isneginf(x)))) for x in leaves
        ]

    # -- state ------------------------------------------------------------------------------
    def make_state(
        self, values: ScalerState, config: ScalerConfig, like: Any = None, previous: Any = None
    ) -> PackedState:
        ops = self.ops(config, None)
        if ops.config is not config:  # a float32 stand-in for a float64 scale: exact values only
            for name in _SCALE_FIELDS:
                value = float(getattr(values, name))
                if _round_to(value, "float32") != value:
                    raise ValueError(
                        f"{name}={value!r} of a scale_dtype='float64' state is not exactly a float32, and "
                        "this JAX has no float64 (jax.config.update('jax_enable_x64', True) to load it)"
                    )
        return PackedState(
            jnp.asarray([getattr(values, f) for f in _SCALE_FIELDS], dtype=ops.storage),
            jnp.asarray([getattr(values, f) for f in _COUNTER_FIELDS], dtype=jnp.int32),
        )

    def unpack(self, state: Any) -> ScalerState:
        if isinstance(state, ScalerState):
            return state
        scales, counters = state
        if not isinstance(scales, jax.core.Tracer) and not isinstance(counters, jax.core.Tracer):
            return ScalerState(*_unpack_jit(scales, counters))  # one dispatch, not twelve
        return ScalerState(*_unpack(scales, counters))

    def scale_of(self, state: Any) -> Any:
        if isinstance(state, ScalerState):
            return state.scale
        return _scale_jit(state[0]) if not isinstance(state[0], jax.core.Tracer) else state[0][..., 0]

    def run_transition(
        self, config: ScalerConfig, state: Any, finite: Any, loss_finite: Any, ops: Any
    ) -> tuple[Any, ScalerState | None, Any]:
        traced = any(isinstance(v, jax.core.Tracer) for v in (*state, finite, loss_finite))
        if traced or isinstance(state, ScalerState):
            return super().run_transition(config, state, finite, loss_finite, ops)
        # Eager: the whole transition as one cached computation per config, rather than some
        # sixty ops dispatched (and each compiled on first use) one by one.
        loss_ok = None if loss_finite is None else jnp.asarray(loss_finite, dtype=jnp.bool_)
        new_state, floor_event = _transition_jit(config, state, jnp.asarray(finite, dtype=jnp.bool_), loss_ok)
        return new_state, None, floor_event

    def pack(self, fields: ScalerState) -> PackedState:
        return PackedState(
            jnp.stack([getattr(fields, f) for f in _SCALE_FIELDS], axis=-1),
            jnp.stack([getattr(fields, f) for f in _COUNTER_FIELDS], axis=-1),
        )

    def public_state(self, state: Any, config: ScalerConfig) -> ScalerState:
        return self.unpack(state)

    def ops(self, config: ScalerConfig, state: Any) -> ArrayOps:
        key = f"jax:x64={jax.config.jax_enable_x64}"
        ops = config._cache.get(key)
        if ops is None:
            # Cached on the config, so it outlives the trace that may build it: its constants
            # are NumPy values (_TRANSITION_XP), never JAX arrays, which under jit, pmap or
            # shard_map would be values of that one trace (bound to its mesh).
            ops = config._cache[key] = ArrayOps(config, _TRANSITION_XP, None, self.has_float64(None))
        return ops  # type: ignore[no-any-return]

    def read_state(self, state: Any) -> ScalerState:
        import numpy as np

        scales, counters = (np.asarray(a) for a in state)  # two transfers, explicitly
        fields = {f: float(scales[..., i]) for i, f in enumerate(_SCALE_FIELDS)}
        fields.update({f: int(counters[..., i]) for i, f in enumerate(_COUNTER_FIELDS)})
        return ScalerState(**fields)

    # -- small helpers ----------------------------------------------------------------------
    def multiply_by_scale(self, loss: Any, scale: Any) -> Any:
        return loss * jnp.asarray(scale, dtype=jnp.float32)

    def inverse_scale(self, scale: Any) -> Any:
        wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        return (1 / scale.astype(wide)).astype(jnp.float32)

    def logical_and(self, a: Any, b: Any) -> Any:
        return jnp.logical_and(a, b)

    def as_bool(self, value: Any, like: Any = None) -> Any:
        if isinstance(value, bool):
            return jnp.asarray(value)
        return jnp.asarray(value, dtype=jnp.bool_)

    def apply_if(
        self,
        finite: Any,
        update_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
        params: Any,
        grads: Any,
        opt_state: Any,
        *,
        flat: Any = None,
    ) -> tuple[Any, Any]:
        if not isinstance(finite, jax.core.Tracer):
            # Eager: lax.cond would trace and compile both branches on every call (its cache is
            # keyed on the branch functions, new closures each step), ~0.3 s a step. The default
            # instead runs the update op by op and selects leaf by leaf (select_tree): no
            # compilation, no host read, and on a skipped step the returned leaves equal the
            # inputs bitwise. Like cond, this returns every leaf as an array.
            return super().apply_if(finite, update_fn, params, grads, opt_state, flat=flat)
        # lax.cond: the update is not computed on an overflowing step (a select under vmap);
        # the skipped branch returns the inputs themselves, bitwise.
        result: tuple[Any, Any] = jax.lax.cond(
            finite,
            lambda p, g, s: update_fn(p, g, s),
            lambda p, g, s: (p, s),
            params,
            grads,
            opt_state,
        )
        return result

    def select_tree(self, condition: Any, on_true: Any, on_false: Any, flat_on_false: Any = None) -> Any:
        # eagerly one cached computation per tree structure, rather than a dispatch per leaf
        select = _select if isinstance(condition, jax.core.Tracer) else _select_jit
        return select(condition, on_true, on_false)

    def agree(self, finite: Any, group: Any) -> Any:
        if group is None:
            return finite
        if callable(group):
            return self.as_bool(group(finite))
        return self._agree(finite, group)

    def agree_flags(self, finite: Any, loss_finite: Any, group: Any) -> tuple[Any, Any]:
        if group is None or callable(group):
            return super().agree_flags(finite, loss_finite, group)
        # one reduction of both flags: a pmin over a 2-vector
        both = self._agree(jnp.stack([jnp.asarray(finite), jnp.asarray(loss_finite)]), group)
        return both[0], both[1]

    def _agree(self, flags: Any, group: Any) -> Any:
        """``flags`` (bools, any shape) agreed with ``pmin`` over the axes of ``group`` and every
        mesh axis they still vary over, so that every device ends with the same flags: false if
        any device had an overflow. Under ``shard_map`` on a data x model mesh, a flag agreed
        over ``"data"`` alone still differs between model shards; the axes it varies over come
        from its type (``shard_map``'s varying manual axes)."""
        axes = set(axis_names(group)) | varying_axes(flags)
        if not axes:
            return flags
        ordered = tuple(sorted(axes, key=str))
        return jax.lax.pmin(flags.astype(jnp.int32), ordered if len(ordered) > 1 else ordered[0]).astype(jnp.bool_)

    # -- the Scaler as a pytree -------------------------------------------------------------
    def adopt_scaler(self, scaler_type: type[Any], pending_type: type[Any]) -> None:
        """Register the scaler classes as JAX pytrees: settings static, the state the leaves.

        ``pending_type`` is the scaler loaded before its backend was known (host values in
        ``_values``); both unflatten to ``scaler_type``.
        """

        def flatten(scaler: Any) -> tuple[tuple[Any, ...], tuple[ScalerConfig, str]]:
            state = scaler._state
            if state is None:
                values = scaler._values if isinstance(scaler, pending_type) else initial_values(scaler.config)
                state = self.make_state(values, scaler.config)
            elif isinstance(state, ScalerState):
                state = self.pack(state)
            return tuple(state), (scaler.config, "jax")

        def flatten_with_keys(scaler: Any) -> tuple[tuple[Any, ...], tuple[ScalerConfig, str]]:
            leaves, aux = flatten(scaler)
            keys = [jax.tree_util.GetAttrKey(name) for name in PackedState._fields]
            return tuple(zip(keys, leaves, strict=True)), aux

        def unflatten(aux: tuple[ScalerConfig, str], leaves: Any) -> Any:
            config, _ = aux
            return scaler_type(config, PackedState(*leaves), self)

        for cls in (scaler_type, pending_type):
            jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        _jax_custom_call.register_export_serialization(scaler_type, pending_type)  # jax.export artifacts

        def serialize(serialization: Any) -> None:
            """``flax.serialization`` (``to_state_dict``, ``to_bytes``, msgpack checkpoints): the
            two leaves by their pytree names, restored into a scaler with the target's settings."""

            def to_state(scaler: Any) -> dict[str, Any]:
                leaves, _ = flatten(scaler)
                return {k: serialization.to_state_dict(v) for k, v in zip(PackedState._fields, leaves, strict=True)}

            def from_state(target: Any, state: dict[str, Any]) -> Any:
                template = PackedState(*flatten(target)[0])
                values = restore_fields(serialization, type(target).__name__, template._asdict(), state)
                restored = []
                for name, like in template._asdict().items():
                    value = np.asarray(values[name])
                    if value.shape[-1:] != like.shape[-1:] or value.dtype.kind != np.dtype(like.dtype).kind:
                        raise ValueError(
                            f"{name} of a scaler's state must be a {np.dtype(like.dtype).name} array of shape "
                            f"{tuple(like.shape)}; got {value.dtype.name} {value.shape} at path "
                            f"{serialization.current_path()}"
                        )
                    restored.append(jnp.asarray(value, dtype=like.dtype))
                return scaler_type(target.config, PackedState(*restored), self)

            for cls in (scaler_type, pending_type):
                serialization.register_serialization_state(cls, to_state, from_state, override=True)

        when_imported("flax.serialization", serialize)


def restore_fields(serialization: Any, owner: str, template: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """``flax.serialization``'s restore of named fields: each field of ``template`` from
    ``state``, with flax's errors for a missing or an unknown field (naming the path)."""
    state = dict(state)
    out = {}
    for name, value in template.items():
        if name not in state:
            raise ValueError(
                f"Missing field {name} in state dict while restoring an instance of {owner}, at path "
                f"{serialization.current_path()}"
            )
        out[name] = serialization.from_state_dict(value, state.pop(name), name=name)
    if state:
        raise ValueError(
            f'Unknown field(s) "{",".join(map(str, state))}" in state dict while restoring an instance of '
            f"{owner} at path {serialization.current_path()}"
        )
    return out


def axis_names(group: Any) -> tuple[Any, ...]:
    """The mapped axis names of ``group``: a name, or a tuple or list of names."""
    if group is None:
        return ()
    if isinstance(group, (tuple, list)):
        return tuple(group)
    return (group,)


def varying_axes(value: Any) -> set[Any]:
    """The manual mesh axes ``value`` varies over under ``shard_map`` (empty elsewhere, and
    under ``shard_map(..., check_vma=False)``, where JAX records none)."""
    aval = jax.typeof(value) if isinstance(value, (jax.Array, jax.core.Tracer)) else None
    return set(getattr(getattr(aval, "mat", None), "varying", ()) or ())


#: jax.numpy for the transition's operations, NumPy for its constants (see JaxBackend.ops).
_TRANSITION_XP = PlainNamespace(
    jnp, jnp.bool_, lambda x, dtype: jnp.astype(x, dtype), lambda value, dtype, _device: np.asarray(value, dtype=dtype)
)


def _unpack(scales: Any, counters: Any) -> tuple[Any, ...]:
    # index the last axis: a state batched by vmap (or stacked by the user) unpacks too
    fields = {f: scales[..., i] for i, f in enumerate(_SCALE_FIELDS)}
    fields.update({f: counters[..., i] for i, f in enumerate(_COUNTER_FIELDS)})
    return tuple(fields[f] for f in ScalerState._fields)


_unpack_jit = jax.jit(_unpack)
_scale_jit = jax.jit(lambda scales: scales[..., 0])
assert _SCALE_FIELDS[0] == "scale"


@functools.partial(jax.jit, static_argnums=0)
def _transition_jit(config: ScalerConfig, state: Any, finite: Any, loss_finite: Any) -> tuple[Any, Any]:
    """The shared device transition (``Backend.run_transition``), traced once per config."""
    new_state, _fields, floor_event = Backend.run_transition(
        BACKEND, config, state, finite, loss_finite, BACKEND.ops(config, None)
    )
    return new_state, floor_event


def _select(condition: Any, on_true: Any, on_false: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


_select_jit = jax.jit(_select)


def _eager(leaves: list[Any]) -> bool:
    """Whether no leaf is being traced (so the call runs op by op unless jitted here)."""
    return bool(leaves) and not any(isinstance(x, jax.core.Tracer) for x in leaves)


def _check_and_unscale(leaves: list[Any], inv_scale: Any, custom_call: bool = True) -> tuple[list[Any], Any]:
    """The custom call (CPU or CUDA) where it can run (see ``_jax_custom_call``), else the XLA path."""
    if custom_call:
        fused = _jax_custom_call.check_and_unscale(leaves, inv_scale)
        if fused is not None:
            return fused
    return _check_and_unscale_xla(leaves, inv_scale)


_check_and_unscale_jit = jax.jit(_check_and_unscale, static_argnums=2)
_all_finite_jit = jax.jit(_all_finite)


BACKEND = JaxBackend()
adapter_ready(BACKEND)  # the scaler's layer registers its classes as pytrees (adopt_scaler)


# -- a host callback refused in jax.export, by name ---------------------------------------------

_NO_EXPORT: list[Any] = []  # the primitive, made on first use (JAX's internals load lazily)


def _no_export(value: Any, setting: str) -> Any:
    """``value`` unchanged, through a primitive whose lowering for ``jax.export`` raises.

    JAX refuses a host callback when it exports (``NotImplementedError: serialization of
    host_callbacks is not yet implemented``), which names neither the setting behind it nor a
    way out. The callback's first argument passes through this identity, whose lowering knows
    whether it is lowered for an export (XLA drops it: it costs nothing).
    """
    if not _NO_EXPORT:
        _NO_EXPORT.append(_make_no_export_primitive())
    return _NO_EXPORT[0].bind(value, setting=setting)


def _make_no_export_primitive() -> Any:
    from jax._src import dispatch
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir

    primitive = Primitive("ampscale_host_callback_guard")
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(lambda aval, setting: aval)

    def lower(ctx: Any, value: Any, setting: str) -> list[Any]:
        if _jax_custom_call._for_export(ctx):
            raise ValueError(
                f"jax.export cannot hold this scaler's {setting}: reacting when the scale is stuck at its "
                "floor calls back into Python (a host callback), which an exported artifact cannot "
                "contain. Export a scaler created with on_floor='ignore' (its state still counts the "
                "overflows at the floor: scaler.state.floor_overflows), and react to that count where "
                "the artifact runs"
            )
        return [value]

    # Uncacheable: the same computation is lowered for jit (allowed) and for export (refused).
    mlir.register_lowering(primitive, lower, cacheable=False)

    def batch(args: Sequence[Any], dims: Sequence[int | None], setting: str) -> tuple[Any, int | None]:
        return primitive.bind(*args, setting=setting), dims[0]

    batching.primitive_batchers[primitive] = batch
    return primitive
