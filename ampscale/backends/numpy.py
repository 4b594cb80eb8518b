"""NumPy backend: the reference backend, fused and multi-threaded.

Adapters' layer.

Contiguous float16, bfloat16 (``ml_dtypes``), float32 and float64 arrays go through the native
kernel (``ampscale/_native/cpu/_numpy.c``): one pass over memory per element (check the exponent bits, multiply in
float32, write back), the GIL released, large trees split across threads. Anything else
(strided views, read-only arrays, other float dtypes, or a build without the kernel) takes an
exact pure-NumPy path that works block by block so each block is checked while it is in cache.

The state lives in host memory as NumPy scalars; the transition runs on Python scalars.
"""

from __future__ import annotations

import contextlib
import operator
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ampscale._config import ScalerConfig
from ampscale._core import INT_FIELDS, ScalerState
from ampscale._errors import PerformanceWarning
from ampscale._ops import HostOps, host_ops
from ampscale.backends._base import (
    Backend,
    ReadOnlyGuard,
    WriteGuard,
    adapter_ready,
    internal_overlap_error,
    may_overlap_itself,
    overlap_error,
    read_only,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

_native: Any
try:
    from ampscale._native.cpu import _numpy as _native
except ImportError:  # pragma: no cover - exercised only on builds without a C compiler
    _native = None

__all__ = ["BACKEND", "NATIVE", "NumpyBackend", "kernel_isa", "num_threads"]

#: Whether the fused native kernel is available (``False`` means the pure-NumPy path).
NATIVE = _native is not None

_KIND_BY_NAME = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
_kind_by_dtype: dict[Any, int | None] = {}


def _native_kind(dtype: Any) -> int | None:
    """The native kernel's code for ``dtype`` (cached: ``dtype.name`` is slow in NumPy)."""
    try:
        return _kind_by_dtype[dtype]
    except KeyError:
        kind = _KIND_BY_NAME.get(dtype.name) if dtype.isnative or dtype.itemsize == 1 else None
        _kind_by_dtype[dtype] = kind
        return kind


_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # moved in NumPy 2
_BLOCK = 1 << 16  # elements per block on the pure-NumPy path (fits in L2 with room to spare)
_warned_no_native = False
_inverses: dict[float, float] = {}
_SIZE = operator.attrgetter("size")  # float32(1 / scale), as torch computes it, per scale value


def kernel_isa() -> str:
    """The native kernel family in use (``"avx512"``, ``"avx2+f16c"``, ``"generic"``), or
    ``"pure-numpy"`` when the kernel is not built."""
    return _native.use_isa("best") if NATIVE else "pure-numpy"


def num_threads() -> int:
    """Threads used for large trees: ``AMPSCALE_NUM_THREADS``, else the usable cores (max 8)."""
    value = os.environ.get("AMPSCALE_NUM_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"AMPSCALE_NUM_THREADS must be a positive integer; got {value!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _is_floating_dtype(dtype: np.dtype) -> bool:
    if dtype.kind == "f":
        return True
    # ml_dtypes types (bfloat16, float8_*) are kind 'V' with a floating finfo.
    return dtype.kind == "V" and dtype.name.startswith(("bfloat16", "float8", "float6", "float4"))


class NumpyBackend(Backend):
    """The NumPy adapter."""

    name: ClassVar[str] = "numpy"
    host_state: ClassVar[bool] = True
    in_place: ClassVar[bool] = True

    def __init__(self) -> None:
        self.threads = num_threads()

    def owns(self, value: Any) -> bool:
        return isinstance(value, (np.ndarray, np.generic))

    def owns_type(self, kind: type) -> bool:
        return issubclass(kind, (np.ndarray, np.generic))

    def is_floating_dtype(self, dtype: Any) -> bool:
        return _is_floating_dtype(dtype)

    def namespace(self) -> Any:
        import array_api_compat.numpy as xp

        return xp

    # -- hot path ---------------------------------------------------------------------------
    def check_unscale_and_count(self, leaves: Sequence[Any], inv_scale: Any) -> tuple[list[Any], Any, Any]:
        # Counted in the same pass: by the native kernel, or by the exact fallback for the rest.
        total = sum(map(_SIZE, leaves))
        tiny = [0]
        out, finite = self.check_and_unscale(leaves, inv_scale, _tiny=tiny)
        return out, finite, np.float64(tiny[0] / total if total else 0.0)

    def check_and_unscale(
        self, leaves: Sequence[Any], inv_scale: Any, _tiny: list[int] | None = None
    ) -> tuple[list[Any], Any]:
        leaves = list(leaves)
        multiply = inv_scale is not None
        inv = 1.0 if inv_scale is None else float(inv_scale)
        if not NATIVE:
            _warn_no_native()
            # The kernel finds aliasing in C; without it, the same check runs here, before any
            # leaf changes: a buffer repeated is unscaled once, overlapping ones are refused.
            repeats = _aliases(leaves) if multiply else {}
            unique = [i for i in range(len(leaves)) if i not in repeats]
            out, finite_flag = self._fallback(list(leaves), inv, multiply, unique, _tiny)
            return _share_repeats(out, leaves, repeats), finite_flag
        dtypes = [leaf.dtype for leaf in leaves]
        groups: dict[Any, list[int] | range]
        if len(set(dtypes)) == 1:
            groups = {dtypes[0]: range(len(leaves))}
        else:
            groups = {}
            for index, dtype in enumerate(dtypes):
                groups.setdefault(dtype, []).append(index)  # type: ignore[union-attr]
        skip: dict[int, int] = {}
        if multiply and (len(groups) > 1 or _native_kind(dtypes[0]) is None):
            # Several kernel calls: aliasing across them is found here, before any of them runs
            # (one call finds it among its own buffers, in C).
            skip = _aliases(leaves)
            if skip:
                groups = {d: [i for i in ix if i not in skip] for d, ix in groups.items()}
        finite = True
        leftovers: list[int] = []
        for dtype, indices in groups.items():
            kind = _native_kind(dtype)
            if kind is None:
                leftovers.extend(indices)
                continue
            arrays = leaves if len(indices) == len(leaves) else [leaves[i] for i in indices]
            if kind == 1:  # bfloat16 exports no buffer format: hand over its bits
                arrays = [a.view(np.uint16) if isinstance(a, np.ndarray) else a for a in arrays]
            try:
                if _tiny is not None:  # underflow tracking: count in the same pass
                    group_finite, count = _native.check_and_unscale(arrays, kind, inv, multiply, self.threads, True)
                    finite &= group_finite
                    _tiny[0] += count
                    continue
                finite &= _native.check_and_unscale(arrays, kind, inv, multiply, self.threads)
            except _native.OverlapError as exc:
                first, second = (indices[i] for i in exc.args)
                raise overlap_error(first, second) from None
            except (BufferError, ValueError, TypeError):
                # Some arrays are strided or read-only: run the kernel on the others, once it is
                # known that no location is reached twice (nothing has changed yet).
                if multiply and not skip:
                    skip = _aliases(leaves)
                    indices = [i for i in indices if i not in skip]
                usable = [i for i in indices if _native_ok(leaves[i], multiply)]
                rest = [i for i in indices if not _native_ok(leaves[i], multiply)]
                if usable:
                    arrays = [leaves[i].view(np.uint16) if kind == 1 else leaves[i] for i in usable]
                    if _tiny is not None:  # underflow tracking: these leaves are counted too
                        group_finite, count = _native.check_and_unscale(arrays, kind, inv, multiply, self.threads, True)
                        finite &= group_finite
                        _tiny[0] += count
                    else:
                        finite &= _native.check_and_unscale(arrays, kind, inv, multiply, self.threads)
                leftovers.extend(rest)
        inputs = list(leaves)
        if leftovers:
            leaves, rest_finite = self._fallback(leaves, inv, multiply, leftovers, _tiny)
            finite &= bool(rest_finite)
        return _share_repeats(leaves, inputs, skip), np.bool_(finite)

    def _fallback(
        self, leaves: list[Any], inv: float, multiply: bool, indices: Any, tiny: list[int] | None = None
    ) -> tuple[list[Any], Any]:
        """Exact pure-NumPy check and unscale, block by block (and the underflow count, if asked)."""
        finite = True
        for i in indices:
            if tiny is not None:
                values = np.asarray(leaves[i])
                wide = values.astype(np.float64) if values.dtype.kind != "f" or values.itemsize < 4 else values
                tiny[0] += int(np.count_nonzero(np.abs(wide) < _smallest_normal(values.dtype)))
            leaf, leaf_finite = _check_and_unscale_numpy(leaves[i], inv, multiply and inv != 1.0)
            leaves[i] = leaf
            finite &= leaf_finite
        return leaves, np.bool_(finite)

    # -- state ------------------------------------------------------------------------------
    def make_state(
        self, values: ScalerState, config: ScalerConfig, like: Any = None, previous: Any = None
    ) -> ScalerState:
        # The state lives in host memory: keep it as Python scalars, on which the transition
        # runs several times faster than on NumPy scalars. ``Scaler.state`` exposes NumPy
        # scalars (``public_state``).
        return values if type(values) is ScalerState else ScalerState._make(values)

    def read_state(self, state: ScalerState) -> ScalerState:
        return state

    def public_state(self, state: ScalerState, config: ScalerConfig) -> ScalerState:
        return ScalerState._make([t(v) for v, t in zip(state, _field_types(config), strict=True)])

    def ops(self, config: ScalerConfig, state: ScalerState) -> HostOps:
        return config._cache.get("host") or host_ops(config)  # (the read inline: every step)

    def multiply_by_scale(self, loss: Any, scale: Any) -> Any:
        scaled = loss * np.float32(scale)
        if isinstance(loss, np.ndarray) and not isinstance(scaled, np.ndarray):
            return np.asarray(scaled)  # NumPy unwraps 0-d results; keep the caller's array type
        return scaled

    def inverse_scale(self, scale: Any) -> float:
        inverse = _inverses.get(scale)
        if inverse is None:
            if len(_inverses) > 1024:
                _inverses.clear()
            with np.errstate(over="ignore"):  # a scale below 2**-128: inf, so every step is flagged
                inverse = _inverses[scale] = float(np.float32(1.0 / float(scale)))
        return inverse

    def logical_and(self, a: Any, b: Any) -> Any:
        return np.bool_(bool(a) and bool(b))

    def as_bool(self, value: Any, like: Any = None) -> Any:
        return np.bool_(bool(value))

    def own_flag(self, finite: Any) -> Any:
        # NumPy's booleans are two shared objects (np.True_, np.False_): a step's flag would be
        # every step's. A 0-d array is a new object per step, and still a 0-d bool array.
        return np.array(finite)

    def host_flag(self, finite: Any) -> bool:
        return bool(finite)  # host memory: a skipped step does no work at all

    def copy_leaf(self, leaf: Any) -> Any:
        return leaf.copy()

    def same_bits(self, a: Any, b: Any) -> bool:
        return _same_bits(a, b)

    @contextlib.contextmanager
    def guard_writes(self, arrays: Sequence[Any]) -> Iterator[WriteGuard]:
        # Read-only for the call: the first in-place write raises, before it changes anything.
        with read_only(arrays):
            yield ReadOnlyGuard(exact=True)

    def masked_add_(self, finite: Any, targets: Sequence[Any], updates: Sequence[Any], alpha: float) -> None:
        if bool(finite):  # host memory: nothing to do on an overflow
            for target, update in zip(targets, updates, strict=True):
                target += update if alpha == 1 else alpha * update

    def masked_copy_(self, finite: Any, targets: Sequence[Any], values: Sequence[Any]) -> None:
        if bool(finite):
            for target, value in zip(targets, values, strict=True):
                np.copyto(target, value, casting="same_kind")

    def count_nonfinite(self, leaves: Sequence[Any]) -> list[tuple[int, int, int]]:
        out = []
        for leaf in leaves:
            values = np.asarray(leaf)
            if not _is_floating_dtype(values.dtype) or values.dtype.kind != "f":
                values = values.astype(np.float32)
            out.append(
                (
                    int(np.count_nonzero(np.isnan(values))),
                    int(np.count_nonzero(np.isposinf(values))),
                    int(np.count_nonzero(np.isneginf(values))),
                )
            )
        return out


def _field_types(config: ScalerConfig) -> tuple[Any, ...]:
    types = config._cache.get("numpy-types")
    if types is None:
        scale_type = np.float64 if config.scale_dtype == "float64" else np.float32
        types = tuple(np.int32 if f in INT_FIELDS else scale_type for f in ScalerState._fields)
        config._cache["numpy-types"] = types
    return types  # type: ignore[no-any-return]


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays with the same byte bounds hold exactly the same elements, as one dtype."""
    if a.dtype != b.dtype or a.flags.writeable != b.flags.writeable:
        return False
    if a.shape == b.shape and a.strides == b.strides:
        return True
    dense = (a.flags.c_contiguous or a.flags.f_contiguous) and (b.flags.c_contiguous or b.flags.f_contiguous)
    return bool(dense)  # same bytes, no gaps: the same elements in another order


def _share_repeats(out: list[Any], inputs: list[Any], repeats: dict[int, int]) -> list[Any]:
    """Each repeated leaf comes back as its first occurrence's result.

    Unscaled in place, the repeat already holds the new values (the same memory); a read-only
    leaf is unscaled into a new array, which its repeats must return too, not the old values.
    """
    for repeat, first in repeats.items():
        if out[first] is not inputs[first]:
            out[repeat] = out[first]
    return out


def _aliases(leaves: list[Any]) -> dict[int, int]:
    """Leaves that repeat another one's elements (to unscale once): repeat index -> that leaf's.

    Raises :class:`AliasedGradientsError` when two leaves share memory in part (or as two
    dtypes, or a read-only view overlaps a writable one), or when a writable leaf's elements
    overlap each other (a stride of 0): no unscale could then change each value once.
    """
    extents = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, np.ndarray) and leaf.size:
            if leaf.flags.writeable and not (leaf.flags.c_contiguous or leaf.flags.f_contiguous):
                _refuse_internal_overlap(leaf, index)
            low, high = _byte_bounds(leaf)
            extents.append((low, high, index))
    if len(extents) < 2:
        return {}
    extents.sort()
    duplicates: dict[int, int] = {}
    active: list[tuple[int, int, int]] = []  # extents that reach past the current start
    for low, high, index in extents:
        active = [e for e in active if e[1] > low]
        for other_low, other_high, other in active:
            a, b = leaves[other], leaves[index]
            if other_low == low and other_high == high and _same_elements(a, b):
                duplicates[index] = other  # never itself a repeat: repeats are not kept in `active`
                break
            if np.shares_memory(a, b):
                raise overlap_error(min(index, other), max(index, other))
        else:
            active.append((low, high, index))
    return duplicates


def _refuse_internal_overlap(leaf: np.ndarray, index: int) -> None:
    """Refuse a writable array whose elements may share memory (``as_strided`` with stride 0)."""
    if may_overlap_itself(leaf.shape, leaf.strides, leaf.itemsize):
        raise internal_overlap_error(index, leaf.shape, leaf.strides, "numpy.ascontiguousarray")


def _native_ok(leaf: Any, multiply: bool) -> bool:
    if not isinstance(leaf, np.ndarray):
        return not multiply
    flags = leaf.flags
    return (flags.c_contiguous or flags.f_contiguous) and (flags.writeable or not multiply)


def _check_and_unscale_numpy(leaf: Any, inv: float, multiply: bool) -> tuple[Any, bool]:
    """One leaf on the pure-NumPy path: the float32 multiply, then an exact check of the values
    stored (of the input when only checking), as the native kernel does.

    Overflow to inf in the multiply (a scale below 1) is the arithmetic asked for: quietly; the
    flag reports it.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return _check_and_unscale_numpy_quiet(leaf, inv, multiply)


def _check_and_unscale_numpy_quiet(leaf: Any, inv: float, multiply: bool) -> tuple[Any, bool]:
    array = np.asarray(leaf)
    wide = array.dtype.itemsize < 4 or array.dtype.kind != "f"  # half, bfloat16, float8
    if array.dtype.kind == "f" and array.dtype.itemsize >= 4:
        factor: Any = array.dtype.type(np.float32(inv))
    else:
        factor = np.float32(inv)
    finite = True
    in_place = multiply and isinstance(leaf, np.ndarray) and array.flags.writeable
    out = array if in_place or not multiply else np.empty_like(array)
    flat_in = array.reshape(-1) if array.flags.c_contiguous else None
    flat_out = out.reshape(-1) if out.flags.c_contiguous else None
    if flat_in is None or flat_out is None:
        # Strided or transposed: NumPy's own loops handle the strides; one block.
        values = array.astype(np.float32) if wide else array
        if multiply:
            result = values * factor
            stored = result.astype(array.dtype) if wide else result
            out[...] = stored
            values = stored.astype(np.float32) if wide else stored
        finite = bool(np.isfinite(values).all())
    else:
        for start in range(0, flat_in.size, _BLOCK):
            block = flat_in[start : start + _BLOCK]
            values = block.astype(np.float32) if wide else block
            if multiply:
                target = flat_out[start : start + _BLOCK]
                if wide:
                    target[...] = (values * factor).astype(array.dtype)
                    values = target.astype(np.float32)  # as stored: rounding may reach inf
                else:
                    np.multiply(values, factor, out=target)
                    values = target
            # max/min propagate nan and catch +inf/-inf: exact, and no sum that could overflow.
            high, low = values.max(initial=-np.inf), values.min(initial=np.inf)
            finite &= bool(np.isfinite(high) and np.isfinite(low)) or values.size == 0
    if not multiply:
        return leaf, finite
    if isinstance(leaf, np.generic):
        return out[()], finite
    return out, finite


def _smallest_normal(dtype: np.dtype) -> float:
    """The smallest normal value of a floating dtype; NumPy's ``finfo`` rejects ml_dtypes' types."""
    if dtype.kind == "f":
        return float(np.finfo(dtype).smallest_normal)
    import ml_dtypes  # a bfloat16 or float8 array exists, so ml_dtypes is installed

    return float(ml_dtypes.finfo(dtype).smallest_normal)


def _warn_no_native() -> None:
    global _warned_no_native
    if not _warned_no_native:
        _warned_no_native = True
        warnings.warn(
            "ampscale's native NumPy kernel is not built (no C compiler at install time?): the "
            "exact pure-NumPy path is used, several times slower on large or float16 trees. "
            "Reinstall with a C compiler available to build it.",
            PerformanceWarning,
            stacklevel=4,
        )


BACKEND = NumpyBackend()
adapter_ready(BACKEND)


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two NumPy (or NumPy-like: CuPy) arrays of one shape and dtype hold the same bits
    (signed zeros and nan payloads told apart): compared as unsigned integers of their size."""
    if a.dtype.itemsize not in (1, 2, 4, 8):
        return bool((a == b).all())
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    return bool((a.view(unsigned) == b.view(unsigned)).all())
