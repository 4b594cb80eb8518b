"""The JAX backend's fast path: one XLA custom call checks and unscales many leaves (CPU and CUDA).

Adapters' layer, beside :mod:`ampscale.backends.jax`, which it never imports.

XLA compiles each gradient leaf into its own fusion and output buffer; that costs a few
microseconds per leaf on the CPU (and about as much per leaf on a GPU) and keeps a step well
below memory speed. The custom call ``ampscale_check_and_unscale_v1`` takes the inverse scale and
up to :data:`GROUP` leaves, unscales them in place (each result aliases its operand, so donated
gradients are never copied) and returns one flag. Its handlers: on the CPU ``jax_ffi.cc`` (the
NumPy extension's kernels), on CUDA GPUs ``jax_ffi_cuda.cc`` (ampscale's multi-tensor kernel,
compiled by NVRTC at run time, launched on XLA's stream: :mod:`ampscale._native.cuda._jax`).

It is bound as a primitive whose lowering decides, per platform and context, between the
custom call and the pure-XLA path (both bit for bit the same):

* CPU or CUDA, one device, or one shard under ``shard_map``/``pmap``, where every unscaled
  leaf is only returned from the computation, reduced across devices, or passed to another
  such call: the custom call. Where an unscaled leaf feeds further XLA arithmetic in the same
  computation (an optimizer update, a clip), the pure-XLA path: XLA then fuses the multiply
  into that arithmetic, as it does in a program without ampscale (jmp's ``unscale`` followed
  by optax), so the results are those of such a program bit for bit, and the fused update
  reads each gradient once (the custom call would write the unscaled values and the update
  read them again). See :func:`_arithmetic_use`.
* any other platform (ROCm, TPU), ``jit`` over several devices with automatic sharding (the
  custom call is opaque to XLA's partitioner, which would gather every gradient onto each
  device), a partly manual ``shard_map``, and ``jax.export`` (unless :func:`use_custom_call`
  says ``in_exports=True``): the pure-XLA path.
* CUDA, when the kernels cannot be made ready in this process (no driver, no NVRTC, NVRTC or
  the driver refusing the module): the pure-XLA path, with one warning.
* under ``vmap`` (a flag per batch element) the batching rule runs the pure-XLA path, and
  differentiating through it uses the pure-XLA path's derivative.

The handler library is built at install time or compiled on first use into the per-user cache
(``_ffi_build``, ``ampscale._native._cache``); either file is verified (its build key, size and
hash) before it is loaded. If none can be loaded (no compiler, a cache directory another user
could write, a full disk, ...), or this JAX lacks an internal the primitive needs, the backend
uses the pure-XLA path, warns once, and :func:`status` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ampscale._errors import PerformanceWarning
from ampscale._native import _cache
from ampscale._native import ffi_build as _ffi_build
from ampscale._native.cuda import _jax as _cuda_kernels
from ampscale.backends._jax_xla import check_and_unscale_xla

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = [
    "GROUP",
    "TARGET",
    "CustomCallStatus",
    "check_and_unscale",
    "register",
    "register_export_serialization",
    "status",
    "use_custom_call",
]

#: The FFI target's name; a change of operands or results gets a new one.
TARGET = "ampscale_check_and_unscale_v1"
#: Leaves per custom call. XLA:CPU's compile time grows faster than linearly with the number of
#: aliased results of one call (2000 in one call: about 40 s; 16 calls of 128: a few seconds),
#: and groups this size cost nothing at run time.
GROUP = 128
_DTYPES = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
_ENV = "AMPSCALE_JAX_CUSTOM_CALL"


@dataclasses.dataclass(frozen=True)
class CustomCallStatus:
    """Whether the JAX backend's custom call is in use, and why (not).

    Attributes:
        available: the handler library is loaded and registered with XLA (CPU and CUDA).
        enabled: not turned off (``AMPSCALE_JAX_CUSTOM_CALL=0`` or :func:`use_custom_call`).
        reason: where the handler came from, or what kept it from loading.
        library: the path of the loaded handler library.
        kernel_isa: the kernel family the handler runs (``"avx512"``, ``"avx2+f16c"``, ...).
        last_lowering: the latest lowering's choice (``"custom call"``, ``"custom call (CUDA)"``
            or ``"XLA path: <why>"``).
        cuda_available: the CUDA kernels are loaded for every CUDA device of this process.
        cuda_reason: what was loaded for CUDA, or why the CUDA custom call cannot run here.
    """

    available: bool
    enabled: bool
    reason: str
    library: str | None = None
    kernel_isa: str | None = None
    last_lowering: str | None = None
    cuda_available: bool = False
    cuda_reason: str = "not checked"

    @property
    def active(self) -> bool:
        """Whether new traces on the CPU use the custom call."""
        return self.available and self.enabled

    def __str__(self) -> str:
        if not self.enabled:
            head = "off (pure-XLA path): turned off"
        elif self.available:
            head = f"on ({self.kernel_isa}): {self.reason}"
        else:
            head = f"unavailable (pure-XLA path): {self.reason}"
        if self.available and self.enabled:
            head += f"; CUDA: {'on' if self.cuda_available else 'pure-XLA path'} ({self.cuda_reason})"
        if self.last_lowering:
            head += f"; last lowering: {self.last_lowering}"
        return head


_lock = threading.Lock()
_loaded: CustomCallStatus | None = None
_library: ctypes.CDLL | None = None  # kept alive: XLA holds a pointer into it
_primitive: Any = None
_settings = {"enabled": True, "in_exports": False, "fuse_into_consumers": True}
_warned_frames = False
_last_lowering: list[str] = []
_warned = False
_cuda_lock = threading.Lock()
_cuda: list[tuple[bool, str]] = []  # [(ready, what was loaded or why not)] once checked
_cuda_warned = False


def _env_enabled() -> bool:
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{_ENV} must be 1/on/true or 0/off/false; got {os.environ[_ENV]!r}")


def enabled() -> bool:
    """Whether the custom call may be used by new traces (the setting, not availability)."""
    return _settings["enabled"] and _env_enabled()


@contextlib.contextmanager
def use_custom_call(enabled: bool = True, *, in_exports: bool = False) -> Iterator[None]:
    """Turn the custom call (CPU and CUDA) on or off for the functions traced inside the block.

    Args:
        enabled: ``False`` makes new traces use the pure-XLA path (bit for bit the same).
        in_exports: keep the custom call in ``jax.export`` artifacts too. They then need
            ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TARGET)]`` to export,
            and :func:`ampscale.backends.jax.register_custom_call` called in every process that
            runs them. By default exports
            lower to the pure-XLA path and run anywhere.

    A function already traced keeps its choice (``jax.jit`` caches traces).
    """
    for name, value in (("enabled", enabled), ("in_exports", in_exports)):
        if not isinstance(value, bool):
            raise TypeError(f"use_custom_call: {name} must be a bool; got {value!r}")
    saved = dict(_settings)
    _settings.update(enabled=enabled, in_exports=in_exports)
    try:
        yield
    finally:
        _settings.update(saved)


def _open(entry: _cache.Entry, key: str) -> tuple[ctypes.CDLL | None, str]:
    """Load a handler library whose file was verified for ``key`` (trailer, size, hash: before
    loading, since loading runs its code); then check the key compiled into it as well."""
    try:
        library = ctypes.CDLL(entry.load_path())
    except OSError as exc:
        return None, f"{entry.path} does not load: {exc}"
    try:
        library.ampscale_ffi_build_key.restype = ctypes.c_char_p
        built = library.ampscale_ffi_build_key().decode()
    except AttributeError:
        return None, f"{entry.path} is not ampscale's handler library (no build key)"
    if built != key:
        return None, f"{entry.path} was built from other sources or for another jaxlib ({built}, need {key})"
    return library, ""


def _find_library(key: str) -> tuple[ctypes.CDLL | None, str, str]:
    """``(library, path, where it came from)``, or ``(None, why not, "")``: the library built at
    install if it verifies, else the per-user cache's (compiled into it on first use)."""
    why_not_prebuilt = ""
    try:
        with _ffi_build.open_prebuilt(key) as entry:
            library, why_not_prebuilt = _open(entry, key)
            if library is not None:
                return library, entry.path, "built at install"
    except FileNotFoundError:
        pass
    except _cache.InvalidEntry as exc:
        why_not_prebuilt = f"the library built at install is not used: {exc}"

    def unavailable(reason: str) -> tuple[None, str, str]:
        return None, f"{reason}; {why_not_prebuilt}" if why_not_prebuilt else reason, ""

    compiler = _ffi_build.find_compiler()
    if compiler is None:
        return unavailable("no C++ compiler found to build the handler (set CXX)")
    try:
        with _ffi_build.cached_handler(key, jax.ffi.include_dir(), compiler) as entry:
            library, why = _open(entry, key)
            if library is None:
                return unavailable(why)
            return library, entry.path, "compiled on first use, cached"
    except _cache.CacheError as exc:  # CacheUnavailable included
        return unavailable(
            f"the handler cache cannot be used: {exc} (set AMPSCALE_CACHE_DIR to a directory only you can write)"
        )
    except RuntimeError as exc:
        return unavailable(f"compiling the handler failed: {exc}")


def _load() -> CustomCallStatus:
    """Find, build if needed, load and register the handler: once per process."""
    global _library, _primitive
    import jaxlib

    version = getattr(jaxlib, "__version__", None) or jax.__version__
    try:
        key = _ffi_build.build_key(version)
    except OSError as exc:
        return CustomCallStatus(False, True, f"the handler's sources are not installed ({exc})")
    library, path, origin = _find_library(key)
    if library is None:
        return CustomCallStatus(False, True, path)
    try:
        _primitive = _make_primitive()
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.ampscale_check_and_unscale_v1), platform="cpu")
        # CUDA's is registered too (XLA keeps it until a CUDA client starts); its kernels are
        # loaded per device by _cuda_ready, before anything is lowered to it.
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.ampscale_check_and_unscale_v1_cuda), platform="CUDA"
        )
        _cuda_kernels.declare(library)
    except Exception as exc:  # a JAX without an internal the primitive needs: the XLA path
        return CustomCallStatus(False, True, f"this JAX ({jax.__version__}) cannot host the custom call: {exc!r}")
    _library = library
    library.ampscale_ffi_kernel_isa.restype = ctypes.c_char_p
    isa = library.ampscale_ffi_kernel_isa().decode()
    return CustomCallStatus(True, True, f"{origin} ({path})", path, isa)


def _library_status() -> CustomCallStatus:
    """Load (building it if needed) the handler library and register it with XLA, once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _cuda_devices() -> list[Any]:
    """This process's CUDA devices (none without JAX's CUDA backend)."""
    try:
        return list(jax.local_devices(backend="cuda"))
    except RuntimeError:  # "Unknown backend cuda"
        return []


def _prepare_cuda() -> tuple[bool, str]:
    devices = _cuda_devices()
    if not devices:
        return False, "no CUDA device in this process"
    from ampscale._native.cuda import driver

    reason = driver.unavailable_reason()
    if reason is not None:
        return False, reason
    assert _library is not None
    try:
        _cuda_kernels.set_driver(_library)
        ordinals = [d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devices]
        loaded = sorted({_cuda_kernels.bind(_library, ordinal) for ordinal in ordinals})
    except (OSError, RuntimeError) as exc:  # NvrtcError is a RuntimeError
        return False, str(exc)
    return True, f"NVRTC {', '.join(loaded)}, {len(devices)} device{'s' if len(devices) > 1 else ''}"


def _cuda_ready() -> tuple[bool, str]:
    """Whether the CUDA kernels are loaded for every CUDA device here (doing it once), and what or why not."""
    loaded = _library_status()
    if not loaded.available:
        return False, f"the handler library is unavailable: {loaded.reason}"
    with _cuda_lock:
        if not _cuda:
            _cuda.append(_prepare_cuda())
        return _cuda[0]


def register() -> CustomCallStatus:
    """Load (building it if needed) and register the handlers with XLA, once per process; on a
    machine with CUDA devices, also compile (or take from the disk cache) and load the CUDA kernels.

    Call it before running a deserialized ``jax.export`` artifact that contains the custom
    call (see :func:`use_custom_call`); tracing with the JAX backend calls it by itself.
    """
    loaded = _library_status()
    if not loaded.available:
        return loaded
    ready, why = _cuda_ready()
    return dataclasses.replace(loaded, cuda_available=ready, cuda_reason=why)


def status() -> CustomCallStatus:
    """The custom call's :class:`CustomCallStatus` (loads or builds the handler if not yet done)."""
    loaded = register()
    return dataclasses.replace(loaded, enabled=enabled(), last_lowering=_last_lowering[-1] if _last_lowering else None)


# -- the primitive ------------------------------------------------------------------------------


def _xla_path(inv_scale: Any, *grads: Any) -> tuple[Any, ...]:
    """The pure-XLA computation of the same results: ``(finite, *unscaled)``."""
    outs, finite = check_and_unscale_xla(list(grads), inv_scale)
    return (finite, *outs)


def _for_export(ctx: Any) -> bool:
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def _lowering_choice(ctx: Any) -> str | None:
    """``None`` to lower to the custom call here, else why the pure-XLA path is lowered."""
    from jax._src import sharding_impls

    module = ctx.module_context
    if _for_export(ctx) and not _settings["in_exports"]:
        return "jax.export (portable; use_custom_call(in_exports=True) keeps the custom call)"
    axis_context = module.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext) and axis_context.num_devices > 1:
        return f"automatic sharding over {axis_context.num_devices} devices"
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        manual = axis_context.manual_axes
        auto = [name for name, size in axis_context.mesh.shape.items() if size > 1 and name not in manual]
        if auto:
            return f"shard_map with mesh axes {auto} left to automatic sharding"
    if _settings["fuse_into_consumers"]:
        use = _arithmetic_use(_enclosing_jaxprs())
        if use is not None:
            return use
    return None


# -- where the results go -----------------------------------------------------------------------
#
# The custom call is opaque to XLA: a multiply inside it cannot be fused into (or rewritten
# together with) the arithmetic that consumes its results, which XLA does with the pure-XLA
# path's multiply, and with jmp's. So where an unscaled leaf feeds more arithmetic in the same
# computation, the two give results that can differ in the last bits, and the pure-XLA path is
# both exact (the same HLO as a program without ampscale) and no slower (the multiply joins the
# consumer's fusion: the gradient is read once). The lowering rule therefore looks at the
# equations that use the call's results, in the jaxpr being lowered and, through the frames of
# JAX's lowering (``jaxpr_subcomp``), in the jaxprs around it. The primitive is registered as
# uncacheable, so that each call site is judged on its own uses.

#: uses that leave a result as it is: collectives (XLA never fuses arithmetic into them), a
#: barrier, and this call itself (another group, or the next step of a loop)
_MATERIALIZING = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pbroadcast",
        "all_to_all",
        "ragged_all_to_all",
        "all_gather",
        "all_gather_invariant",
        "reduce_scatter",
        "psend",
        "optimization_barrier",
        "ampscale_check_and_unscale",
    }
)
#: uses whose outputs are their inputs (moved, annotated, copied): followed to their own uses
_TRANSPARENT = frozenset({"device_put", "sharding_constraint", "pvary", "pcast", "copy", "copy_p"})
#: uses that move or pick values without computing new ones (a multiply fused into them gives
#: the same bits): followed to the uses of their output. Conversions are not among them: XLA
#: may fold a widening and a narrowing conversion around a multiply into one of its own.
_VALUE_MOVES = frozenset(
    {
        "select_n",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "rev",
    }
)
#: ``k -> why k-th output's uses are arithmetic, or None``
_Follow = Callable[..., "str | None"]
#: the most equations looked at per call site; a program past it is judged to feed arithmetic
_MAX_VISITS = 20_000


def _enclosing_jaxprs() -> list[tuple[Any, Any]] | None:
    """``[(jaxpr, eqn), ...]`` from the jaxpr holding this call's equation outwards (each
    ``eqn`` the equation being lowered in its ``jaxpr``), read from JAX's lowering frames;
    ``None`` where they cannot be read (a JAX whose lowering works otherwise)."""
    try:
        from jax._src.interpreters import mlir as mlir_internal

        code = mlir_internal.jaxpr_subcomp.__code__
    except (ImportError, AttributeError):
        return None
    found = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            names = frame.f_locals
            jaxpr, eqn = names.get("jaxpr"), names.get("eqn")
            if jaxpr is None or eqn is None or not hasattr(jaxpr, "eqns"):
                return None
            found.append((jaxpr, eqn))
        frame = frame.f_back
    if not found or found[0][1].primitive is not _primitive:
        return None
    return found


def _inner(value: Any) -> Any:
    """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr`` parameter (``None`` for anything else)."""
    inner = getattr(value, "jaxpr", value)
    return inner if hasattr(inner, "eqns") and hasattr(inner, "invars") else None


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs held in an equation's parameters (``branches`` of ``cond`` included)."""
    out = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = _inner(item)
            if inner is not None:
                out.append(inner)
    return out


class _Uses:
    """Follows a call's results through the jaxprs of one lowering (see :func:`_arithmetic_use`)."""

    def __init__(self, frames: list[tuple[Any, Any]]) -> None:
        self.frames = frames
        self.seen: set[tuple[int, int]] = set()
        self.visits = 0

    def in_jaxpr(self, jaxpr: Any, var: Any, on_output: _Follow) -> str | None:
        """The first arithmetic use of ``var`` in ``jaxpr``; ``on_output(k)`` follows it where it
        is the jaxpr's ``k``-th output."""
        key = (id(jaxpr), id(var))
        if key in self.seen:
            return None
        self.seen.add(key)
        for k, out in enumerate(jaxpr.outvars):
            if out is var:
                found = on_output(k)
                if found is not None:
                    return found
        for eqn in jaxpr.eqns:
            positions = [i for i, v in enumerate(eqn.invars) if v is var]
            if positions:
                self.visits += 1
                if self.visits > _MAX_VISITS:
                    return "too many uses to follow"
                found = self.through(eqn, positions, jaxpr, on_output)
                if found is not None:
                    return found
        return None

    def through(self, eqn: Any, positions: list[int], jaxpr: Any, on_output: _Follow) -> str | None:
        """Follow ``eqn``'s inputs at ``positions`` (``eqn`` sits in ``jaxpr``)."""
        name = str(eqn.primitive.name)
        if name in _MATERIALIZING:
            return None
        if name in _TRANSPARENT:
            if len(eqn.outvars) != len(eqn.invars):
                return name
            for i in positions:
                found = self.in_jaxpr(jaxpr, eqn.outvars[i], on_output)
                if found is not None:
                    return found
            return None
        if name in _VALUE_MOVES:
            for out in eqn.outvars:
                found = self.in_jaxpr(jaxpr, out, on_output)
                if found is not None:
                    return found
            return None
        if name == "while":
            return self.into_while(eqn, positions, jaxpr, on_output)
        subs = _sub_jaxprs(eqn)
        if not subs:
            return name
        after = self.after(eqn, jaxpr, on_output)
        for i in positions:
            for sub in subs:
                offset = len(eqn.invars) - len(sub.invars)  # cond: the predicate comes first
                if offset not in (0, 1) or i < offset or len(sub.outvars) != len(eqn.outvars):
                    return name  # a form not followed: judged to feed arithmetic
                found = self.in_jaxpr(sub, sub.invars[i - offset], self.loop(eqn, sub, after))
                if found is not None:
                    return found
        return None

    def after(self, eqn: Any, jaxpr: Any, on_output: _Follow) -> _Follow:
        """Where ``eqn``'s ``k``-th output goes, in ``jaxpr``."""
        return lambda k: self.in_jaxpr(jaxpr, eqn.outvars[k], on_output)

    def loop(self, eqn: Any, sub: Any, after: _Follow) -> _Follow:
        """``sub``'s ``k``-th output: the equation's output, and for a scan's carry the body's
        input of the next iteration too."""
        if eqn.primitive.name != "scan":
            return after
        consts, carry = eqn.params.get("num_consts", 0), eqn.params.get("num_carry", 0)

        def follow(k: int) -> str | None:
            found = after(k)
            if found is None and k < carry:
                found = self.in_jaxpr(sub, sub.invars[consts + k], follow)
            return found

        return follow

    def into_while(self, eqn: Any, positions: list[int], jaxpr: Any, on_output: _Follow) -> str | None:
        cond, body = _inner(eqn.params["cond_jaxpr"]), _inner(eqn.params["body_jaxpr"])
        cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        after = self.after(eqn, jaxpr, on_output)
        follow = self.while_body(cond, body, cond_consts, body_consts, after)
        for i in positions:
            if i < cond_consts:
                found = self.in_jaxpr(cond, cond.invars[i], lambda k: None)
            elif i < cond_consts + body_consts:
                found = self.in_jaxpr(body, body.invars[i - cond_consts], follow)
            else:
                found = follow(i - cond_consts - body_consts, entering=True)
            if found is not None:
                return found
        return None

    def while_body(self, cond: Any, body: Any, cond_consts: int, body_consts: int, after: _Follow) -> _Follow:
        """A carried value ``k`` (a body output, or entering the loop): the next iteration's
        predicate and body, and the loop's output."""

        def follow(k: int, entering: bool = False) -> str | None:
            return (
                self.in_jaxpr(cond, cond.invars[cond_consts + k], lambda _: None)
                or self.in_jaxpr(body, body.invars[body_consts + k], follow)
                or after(k)
            )

        return follow

    def outward(self, level: int) -> _Follow:
        """The ``k``-th output of the jaxpr at ``frames[level]``: its uses around it."""

        def follow(k: int) -> str | None:
            if level + 1 == len(self.frames):
                return None  # returned from the computation: materialised
            inner = self.frames[level][0]
            jaxpr, eqn = self.frames[level + 1]
            after = self.after(eqn, jaxpr, self.outward(level + 1))
            name = str(eqn.primitive.name)
            if name == "while":
                cond, body = _inner(eqn.params["cond_jaxpr"]), _inner(eqn.params["body_jaxpr"])
                if inner is not body:
                    return "while"
                follow_carry = self.while_body(
                    cond, body, eqn.params["cond_nconsts"], eqn.params["body_nconsts"], after
                )
                return follow_carry(k)
            if any(sub is inner for sub in _sub_jaxprs(eqn)):
                if len(inner.outvars) != len(eqn.outvars):
                    return name
                return self.loop(eqn, inner, after)(k)
            # a jaxpr JAX built to lower ``eqn`` (``mlir.lower_fun``: scan, custom calls of
            # JAX's own): it computes the equation's outputs, in order
            if len(inner.outvars) == len(eqn.outvars) and len(inner.invars) == len(eqn.invars):
                return after(k)
            return name

        return follow


def _arithmetic_use(frames: list[tuple[Any, Any]] | None) -> str | None:
    """Why this call site lowers to the pure-XLA path, or ``None`` for the custom call.

    ``None`` when every unscaled result is only returned from the computation (or from the
    loop carrying it), reduced across devices, or passed to another check-and-unscale call:
    nothing XLA could fuse it with. Otherwise the reason names the first arithmetic use found.
    The flag (the first result) is not followed: it is a bool, computed the same both ways.
    """
    global _warned_frames
    if frames is None:
        if not _warned_frames:
            _warned_frames = True
            warnings.warn(
                "ampscale: this JAX's lowering cannot be inspected, so the uses of the unscaled "
                "gradients are unknown; the pure-XLA path is used (exact, but without the custom call)",
                PerformanceWarning,
                stacklevel=2,
            )
        return "the uses of its results are unknown (this JAX's lowering cannot be inspected)"
    uses = _Uses(frames)
    follow = uses.outward(0)
    eqn_jaxpr, eqn = frames[0]
    for out in eqn.outvars[1:]:
        found = uses.in_jaxpr(eqn_jaxpr, out, follow)
        if found is not None:
            return f"its results feed further XLA arithmetic ({found}), into which XLA fuses the multiply"
    return None


def _lower(ctx: Any, reason: str | None, chosen: str, inv_scale: Any, *grads: Any) -> Any:
    """The custom call (``reason`` is ``None``) or the pure-XLA path, and the choice recorded."""
    from jax.interpreters import mlir

    _last_lowering[:] = [chosen if reason is None else f"XLA path: {reason}"]
    if reason is not None:
        return mlir.lower_fun(_xla_path, multiple_results=True)(ctx, inv_scale, *grads)
    aliases = {i: i for i in range(1, len(grads) + 1)}
    return jax.ffi.ffi_lowering(TARGET, operand_output_aliases=aliases)(ctx, inv_scale, *grads)


def _lower_cpu(ctx: Any, inv_scale: Any, *grads: Any) -> Any:
    return _lower(ctx, _lowering_choice(ctx), "custom call", inv_scale, *grads)


def _lower_cuda(ctx: Any, inv_scale: Any, *grads: Any) -> Any:
    global _cuda_warned
    reason = _lowering_choice(ctx)
    # An export keeps the call without kernels here: the process that runs it registers them.
    if reason is None and not _for_export(ctx):
        ready, why = _cuda_ready()
        if not ready:
            reason = f"CUDA kernels unavailable ({why})"
            if _cuda_devices() and not _cuda_warned:  # a GPU here, and the fast path is not on it
                _cuda_warned = True
                warnings.warn(
                    f"ampscale: the JAX CUDA custom call is unavailable, the pure-XLA path is used: {why}",
                    PerformanceWarning,
                    stacklevel=2,
                )
    return _lower(ctx, reason, "custom call (CUDA)", inv_scale, *grads)


def _lower_other(ctx: Any, inv_scale: Any, *grads: Any) -> Any:
    from jax.interpreters import mlir

    _last_lowering[:] = [f"XLA path: no handler for platform {list(ctx.module_context.platforms)}"]
    return mlir.lower_fun(_xla_path, multiple_results=True)(ctx, inv_scale, *grads)


def _lower_per_platform(ctx: Any, inv_scale: Any, *grads: Any) -> Any:
    """The CPU, CUDA or other platform's rule, through JAX's own per-platform dispatch (a module
    lowered for several platforms, for ``jax.export``, gets one branch per platform).

    JAX hands an uncacheable rule a context whose ``avals_out`` is a tuple, which its
    multi-platform dispatch cannot take (it concatenates a list to it); the dispatch is
    therefore made here, with a list.
    """
    from jax._src.interpreters import mlir as mlir_internal

    ctx = ctx.replace(avals_out=list(ctx.avals_out))
    rules = {"cpu": _lower_cpu, "cuda": _lower_cuda}
    return mlir_internal.lower_per_platform(
        ctx, "ampscale_check_and_unscale", rules, _lower_other, frozenset(), inv_scale, *grads
    )


def _abstract_eval(inv_scale: Any, *grads: Any) -> tuple[Any, ...]:
    # The flag has the inverse scale's type (0-d, and under shard_map varying over the same
    # axes as the leaves: the caller made them agree); every leaf keeps its own.
    return (inv_scale.update(dtype=np.dtype(np.bool_), weak_type=False), *grads)


def _batch(args: Sequence[Any], dims: Sequence[int | None]) -> tuple[Any, list[int]]:
    # A flag per batch element: the pure-XLA path, vectorised.
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    outs = jax.vmap(_xla_path, in_axes=[None if d is None else 0 for d in dims])(*moved)
    return outs, [0] * len(outs)


def _make_primitive() -> Any:
    from jax._src import dispatch
    from jax._src.core import auto_insert_reshard  # noqa: F401 - used per call: fail here, not there
    from jax._src.sharding_impls import ShardingContext, SPMDAxisContext  # noqa: F401 - likewise
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    if not hasattr(jax, "typeof"):
        raise AttributeError("jax.typeof")

    primitive = Primitive("ampscale_check_and_unscale")
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(_abstract_eval)
    # Uncacheable: each call site is lowered on its own, judged by the uses of its results. One
    # rule for every platform, which dispatches per platform itself (_lower_per_platform).
    mlir.register_lowering(primitive, _lower_per_platform, cacheable=False)
    batching.primitive_batchers[primitive] = _batch
    # Differentiable: the derivative of the pure-XLA path (a multiply by the inverse scale). The
    # rule is the primitive's own rather than a custom_jvp around it, so that the equation sits
    # in the caller's jaxpr, next to the equations that use its results.
    ad.primitive_jvps[primitive] = _jvp
    return primitive


def _fused(inv_scale: Any, *grads: Any) -> tuple[Any, ...]:
    return tuple(_primitive.bind(inv_scale, *grads))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    from jax.interpreters import ad

    tangents = [ad.instantiate_zeros(t) for t in tangents]
    primal_out, tangent_out = jax.jvp(_xla_path, tuple(primals), tuple(tangents))
    return list(primal_out), list(tangent_out)


def _varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes ``x`` varies over under ``shard_map`` (empty elsewhere)."""
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()) or ())


def check_and_unscale(leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any] | None:
    """Unscale ``leaves`` and check them through the custom call; ``None`` where it cannot be used.

    Leaves of another dtype (float8, ...) take the pure-XLA path beside it, and the flags are
    combined. The calls take at most :data:`GROUP` leaves each, all varying over the same
    manual mesh axes.
    """
    global _warned
    if not enabled():
        return None
    loaded = _library_status()
    if not loaded.available:
        if not _warned and jax.default_backend() in ("cpu", "gpu"):
            _warned = True
            warnings.warn(
                f"ampscale: the JAX custom call is unavailable, the pure-XLA path is used: {loaded.reason}",
                PerformanceWarning,
                stacklevel=4,
            )
        return None
    scale_type = jax.typeof(inv_scale)
    if scale_type.shape != () or scale_type.dtype != np.float32:
        return None
    fused = [i for i, x in enumerate(leaves) if np.dtype(x.dtype) in _DTYPES]
    if not fused:
        return None
    from jax._src import core

    groups: dict[frozenset[Any], list[int]] = {}
    for i in fused:
        groups.setdefault(_varying_axes(leaves[i]), []).append(i)
    outs = list(leaves)
    flags = []
    for members in groups.values():
        for start in range(0, len(members), GROUP):
            chunk = members[start : start + GROUP]
            inv, *grads = core.auto_insert_reshard(inv_scale, *(leaves[i] for i in chunk))
            finite, *unscaled = _fused(inv, *grads)
            flags.append(finite)
            for i, out in zip(chunk, unscaled, strict=True):
                outs[i] = out
    in_calls = set(fused)
    rest = [i for i in range(len(leaves)) if i not in in_calls]
    if rest:
        others, finite = check_and_unscale_xla([leaves[i] for i in rest], inv_scale)
        flags.append(finite)
        for i, out in zip(rest, others, strict=True):
            outs[i] = out
    finite = flags[0]
    for flag in flags[1:]:
        finite = jnp.logical_and(finite, flag)
    return outs, finite


# -- jax.export: the scaler in an artifact's calling convention -----------------------------

#: The names under which the scaler's pytree nodes are serialized in ``jax.export`` artifacts.
SERIALIZED_NAMES = ("ampscale.Scaler", "ampscale.Scaler.pending")


def _serialize_config(aux: Any) -> bytes:
    """A scaler's static settings (its pytree auxiliary data) as JSON bytes."""
    config = aux[0]
    state = config.__getstate__()
    if callable(state.get("on_floor")):
        raise ValueError(
            "jax.export cannot serialize a scaler whose on_floor is a callback (a Python function "
            "cannot be stored in an artifact); export a scaler created with on_floor='ignore'"
        )
    axis = state.get("axis_name")
    if not (axis is None or isinstance(axis, (str, int))):
        raise ValueError(
            f"jax.export cannot serialize a scaler whose axis_name is {axis!r} (a string, an int or None can be)"
        )
    return json.dumps({"format": 1, "settings": state}, sort_keys=True, allow_nan=True).encode()


def _deserialize_config(data: bytes) -> Any:
    from ampscale._config import ScalerConfig

    document = json.loads(data)
    if document.get("format") != 1:
        raise ValueError(f"this ampscale cannot read a scaler serialized in format {document.get('format')!r}")
    return (ScalerConfig(**document["settings"]), "jax")


def register_export_serialization(scaler_type: type[Any], pending_type: type[Any]) -> None:
    """Let ``jax.export`` serialize artifacts whose arguments or results hold a scaler.

    The scaler's settings (static, not arrays) are stored as JSON in the artifact's calling
    convention; its state is the artifact's array arguments. A process that deserializes such
    an artifact imports ``ampscale.backends.jax`` first (which registers the names). The
    computation itself holds no custom call unless it was exported inside
    ``use_custom_call(in_exports=True)``.
    """
    from jax import export

    for cls, name in zip((scaler_type, pending_type), SERIALIZED_NAMES, strict=True):
        export.register_pytree_node_serialization(
            cls, serialized_name=name, serialize_auxdata=_serialize_config, deserialize_auxdata=_deserialize_config
        )
