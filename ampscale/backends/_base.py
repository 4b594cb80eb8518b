"""The protocol every backend adapter implements.

Adapter protocol layer: below the adapters, above the native code and the host operations.

An adapter does only what differs between frameworks: recognise its arrays, flatten trees,
check and unscale gradients (fused), hold the state as 0-d arrays on the right device, select
between two trees without a host branch, and agree on a flag across devices. The state machine
itself (:mod:`ampscale._core`) is never re-implemented here.
"""

from __future__ import annotations

import abc
import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ampscale import _tree
from ampscale._config import shown
from ampscale._core import INT_FIELDS, ScalerState, transition
from ampscale._errors import AliasedGradientsError, AmpscaleWarning
from ampscale._native.cuda._packed import PackedState
from ampscale._ops import ArrayOps, HostOps

if TYPE_CHECKING:
    from ampscale._config import ScalerConfig

__all__ = [
    "FRAMEWORK_MODULES",
    "Backend",
    "ReadOnlyGuard",
    "WriteGuard",
    "WIDE_DTYPES",
    "adapter_ready",
    "check_flag",
    "check_loss",
    "framework_of",
    "leaf_error",
    "leaf_label",
    "may_overlap_itself",
    "name_leaves",
    "read_only",
    "when_adapter_ready",
]

#: top-level module of an array type -> the name of the backend for it
FRAMEWORK_MODULES = {"numpy": "numpy", "torch": "torch", "jax": "jax", "jaxlib": "jax", "cupy": "cupy"}


def framework_of(value: Any) -> str | None:
    """The name of the backend ``value`` belongs to, from its type alone (nothing is loaded).

    ``None`` for Python scalars and objects of no known framework or array-API namespace.
    """
    name = FRAMEWORK_MODULES.get(type(value).__module__.split(".")[0])
    if name is not None:
        return name
    namespace = getattr(value, "__array_namespace__", None)
    if namespace is None:
        return None
    try:
        return str(getattr(namespace(), "__name__", "array_api"))
    except Exception:
        return None


# Adapters and the layers above them meet here, so that no adapter imports those layers: a
# layer above registers a callback (the scaler, to make its class a JAX pytree), each adapter
# module announces its backend once it is built, and every callback sees every adapter once,
# whichever of the two comes first.
_ready_callbacks: list[Callable[[Backend], None]] = []
_ready_adapters: list[Backend] = []


def when_adapter_ready(callback: Callable[[Backend], None]) -> None:
    """Call ``callback(backend)`` for every adapter already loaded, and for each one loaded later."""
    _ready_callbacks.append(callback)
    for backend in list(_ready_adapters):
        callback(backend)


def adapter_ready(backend: Backend) -> None:
    """Announce a loaded adapter to the callbacks of :func:`when_adapter_ready` (once per adapter)."""
    if any(backend is known for known in _ready_adapters):
        return
    _ready_adapters.append(backend)
    for callback in list(_ready_callbacks):
        callback(backend)


def may_overlap_itself(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether an array's elements may share memory (``strides`` in the unit of ``itemsize``).

    False is certain: with its axes sorted by stride, each stride reaches past everything the
    smaller axes span. True means some elements may coincide (a stride of 0, ``as_strided``
    layouts); an unscale in place could then change a location more than once.
    """
    reach = itemsize
    for stride, size in sorted((abs(st), n) for st, n in zip(strides, shape, strict=True) if n > 1):
        if stride < reach:
            return True
        reach += stride * (size - 1)
    return False


def leaf_label(index: int, paths: Sequence[str] | None = None) -> str:
    """How an error names leaf ``index``: by its path in the tree where it is known, and its index.

    ``"['b'] (leaf [1] in tree order)"``, ``"layer.weight (leaf [0] in tree order)"``; a flat
    list's path is its index: ``"[1] (in tree order)"``.
    """
    path = paths[index] if paths is not None and 0 <= index < len(paths) else None
    if path is None or path == f"[{index}]":
        return f"[{index}] (in tree order)"
    return f"{path} (leaf [{index}] in tree order)"


E = TypeVar("E", bound=BaseException)


def leaf_error(kind: type[E], template: str, *indices: int, paths: Sequence[str] | None = None) -> E:
    """An exception whose message names leaves: ``template`` with ``{}`` for each of ``indices``.

    Backends raise these where they know only the leaves' indices (deep in an unscale); the
    caller that knows the tree renames them by path with :func:`name_leaves` before the error
    reaches the user. The one mechanism every backend and every leaf error goes through.
    """
    exc = kind(template.format(*(leaf_label(i, paths) for i in indices)))
    exc.leaf_template = template  # type: ignore[attr-defined]
    exc.leaf_indices = indices  # type: ignore[attr-defined]
    return exc


def name_leaves(exc: BaseException, paths: Sequence[str] | Callable[[], Sequence[str]] | None) -> None:
    """Rewrite the message of an error from :func:`leaf_error` with the leaves' paths.

    ``paths``: every leaf's path in tree order, or a function that computes them (called only
    here, on the error path). Errors of any other kind are left as they are.
    """
    template = getattr(exc, "leaf_template", None)
    if template is None or paths is None:
        return
    try:
        names = paths() if callable(paths) else paths
    except Exception:  # naming must never hide the error itself
        return
    exc.args = (template.format(*(leaf_label(i, names) for i in exc.leaf_indices)), *exc.args[1:])  # type: ignore[attr-defined]


def check_loss(loss: Any) -> None:
    """A loss must be an array: a Python number cannot start a backward pass, so say what to pass."""
    if isinstance(loss, (int, float, complex)) and not hasattr(loss, "dtype"):  # np.float64 is a float too
        raise TypeError(
            f"loss must be an array of your framework (the value your backward pass starts from), "
            f"not a Python {type(loss).__name__} ({shown(loss)}): for example np.float32(loss), "
            "torch.tensor(loss) or jnp.float32(loss)"
        )


def check_flag(flag: Any, name: str) -> None:
    """A step flag must be a bool or a 0-d boolean array: reject anything else clearly."""
    if isinstance(flag, bool):
        return
    dtype = getattr(flag, "dtype", None)
    shape = getattr(flag, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(f"{name} must be a Python bool or a 0-d boolean array; got {type(flag).__name__} {shown(flag)}")
    if tuple(shape) != ():
        raise TypeError(f"{name} must be 0-d (one flag for the whole step); got shape {tuple(shape)}")
    kind = getattr(dtype, "kind", None)
    name_of = str(getattr(dtype, "name", dtype))
    if kind != "b" and "bool" not in name_of:
        raise TypeError(f"{name} must be boolean; got dtype {name_of}")


#: whether the float16-kept warning (:meth:`Backend.warn_if_half_kept`) was shown in this process
_HALF_KEPT_WARNED = False
#: dtypes seen that unscale without underflow in their own dtype (float32, bfloat16, ...): a
#: tree of only these skips the float16 check with one set comparison
WIDE_DTYPES: set[Any] = set()


def overlap_error(first: int, second: int) -> AliasedGradientsError:
    """The error for two gradients (leaf indices in tree order) that share memory in part."""
    return leaf_error(
        AliasedGradientsError,
        "gradients {} and {} share memory in part: unscaling both would change the shared values "
        "twice, and no order of the two is right. Pass each buffer once (the same array twice is "
        "fine: it is unscaled once)",
        first,
        second,
    )


def internal_overlap_error(index: int, shape: Any, strides: Any, remedy: str) -> AliasedGradientsError:
    """The error for a gradient whose own elements may share memory (a stride of 0)."""
    return leaf_error(
        AliasedGradientsError,
        f"gradient {{}} has elements that share memory (strides {tuple(strides)} for shape "
        f"{tuple(shape)}): unscaling it in place would change them more than once; pass a copy ({remedy})",
        index,
    )


def meta_error(index: int, what: str = "gradient") -> ValueError:
    """The error for a leaf without data (a torch ``meta`` tensor): nothing to check or unscale."""
    return leaf_error(
        ValueError,
        f"{what} {{}} is a meta tensor: it has a shape and a dtype but no values, so it cannot be "
        "checked or unscaled (a finite flag for it would be a guess); compute the gradients on a real "
        "device (materialise the model with to_empty() and load its weights first)",
        index,
    )


class WriteGuard:
    """What a backend can tell about writes into some arrays while ``update_fn`` runs.

    Attributes:
        exact: whether :meth:`written` sees every in-place write into the guarded arrays (a
            write through another view of their memory included, where the framework tracks it).
    """

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact

    def written(self) -> list[int] | None:
        """The indices of the guarded arrays written in place (``None``: the backend cannot tell)."""
        return [] if self.exact else None

    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the framework refusing a write into a guarded (read-only) array."""
        return False


class ReadOnlyGuard(WriteGuard):
    """The guard of arrays made read-only for the call: the framework refuses the first write."""

    def refused(self, exc: BaseException) -> bool:
        return isinstance(exc, ValueError) and "read-only" in str(exc)


@contextlib.contextmanager
def read_only(arrays: Sequence[Any], holder: Callable[[Any], Any] = lambda a: a) -> Iterator[None]:
    """Make the NumPy arrays among ``holder(a) for a in arrays`` read-only while the block runs
    (an in-place write then raises ``ValueError: ... read-only``), and writable again after."""
    flipped = []
    for array in arrays:
        held = holder(array)
        if isinstance(held, np.ndarray) and held.flags.writeable:
            held.flags.writeable = False
            flipped.append(held)
    try:
        yield
    finally:
        for held in flipped:
            held.flags.writeable = True


class Backend(abc.ABC):
    """One framework's adapter. Instances are singletons obtained from the registry.

    Attributes:
        name: the backend's name (``"numpy"``, ``"torch"``, ``"jax"``, ``"cupy"``, ...).
        host_state: whether the state lives in host memory, so the transition runs on Python
            scalars (:class:`~ampscale._ops.HostOps`) instead of array kernels.
        in_place: whether writable gradients are unscaled in place.
        lazy_state: whether the state is created on the device of the first arrays seen
            (rather than at ``create_scaler`` time), as ``torch.amp.GradScaler`` does.
        packed_state: whether the state may be one packed device record (the CUDA backends), on
            which a step can be one launch (:meth:`fused_unscale`); the scaler asks for that
            launch only then.
        mutable_arrays: whether the framework's arrays can be written in place (JAX's cannot);
            ``Scaler.step`` then refuses an ``update_fn`` that writes into what it was given.
    """

    name: ClassVar[str]
    host_state: ClassVar[bool] = False
    in_place: ClassVar[bool] = False
    lazy_state: ClassVar[bool] = False
    mutable_arrays: ClassVar[bool] = True
    packed_state: ClassVar[bool] = False

    # -- arrays and trees -------------------------------------------------------------------
    @abc.abstractmethod
    def owns(self, value: Any) -> bool:
        """Whether ``value`` is an array (or 0-d value) of this backend."""

    def flatten(self, tree: Any) -> tuple[list[Any], Any]:
        """Return the leaves of ``tree`` and a spec to rebuild it."""
        return _tree.flatten(tree)

    def unflatten(self, spec: Any, leaves: list[Any]) -> Any:
        """Rebuild a tree from a spec returned by :meth:`flatten`."""
        return _tree.unflatten(spec, leaves)

    def leaf_paths(self, spec: Any) -> list[str]:
        """A readable path for every leaf of a flattened tree (used only in reports)."""
        return _tree.leaf_paths(spec)

    def dtype_name(self, leaf: Any) -> str:
        """The name of ``leaf``'s dtype, e.g. ``"float16"``."""
        return str(getattr(leaf.dtype, "name", leaf.dtype)).replace("torch.", "")

    def is_floating(self, leaf: Any) -> bool:
        """Whether ``leaf`` has a real floating-point dtype."""
        return self.is_floating_dtype(leaf.dtype)

    @abc.abstractmethod
    def is_floating_dtype(self, dtype: Any) -> bool:
        """Whether ``dtype`` is a real floating-point dtype."""

    def validate(self, leaves: Sequence[Any], spec: Any, what: str = "gradient") -> set[Any] | None:
        """Raise ``TypeError`` unless every leaf is a floating array of this backend.

        One pass over the leaves' types and one over their dtypes (sets), so that thousands of
        leaves cost microseconds; the offending leaf is looked up only to name it in the error.
        Nothing is modified before this check passes. Returns the set of the leaves' dtypes
        (``None`` where a backend does not collect it).
        """
        for kind in set(map(type, leaves)):
            if not self.owns_type(kind):
                index = next(i for i, leaf in enumerate(leaves) if type(leaf) is kind)
                self._reject(leaves, spec, index, what)
        dtypes = {leaf.dtype for leaf in leaves}
        for dtype in dtypes:
            if not self.is_floating_dtype(dtype):
                index = next(i for i, leaf in enumerate(leaves) if leaf.dtype == dtype)
                raise leaf_error(
                    TypeError,
                    f"{what} {{}} has dtype {self.dtype_name(leaves[index])}; it must be floating point "
                    "(float16, bfloat16, float32 or float64)",
                    index,
                    paths=self.leaf_paths(spec) if spec is not None else None,
                )
        return dtypes

    def warn_if_half_kept(self, config: ScalerConfig, dtypes: set[Any]) -> None:
        """Warn once per process when float16 (or float8) gradients are unscaled in their own dtype.

        torch refuses float16 gradients in ``unscale_`` for this reason, and jmp's ``unscale``
        returns float32: an unscaled float16 gradient below 2**-24 is 0, below 2**-14 it loses
        bits. ``dtypes``: those of a tree about to be unscaled (:meth:`validate`'s).
        """
        global _HALF_KEPT_WARNED
        if _HALF_KEPT_WARNED:
            return
        for dtype in dtypes:
            if dtype in WIDE_DTYPES:
                continue
            name = str(getattr(dtype, "name", dtype)).replace("torch.", "")
            if name != "float16" and not name.startswith("float8"):
                if len(WIDE_DTYPES) < 64:
                    WIDE_DTYPES.add(dtype)
                continue
            if config.grad_dtype == "keep" and config.scales:
                _HALF_KEPT_WARNED = True
                warnings.warn(
                    f"{name} gradients are unscaled in {name} on the {self.name} backend "
                    "(grad_dtype='keep'): once unscaled, a float16 gradient below 2**-24 (6e-08) in magnitude is "
                    "0 and one below 2**-14 (6.1e-05) loses precision, so the small gradients the scale kept from "
                    "underflowing in the backward pass underflow again. torch refuses float16 gradients here; "
                    "jmp returns float32. Pass grad_dtype='promote' to get float32 gradients, or keep float32 "
                    "gradients (master weights). Shown once per process.",
                    AmpscaleWarning,
                    stacklevel=4,
                )
                return

    def adopt_scaler(self, scaler_type: type[Any], pending_type: type[Any]) -> None:
        """Register the scaler classes with the framework where it needs them (JAX: as pytrees).

        Called once per adapter by the scaler's layer (see :func:`when_adapter_ready`); nothing
        to do by default.
        """
        return

    @abc.abstractmethod
    def owns_type(self, kind: type) -> bool:
        """Whether arrays of type ``kind`` belong to this backend."""

    def _reject(self, leaves: Sequence[Any], spec: Any, index: int, what: str) -> None:
        leaf = leaves[index]
        paths = self.leaf_paths(spec) if spec is not None else None
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        other = framework_of(leaf)
        if other is not None:
            raise leaf_error(
                TypeError,
                f"{what} {{}} is a {other} array ({kind}), but this call is handled by "
                f"the {self.name} backend (the scaler's, or that of the other arrays): one call "
                "takes one framework's arrays; move a scaler between frameworks with "
                "create_scaler(backend=...).load_state_dict(scaler.state_dict())",
                index,
                paths=paths,
            )
        raise leaf_error(
            TypeError,
            f"{what} {{}} is a {kind}, not a {self.name} array; every leaf must be a "
            "floating-point array (None leaves are skipped)",
            index,
            paths=paths,
        )

    # -- the fused hot path -------------------------------------------------------------------
    @abc.abstractmethod
    def check_and_unscale(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any]:
        """Check every leaf for inf/nan and multiply it by ``inv_scale`` (``None``: check only).

        Returns the unscaled leaves (the same objects where they were unscaled in place) and a
        0-d bool that is true when every unscaled value is finite: the check is on the values
        written (on the inputs when ``inv_scale`` is ``None``), exactly, with no reduction that
        a finite value could overflow. So with a scale below 1, a finite input whose unscaled
        value overflows makes the flag false.
        """

    def promote(self, leaves: Sequence[Any]) -> list[Any]:
        """Float32 copies of the leaves narrower than float32 (``grad_dtype="promote"``).

        float16 and bfloat16 leaves become new float32 arrays (exact: every such value is a
        float32 value); float32 and float64 leaves are returned as they are.
        """
        xp = self.namespace()
        narrow = ("float16", "bfloat16")
        return [xp.astype(leaf, xp.float32) if self.dtype_name(leaf) in narrow else leaf for leaf in leaves]

    def check_and_unscale_bounded(
        self, leaves: Sequence[Any], inv_scale: Any, scale_floor: float | None
    ) -> tuple[list[Any], Any]:
        """:meth:`check_and_unscale`, told ``scale_floor``: a lower bound of a device scale known
        on the host (``None``: unknown). A backend whose kernel checks the inputs uses it to skip
        the check of the values written while the scale is at least 1."""
        return self.check_and_unscale(leaves, inv_scale)

    def all_finite(self, leaves: Sequence[Any]) -> Any:
        """A 0-d bool: whether every element of every leaf is finite."""
        return self.check_and_unscale(leaves, None)[1]

    def fused_unscale(
        self, config: ScalerConfig, state: Any, leaves: list[Any], loss: Any, scale_floor: float | None = None
    ) -> tuple[list[Any], Any, Any] | None:
        """Check and unscale ``leaves`` (and check ``loss``) with the state transition in the same
        launch, where a backend can (CUDA); ``None`` otherwise (the default).

        Returns ``(leaves, finite, loss_finite)``: ``finite`` already includes the loss, and
        :meth:`run_transition` given these very flag objects returns the next state computed
        with them, without another launch. ``loss_finite`` is ``None`` when ``loss`` is.
        ``scale_floor``: a lower bound of the scale known on the host (see
        :meth:`check_and_unscale_bounded`).

        A state packed in one device record (:class:`~ampscale._native.cuda._packed.PackedState`)
        goes to :meth:`fused_unscale_packed`, with the leaves promoted first where the settings
        say so (``grad_dtype="promote"``: float32 copies of the 16-bit leaves are checked and
        unscaled); any other state has no one-launch step.
        """
        if not isinstance(state, PackedState):
            return None
        if config.grad_dtype == "promote":
            leaves = self.promote(leaves)
        return self.fused_unscale_packed(config, state, leaves, loss, scale_floor)

    def fused_unscale_packed(
        self, config: ScalerConfig, state: PackedState, leaves: list[Any], loss: Any, scale_floor: float | None
    ) -> tuple[list[Any], Any, Any] | None:
        """:meth:`fused_unscale` for a packed state (a backend's one-launch step); ``None``: none."""
        return None

    def check_unscale_and_count(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any, Any]:
        """:meth:`check_and_unscale`, plus the fraction of input values that are zero or subnormal.

        The default counts with one more reduction over the inputs, before they are unscaled
        (backends with a fused kernel count in the same pass). Used only when underflow
        tracking is asked for, so the common path pays nothing.
        """
        xp = self.namespace()
        tiny = None
        total = 0
        for leaf in leaves:
            smallest = xp.finfo(leaf.dtype).smallest_normal
            count = xp.sum(xp.astype(xp.abs(leaf) < smallest, xp.int64))
            tiny = count if tiny is None else tiny + count
            total += math.prod(leaf.shape)
        out, finite = self.check_and_unscale(leaves, inv_scale)
        if tiny is None or total == 0:
            return out, finite, xp.asarray(0.0, dtype=xp.float32)
        return out, finite, xp.astype(tiny, xp.float64 if self.has_float64(leaves[0]) else xp.float32) / total

    def count_nonfinite(self, leaves: Sequence[Any]) -> list[tuple[int, int, int]]:
        """For each leaf, ``(nan count, +inf count, -inf count)`` (host values; a sync)."""
        xp = self.namespace()
        out = []
        for leaf in leaves:
            nan = int(xp.sum(xp.astype(xp.isnan(leaf), xp.int64)))
            pos = int(xp.sum(xp.astype(leaf == float("inf"), xp.int64)))
            neg = int(xp.sum(xp.astype(leaf == float("-inf"), xp.int64)))
            out.append((nan, pos, neg))
        return out

    # -- state ----------------------------------------------------------------------------
    @abc.abstractmethod
    def namespace(self) -> Any:
        """The array-API namespace of this backend."""

    def has_float64(self, like: Any) -> bool:
        """Whether float64 arithmetic is available on ``like``'s device."""
        return True

    def device_of(self, like: Any) -> Any:
        """The device of an array (``None`` when it has none or ``like`` is None)."""
        if like is None or not hasattr(like, "device"):
            return None
        return like.device

    def make_state(self, values: ScalerState, config: ScalerConfig, like: Any = None, previous: Any = None) -> Any:
        """Turn Python-scalar state ``values`` into this backend's stored state near ``like``.

        ``previous`` is ``(old_state, old_values)`` on host backends, so unchanged fields can
        keep their objects.
        """
        xp = self.namespace()
        device = self.device_of(like)
        storage = xp.float64 if config.scale_dtype == "float64" and self.has_float64(like) else xp.float32
        return ScalerState(
            *(
                xp.asarray(v, dtype=xp.int32 if f in INT_FIELDS else storage, device=device)
                for f, v in zip(ScalerState._fields, values, strict=True)
            )
        )

    def read_state(self, state: ScalerState) -> ScalerState:
        """The state as Python scalars (a host transfer for device backends)."""
        return ScalerState(
            *(int(v) if f in INT_FIELDS else float(v) for f, v in zip(ScalerState._fields, state, strict=True))
        )

    def unpack(self, state: Any) -> ScalerState:
        """The state as named 0-d fields (backends may store it packed; default: as is)."""
        return state  # type: ignore[no-any-return]

    def pack(self, fields: ScalerState) -> Any:
        """The inverse of :meth:`unpack`."""
        return fields

    def run_transition(
        self, config: ScalerConfig, state: Any, finite: Any, loss_finite: Any, ops: Any
    ) -> tuple[Any, ScalerState | None, Any]:
        """One step of the state machine on device state (host backends use ``ops.run``).

        Returns ``(next stored state, its fields or None, floor_event)``; the fields are needed
        only when ``floor_event`` is traced (to report from inside a trace), so backends that
        run the transition as one compiled call eagerly may return ``None`` for them.
        """
        fields = self.unpack(state)
        finite = self.as_bool(finite, fields.scale)
        # ops' own constant for an unchecked loss: on torch and CuPy devices, made once
        loss_ok = ops.as_bool(True) if loss_finite is None else self.as_bool(loss_finite, fields.scale)
        # ops may run a float32 stand-in of a float64 config (see ampscale._ops.float32_stand_in)
        new_fields, floor_event = transition(getattr(ops, "config", config), fields, finite, loss_ok, ops)
        return self.pack(new_fields), new_fields, floor_event

    def scale_of(self, state: Any) -> Any:
        """The current scale, a 0-d value of this backend (or a host scalar)."""
        return self.unpack(state).scale

    def inverse_of(self, state: Any) -> Any:
        """The inverse scale for unscaling with ``state`` (packed states keep it precomputed)."""
        if isinstance(state, PackedState):
            return state.view("inv_scale")  # computed by the launch that wrote the state
        return self.inverse_scale(self.scale_of(state))

    def host(self, state: ScalerState) -> bool:
        """Whether ``state`` lives in host memory, so the transition runs on Python scalars."""
        return self.host_state

    def public_state(self, state: ScalerState, config: ScalerConfig) -> ScalerState:
        """The state as users see it (``Scaler.state``): 0-d values of this backend."""
        return state

    def ops(self, config: ScalerConfig, state: ScalerState) -> ArrayOps | HostOps:
        """The operations :func:`~ampscale._core.transition` runs with for this state."""
        return ArrayOps(config, self.namespace(), self.device_of(state.scale), self.has_float64(state.scale))

    def state_device_matches(self, state: ScalerState, like: Any) -> bool:
        """Whether ``state`` already lives where arrays like ``like`` live."""
        return True

    # -- small array helpers ------------------------------------------------------------
    def multiply_by_scale(self, loss: Any, scale: Any) -> Any:
        """``loss * scale`` with the framework's own type promotion (scale cast to float32)."""
        xp = self.namespace()
        return loss * xp.astype(scale, xp.float32)

    def inverse_scale(self, scale: Any) -> Any:
        """``float32(1 / float64(scale))`` as torch computes it, on the scale's device."""
        xp = self.namespace()
        wide = xp.float64 if self.has_float64(scale) else xp.float32
        return xp.astype(1 / xp.astype(scale, wide), xp.float32)

    def logical_and(self, a: Any, b: Any) -> Any:
        """Elementwise and of two 0-d bools."""
        return self.namespace().logical_and(a, b)

    def to_device_of(self, value: Any, like: Any) -> Any:
        """Move a 0-d value to ``like``'s device (no-op for single-device backends)."""
        return value

    def own_flag(self, finite: Any) -> Any:
        """``finite`` as an object that no other step's flag is (``Scaler.update`` tells a flag
        already counted from a new one by identity). Arrays made per call already are."""
        return finite

    def as_bool(self, value: Any, like: Any = None) -> Any:
        """A 0-d bool of this backend from a Python bool or a 0-d array."""
        xp = self.namespace()
        if isinstance(value, bool):
            return xp.asarray(value, dtype=xp.bool, device=self.device_of(like))
        return value

    def is_tracing(self, value: Any) -> bool:
        """Whether ``value`` is a traced placeholder (under ``jax.jit`` and friends)."""
        return False

    # -- control flow and agreement --------------------------------------------------------
    def host_flag(self, finite: Any) -> bool | None:
        """The value of a step's flag where reading it costs no sync (it is in host memory),
        else ``None``: :meth:`apply_if` and :meth:`apply_in_place` then skip an overflowed
        step without calling ``update_fn``. The default: a flag on a device."""
        return None

    def apply_if(
        self,
        finite: Any,
        update_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
        params: Any,
        grads: Any,
        opt_state: Any,
        *,
        flat: tuple[tuple[list[Any], Any], tuple[list[Any], Any]] | None = None,
    ) -> tuple[Any, Any]:
        """Return ``update_fn(params, grads, opt_state)`` if ``finite``, else the inputs unchanged.

        A flag in host memory (:meth:`host_flag`) decides in Python: no work on a skipped step.
        A flag on a device: the update is computed and selected leaf by leaf with ``where``, no
        host branch, and on a skipped step the returned leaves equal the inputs bitwise;
        ``update_fn`` must then be functional (return new arrays, not modify its inputs).
        ``flat``: ``params`` and ``opt_state`` as :meth:`flatten` returns them, where the
        caller has them (each tree is flattened once per step).
        """
        on_host = self.host_flag(finite)
        if on_host is not None:
            return update_fn(params, grads, opt_state) if on_host else (params, opt_state)
        new_params, new_opt_state = update_fn(params, grads, opt_state)
        flat_params, flat_opt_state = (None, None) if flat is None else flat
        return (
            self.select_tree(finite, new_params, params, flat_params),
            self.select_tree(finite, new_opt_state, opt_state, flat_opt_state),
        )

    def apply_in_place(
        self,
        finite: Any,
        update_fn: Callable[[Any, Any, Any, Any], tuple[Any, Any]],
        params: Any,
        grads: Any,
        opt_state: Any,
    ) -> tuple[Any, Any]:
        """``update_fn(params, grads, opt_state, finite)``: an update that writes in place and
        takes the flag, applying itself only where it is true (:func:`ampscale.masked_add_`),
        as torch's fused optimizers take ``found_inf``. Called on every step with a flag on a
        device (no sync); not called on an overflow where the flag is in host memory
        (:meth:`host_flag`).
        """
        if self.host_flag(finite) is False:
            return params, opt_state
        return update_fn(params, grads, opt_state, finite)

    @contextlib.contextmanager
    def guard_writes(self, arrays: Sequence[Any]) -> Iterator[WriteGuard]:
        """Watch ``arrays`` for in-place writes while the block runs (``Scaler.step``'s check of
        ``update_fn``). The default cannot see writes (CuPy: its arrays have no read-only flag
        nor version counter)."""
        yield WriteGuard(exact=False)

    def copy_leaf(self, leaf: Any) -> Any:
        """A copy of an array of this backend, on its device (``Scaler.step``'s check of a new
        ``update_fn`` runs it on copies)."""
        return self.namespace().asarray(leaf, copy=True)

    def same_bits(self, a: Any, b: Any) -> bool:
        """Whether two arrays of one shape and dtype hold the same values (a host read).

        The default compares values, nan equal to nan: a write that only flips the sign of a
        zero or a nan's payload is not seen. Backends that can view the bits override it.
        """
        xp = self.namespace()
        same = xp.logical_or(a == b, xp.logical_and(xp.isnan(a), xp.isnan(b))) if self.is_floating(a) else a == b
        return bool(xp.all(same))

    def masked_add_(self, finite: Any, targets: Sequence[Any], updates: Sequence[Any], alpha: float) -> None:
        """``t += alpha * u`` in place for each pair where the 0-d ``finite`` is true; ``t``
        unchanged, bitwise, where it is false (even when ``u`` holds inf or nan). No host sync:
        the default selects on the device (``t[...] = where(finite, t + alpha * u, t)``)."""
        xp = self.namespace()
        flag = self.as_bool(finite, targets[0] if targets else None)
        for target, update in zip(targets, updates, strict=True):
            new = target + (update if alpha == 1 else alpha * update)
            target[...] = xp.where(flag, _as_dtype(xp, new, target.dtype), target)

    def masked_copy_(self, finite: Any, targets: Sequence[Any], values: Sequence[Any]) -> None:
        """``t[...] = v`` for each pair where the 0-d ``finite`` is true (``t`` unchanged,
        bitwise, where it is false); no host sync."""
        xp = self.namespace()
        flag = self.as_bool(finite, targets[0] if targets else None)
        for target, value in zip(targets, values, strict=True):
            target[...] = xp.where(flag, _as_dtype(xp, value, target.dtype), target)

    def select_tree(
        self, condition: Any, on_true: Any, on_false: Any, flat_on_false: tuple[list[Any], Any] | None = None
    ) -> Any:
        """``where(condition, a, b)`` leaf by leaf over two trees of the same structure
        (``flat_on_false``: ``on_false`` flattened already)."""
        xp = self.namespace()
        true_leaves, spec = self.flatten(on_true)
        false_leaves = self.flatten(on_false)[0] if flat_on_false is None else flat_on_false[0]
        if len(true_leaves) != len(false_leaves):
            raise ValueError(
                f"update_fn returned a tree with {len(true_leaves)} leaves for one with "
                f"{len(false_leaves)}; it must keep the structure of params and opt_state"
            )
        picked = [
            xp.where(condition, a, b) if self.owns(a) else (a if a is b else _differs(a, b))
            for a, b in zip(true_leaves, false_leaves, strict=True)
        ]
        return self.unflatten(spec, picked)

    def agree(self, finite: Any, group: Any) -> Any:
        """Combine ``finite`` across the devices or processes of ``group`` (logical and)."""
        if group is None:
            return finite
        if callable(group):  # the user's own collective (mpi4py, ...): one flag in, one out
            return self.as_bool(group(finite), finite)
        raise ValueError(f"backend {self.name!r} has no cross-device agreement; got group={shown(group)}")

    def agree_flags(self, finite: Any, loss_finite: Any, group: Any) -> tuple[Any, Any]:
        """Both flags of a step (the gradients' and the scaled loss's) agreed across ``group``.

        Backends with collectives reduce the two in one operation (a 2-element all-reduce), so
        a step with a loss check costs one collective, not two; the default, and a callable
        ``group`` (which takes one flag), agree each flag in turn.
        """
        return self.agree(finite, group), self.agree(loss_finite, group)

    def __repr__(self) -> str:
        return f"<ampscale backend {self.name!r}>"


def _as_dtype(xp: Any, value: Any, dtype: Any) -> Any:
    return value if value.dtype == dtype else xp.astype(value, dtype)


def _differs(a: Any, b: Any) -> Any:
    if a == b:
        return a
    raise TypeError(
        f"update_fn changed a non-array leaf from {b!r} to {a!r}; keep non-array leaves fixed or "
        "make them arrays so a skipped step can restore them without a host branch"
    )
