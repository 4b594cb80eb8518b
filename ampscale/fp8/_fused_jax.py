"""The fused FP8 pass on JAX arrays (see :mod:`ampscale.fp8._fused`), traceable under ``jit``.

Two primitives, ``ampscale_fp8_amax`` and ``ampscale_fp8_amax_cast``, each lowered per platform:

* on the CPU, to the XLA FFI custom calls ``ampscale_fp8_amax_v1`` / ``ampscale_fp8_amax_cast_v1``
  (``ampscale/_native/cpu/jax_ffi_fp8.cc``: the NumPy extension's kernels, one pass over up to
  :data:`GROUP` leaves per call, read only), from the handler library the loss scaler's custom
  call loads (:mod:`ampscale.backends._jax_custom_call`; ``AMPSCALE_JAX_CUSTOM_CALL=0`` and its
  ``use_custom_call`` turn both off);
* on CUDA GPUs, to the same targets' CUDA handlers (``ampscale/_native/cuda/jax_ffi_fp8_cuda.cc``:
  a memset of the results, then ``ampscale_fp8_jax_pass`` per 64 leaves on XLA's stream), once
  NVRTC's binary is loaded for every GPU of the process (:func:`ampscale._native.cuda._fp8.bind`);
  where it cannot be, the XLA path, with one warning where there is a GPU;
* elsewhere, and where the custom call is no choice (``jax.export`` unless the loss scaler's
  ``use_custom_call(in_exports=True)``, automatic sharding over several devices, a partly manual
  ``shard_map``), to the same arithmetic in XLA operations, bit for bit the same.

The XLA path of the amax is the kernels' bit arithmetic: each leaf bitcast to unsigned
integers, its sign bit cleared, reduced with an integer max, converted to float32 once (a NaN
made canonical). No float compare is involved, so XLA's flushing of subnormals on the CPU
changes nothing (a float ``max(abs(x))`` there returns 0 for a leaf of subnormals: this returns
its largest subnormal, exactly). The cast's XLA path is :func:`ampscale.fp8.quantize` itself.
Under ``vmap`` the XLA path runs, vectorised.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ampscale._errors import PerformanceWarning
from ampscale.fp8._cast import _divide, quantize
from ampscale.fp8._config import FORMATS
from ampscale.fp8._pass import DIVIDE_IN, FORMAT_CODES, check_scales

__all__ = ["GROUP", "TARGETS", "all_finite", "amax", "amax_cast", "last_lowering", "xla_amax"]

#: the FFI targets (a change of operands or results gets a new name)
TARGETS = ("ampscale_fp8_amax_v1", "ampscale_fp8_amax_cast_v1")
#: leaves per custom call (as the loss scaler's: XLA:CPU compiles calls with many operands slowly)
GROUP = 128
#: itemsize -> (the unsigned type of that size, the mask that clears the sign bit)
_BITS = {2: (jnp.uint16, 0x7FFF), 4: (jnp.uint32, 0x7FFFFFFF), 8: (jnp.uint64, (1 << 63) - 1)}

_lock = threading.Lock()
_registered: list[tuple[bool, str]] = []  # [(registered, what or why not)] once tried
_cuda: list[tuple[bool, str]] = []  # [(kernels bound on every GPU, what or why not)] once tried
_cuda_warned = [False]
_last: list[str] = []
_primitives: dict[str, Any] = {}


# ------------------------------------------------------------------------------ the XLA path


def _xla_amax_one(x: Any) -> Any:
    dtype = np.dtype(x.dtype)
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    unsigned, mask = _BITS[dtype.itemsize]
    top = jnp.max(lax.bitcast_convert_type(x, unsigned) & unsigned(mask))
    if dtype.itemsize == 8:
        value = lax.bitcast_convert_type(top, jnp.float64).astype(jnp.float32)
    else:
        value = lax.bitcast_convert_type(top, dtype).astype(jnp.float32)
    return jnp.where(jnp.isnan(value), jnp.float32(np.nan), value)  # the canonical quiet NaN


def xla_amax(*leaves: Any) -> Any:
    """The ``[N]`` float32 amaxes of ``leaves`` in XLA operations (one reduction per leaf)."""
    return jnp.stack([_xla_amax_one(x) for x in leaves])


def _xla_amax_cast(scales: Any, *leaves: Any, fmt: str, divide: bool) -> tuple[Any, ...]:
    bound = jnp.float32(FORMATS[fmt])
    payloads, counts = [], []
    for k, x in enumerate(leaves):
        payloads.append(quantize(x, scales[k], fmt, divide=divide, compute_dtype=DIVIDE_IN))
        wide = x.astype(jnp.float32)
        # one rounded division, as the kernels and the payload's: XLA would multiply by 1 / s
        product = _divide(wide, scales[k], "jax") if divide else wide * scales[k]
        counts.append(jnp.sum(jnp.abs(product) > bound, dtype=jnp.int32))
    return (xla_amax(*leaves), jnp.stack(counts), *payloads)


# ------------------------------------------------------------------------------ the handlers


def _ready() -> tuple[bool, str]:
    """Whether the CPU handlers are registered with XLA (registering them once), and what or why not."""
    from ampscale.backends import _jax_custom_call as loss_call

    if not loss_call.enabled():
        return False, "turned off (AMPSCALE_JAX_CUSTOM_CALL=0 or use_custom_call(False))"
    with _lock:
        if not _registered:
            loaded = loss_call._library_status()
            library = loss_call._library
            if not loaded.available or library is None:
                _registered.append((False, f"the handler library is unavailable: {loaded.reason}"))
            else:
                try:
                    for target in TARGETS:
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
                        # CUDA's too (kept by XLA until a CUDA client starts); its kernel is bound
                        # per device by _cuda_ready before anything is lowered to it
                        handler = jax.ffi.pycapsule(getattr(library, f"{target}_cuda"))
                        jax.ffi.register_ffi_target(target, handler, platform="CUDA")
                except (AttributeError, ValueError, RuntimeError) as exc:
                    _registered.append((False, f"the handler library has no FP8 handlers: {exc}"))
                else:
                    _registered.append((True, f"custom call ({loaded.kernel_isa})"))
        return _registered[0]


def _prepare_cuda() -> tuple[bool, str]:
    from ampscale._native.cuda import _fp8, driver
    from ampscale.backends import _jax_custom_call as loss_call

    devices = loss_call._cuda_devices()
    if not devices:
        return False, "no CUDA device in this process"
    reason = driver.unavailable_reason()
    if reason is not None:
        return False, reason
    library = loss_call._library
    assert library is not None
    try:
        _fp8.declare(library)
        _fp8.set_driver(library)
        ordinals = [d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devices]
        loaded = sorted({_fp8.bind(library, ordinal) for ordinal in ordinals})
    except (OSError, RuntimeError) as exc:  # NvrtcError is a RuntimeError
        return False, str(exc)
    return True, f"NVRTC {', '.join(loaded)}, {len(devices)} device{'s' if len(devices) > 1 else ''}"


def _cuda_ready() -> tuple[bool, str]:
    """Whether the CUDA kernel is bound for every GPU of this process (binding it once), and
    what was loaded or why not."""
    ready, why = _ready()
    if not ready:
        return False, why
    with _lock:
        if not _cuda:
            _cuda.append(_prepare_cuda())
        return _cuda[0]


def last_lowering() -> str | None:
    """What the latest lowering chose: ``"custom call (<isa>)"`` or ``"XLA path: <why>"``."""
    return _last[-1] if _last else None


def _choice(ctx: Any) -> str | None:
    """``None`` to lower to the custom call, else why the XLA path is lowered."""
    from jax._src import sharding_impls

    from ampscale.backends import _jax_custom_call as loss_call

    ready, why = _ready()
    if not ready:
        return why
    if loss_call._for_export(ctx) and not loss_call._settings["in_exports"]:
        return "jax.export (portable; use_custom_call(in_exports=True) keeps the custom call)"
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext) and axis_context.num_devices > 1:
        return f"automatic sharding over {axis_context.num_devices} devices"
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        manual = axis_context.manual_axes
        auto = [name for name, size in axis_context.mesh.shape.items() if size > 1 and name not in manual]
        if auto:
            return f"shard_map with mesh axes {auto} left to automatic sharding"
    return None


def _lower_xla(fn: Any, multiple: bool) -> Any:
    from jax.interpreters import mlir

    return mlir.lower_fun(fn, multiple_results=multiple)


def _make(name: str) -> Any:
    from jax._src import dispatch
    from jax._src.interpreters import mlir as mlir_internal
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    cast = name == "ampscale_fp8_amax_cast"
    primitive = Primitive(name)
    primitive.multiple_results = cast

    def xla_path(*args: Any, **params: Any) -> Any:
        return _xla_amax_cast(*args, **params) if cast else xla_amax(*args)

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        if not cast:
            # [N] float32, replicated (a reduction of every element) on the leaves' mesh, and
            # varying over the manual axes the leaves vary over
            first = avals[0]
            sharding = getattr(first, "sharding", None)
            replicated = {} if sharding is None else {"sharding": sharding.update(spec=jax.sharding.PartitionSpec())}
            return first.update(shape=(len(avals),), dtype=np.dtype(np.float32), weak_type=False, **replicated)
        scales, *leaves = avals
        dtype = np.dtype(jnp.dtype(f"float8_{params['fmt']}"))
        return (
            scales.update(dtype=np.dtype(np.float32), weak_type=False),
            scales.update(dtype=np.dtype(np.int32), weak_type=False),
            *(leaf.update(dtype=dtype, weak_type=False) for leaf in leaves),
        )

    def lower_cpu(ctx: Any, *args: Any, **params: Any) -> Any:
        reason = _choice(ctx)
        _last[:] = [_ready()[1] if reason is None else f"XLA path: {reason}"]
        if reason is not None:
            return _lower_xla(functools.partial(xla_path, **params), cast)(ctx, *args)
        if not cast:
            return jax.ffi.ffi_lowering(TARGETS[0])(ctx, *args)
        attributes = {"format": np.int32(FORMAT_CODES[params["fmt"]]), "divide": bool(params["divide"])}
        return jax.ffi.ffi_lowering(TARGETS[1])(ctx, *args, **attributes)

    def lower_cuda(ctx: Any, *args: Any, **params: Any) -> Any:
        from ampscale.backends import _jax_custom_call as loss_call

        reason = _choice(ctx)
        # an export keeps the call without kernels here: the process that runs it binds them
        if reason is None and not loss_call._for_export(ctx):
            ready, why = _cuda_ready()
            if not ready:
                reason = f"CUDA kernels unavailable ({why})"
                if loss_call._cuda_devices() and not _cuda_warned[0]:  # a GPU, and not the fast path
                    _cuda_warned[0] = True
                    warnings.warn(
                        f"ampscale: the JAX CUDA FP8 custom call is unavailable, XLA operations run instead: {why}",
                        PerformanceWarning,
                        stacklevel=2,
                    )
        _last[:] = ["custom call (CUDA)" if reason is None else f"XLA path: {reason}"]
        if reason is not None:
            return _lower_xla(functools.partial(xla_path, **params), cast)(ctx, *args)
        if not cast:
            return jax.ffi.ffi_lowering(TARGETS[0])(ctx, *args)
        attributes = {"format": np.int32(FORMAT_CODES[params["fmt"]]), "divide": bool(params["divide"])}
        return jax.ffi.ffi_lowering(TARGETS[1])(ctx, *args, **attributes)

    def lower_other(ctx: Any, *args: Any, **params: Any) -> Any:
        _last[:] = [f"XLA path: no handler for platform {list(ctx.module_context.platforms)}"]
        return _lower_xla(functools.partial(xla_path, **params), cast)(ctx, *args)

    def lower(ctx: Any, *args: Any, **params: Any) -> Any:
        # JAX's multi-platform dispatch (one branch per platform of a module lowered for several)
        ctx = ctx.replace(avals_out=list(ctx.avals_out) if cast else ctx.avals_out)
        return mlir_internal.lower_per_platform(
            ctx, name, {"cpu": lower_cpu, "cuda": lower_cuda}, lower_other, frozenset(), *args, **params
        )

    def batch(args: Sequence[Any], dims: Sequence[int | None], **params: Any) -> tuple[Any, Any]:
        moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
        axes = [None if d is None else 0 for d in dims]
        outs = jax.vmap(functools.partial(xla_path, **params), in_axes=axes)(*moved)
        return outs, ([0] * len(outs) if cast else 0)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple[Any, Any]:
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        primal_out, tangent_out = jax.jvp(functools.partial(xla_path, **params), tuple(primals), tuple(tangents))
        return primal_out, tangent_out

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    # uncacheable: the choice follows use_custom_call and the handler's state at each lowering
    mlir.register_lowering(primitive, lower, cacheable=False)
    batching.primitive_batchers[primitive] = batch
    ad.primitive_jvps[primitive] = jvp
    return primitive


def _primitive(name: str) -> Any:
    with _lock:
        if name not in _primitives:
            _primitives[name] = _make(name)
        return _primitives[name]


# ------------------------------------------------------------------------------ the public pieces


def _varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes ``x`` varies over under ``shard_map`` (empty elsewhere)."""
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()) or ())


def _groups(leaves: Sequence[Any]) -> list[list[int]]:
    """Leaf positions in calls of at most :data:`GROUP`, each call's leaves varying over the same
    manual mesh axes (a call's results vary as its operands do)."""
    by_axes: dict[frozenset[Any], list[int]] = {}
    for i, x in enumerate(leaves):
        by_axes.setdefault(_varying_axes(x), []).append(i)
    return [members[s : s + GROUP] for members in by_axes.values() for s in range(0, len(members), GROUP)]


def _in_order(parts: list[tuple[list[int], Any]], count: int) -> Any:
    """One ``[count]`` array from per-group results, back in leaf order."""
    if len(parts) == 1:
        return parts[0][1]
    order = np.argsort(np.concatenate([np.asarray(members) for members, _ in parts]))
    return jnp.concatenate([values for _, values in parts])[order] if count else parts[0][1]


def amax(leaves: Sequence[Any]) -> Any:
    """The ``[N]`` float32 amaxes of JAX ``leaves``."""
    from jax._src import core

    primitive = _primitive("ampscale_fp8_amax")
    parts = []
    for members in _groups(leaves):
        operands = core.auto_insert_reshard(*(leaves[i] for i in members)) if len(members) > 1 else [leaves[members[0]]]
        parts.append((members, primitive.bind(*operands)))
    return _in_order(parts, len(leaves))


def all_finite(amaxes: Any) -> Any:
    """True (0-d bool) when every amax is finite."""
    return jnp.all(jnp.isfinite(amaxes))


def amax_cast(leaves: Sequence[Any], scales: Any, fmt: str, divide: bool) -> tuple[list[Any], Any, Any]:
    """``(payloads, amaxes, clipped)`` of JAX ``leaves``; the clipped counts are int32."""
    from jax._src import core

    check_scales(scales, len(leaves), "jax")
    primitive = _primitive("ampscale_fp8_amax_cast")
    payloads: list[Any] = list(leaves)
    amax_parts, count_parts = [], []
    for members in _groups(leaves):
        group_scales = scales if len(members) == len(leaves) else scales[np.asarray(members)]
        operands = core.auto_insert_reshard(group_scales, *(leaves[i] for i in members))
        group_amaxes, group_counts, *group_payloads = primitive.bind(*operands, fmt=fmt, divide=divide)
        amax_parts.append((members, group_amaxes))
        count_parts.append((members, group_counts))
        for i, payload in zip(members, group_payloads, strict=True):
            payloads[i] = payload
    return payloads, _in_order(amax_parts, len(leaves)), _in_order(count_parts, len(leaves))
