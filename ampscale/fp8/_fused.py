"""FP8 bookkeeping in one pass over many tensors: every tensor's amax, and its saturated payload.

:func:`amax` reads each leaf of a tree once and returns ``max(|x|)`` of every leaf as one ``[N]``
float32 array, in tree order, on the leaves' framework and device; :func:`amax_and_cast` also
writes each leaf's FP8 payload (``saturate(x * scale)``, the cast of
:func:`ampscale.fp8.quantize`) and counts the elements the saturation clipped, in the same pass.

Exactly the reference values (:func:`ampscale.fp8.tensor_amax`, :func:`ampscale.fp8.quantize`):

* the amax is taken on bits (the sign cleared, the largest magnitude as an unsigned integer), so
  it is NaN if the leaf holds a NaN, else inf if it holds an inf, else ``max(|x|)`` exactly
  (-0 and subnormals included, whatever the floating-point environment flushes), and 0 for an
  empty leaf. A NaN amax is the canonical quiet NaN (the reference's payload depends on which
  element a library's max returns first). So the NaN and inf flags are ``isnan(amax)`` and
  ``isinf(amax)``, and ``finite`` (:func:`amax` with ``with_finite=True``) is the loss scaler's
  gradient flag from the same reduction: true when every amax is finite.
* the payload is bit for bit the framework's own saturating cast: x widened to float32, one
  float32 multiply (``divide``: divide) by the leaf's scale, clip to ``+-fp8_max``, round to
  nearest even; NaN stays NaN, with the framework's NaN byte (E5M2: 0x7e in NumPy and JAX, 0x7f
  in torch) and the product's sign where the format has one.

Per framework (one pass, every dtype of the tree together):

* NumPy, and torch tensors on the CPU: the native kernels (``ampscale/_native/cpu/fp8_kernels.h``,
  the ISA family of the gradient kernels in use), split over threads by bytes; torch tensors
  read through torch's DLPack C exchange API. Non-contiguous leaves are copied first (the copy
  is read by the same pass); without the native kernels, or under a torch function or dispatch
  mode, transform or compilation, the same bit arithmetic in the framework's own operations.
* JAX (under ``jit`` too): an XLA FFI custom call on the CPU over the same kernels
  (:mod:`ampscale.fp8._fused_jax`), else the same bit arithmetic in XLA operations.
* torch on CUDA and CuPy: one launch of ampscale's CUDA kernel (:mod:`ampscale.fp8._fused_cuda`;
  CuPy's payloads are uint8 arrays of the format's bytes: CuPy has no float8 dtype), else the
  same arithmetic in the framework's own operations, on the device, with no host read.
* any other array-API namespace (``array_api_strict``): :func:`amax` only, with the standard's
  functions (which have no bitcast): ``max(|x|)`` with its NaN found on its own, since the
  standard leaves a NaN's ``max`` unspecified. It has no float8 dtype, so no cast.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ampscale import _tree
from ampscale.fp8._cast import fp8_dtype
from ampscale.fp8._config import FORMATS
from ampscale.fp8._ops import framework_of
from ampscale.fp8._pass import ACCEPTED, DIVIDE_IN, FORMAT_CODES, KINDS, check_scales, nan_byte

__all__ = ["FORMAT_CODES", "KINDS", "amax", "amax_and_cast", "check_scales", "nan_byte"]


def _flatten(tree: Any) -> tuple[list[Any], Any, str]:
    """``(leaves, spec, framework)``, the leaves all of one framework (else ``TypeError``)."""
    leaves, spec = _tree.flatten(tree)
    if leaves and _jax_tree(leaves[0]):
        import jax

        leaves, spec = jax.tree_util.tree_flatten(tree)
    if not leaves:
        raise ValueError("tree must hold at least one array; got no leaves")
    types = set(map(type, leaves))  # one framework check per type, not per leaf (trees of thousands)
    first = framework_of_leaf(leaves[0])
    if len(types) > 1:
        frameworks = {kind: framework_of_leaf(next(x for x in leaves if type(x) is kind)) for kind in types}
        for index, leaf in enumerate(leaves):
            if frameworks[type(leaf)] != first:
                raise TypeError(
                    f"tree mixes frameworks: leaf [0] is a {first} array, leaf [{index}] a "
                    f"{frameworks[type(leaf)]} array ({type(leaf).__name__}); give the arrays of one framework"
                )
    return leaves, spec, first


def _jax_tree(first: Any) -> bool:
    """Whether JAX's own flatten must read the tree: its first leaf is a JAX array, or something
    only a registered pytree class can be (JAX imported: a flax or equinox module, a scaler)."""
    if "jax" not in sys.modules:
        return False
    try:
        return framework_of(first) == "jax"
    except TypeError:
        return True


def framework_of_leaf(leaf: Any) -> str:
    """:func:`~ampscale.fp8._ops.framework_of`, with a message that names what was given."""
    try:
        return framework_of(leaf)
    except TypeError:
        raise TypeError(
            f"tree leaves must be NumPy, JAX, torch or CuPy arrays, or arrays of an array-API namespace; got "
            f"{type(leaf).__name__}"
        ) from None


_DTYPE = operator.attrgetter("dtype")
_kind_of_dtype: dict[Any, int | None] = {}


def _kind(dtype: Any) -> int | None:
    """A dtype's KIND_* code (cached: NumPy's ``dtype.name`` costs microseconds)."""
    try:
        return _kind_of_dtype[dtype]
    except KeyError:
        name = getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]  # torch.float32 -> float32
        kind = _kind_of_dtype[dtype] = KINDS.get(name)
        return kind


def _kinds(leaves: Sequence[Any]) -> list[int]:
    """Each leaf's KIND_* code; ``TypeError`` naming the first leaf of another dtype."""
    dtypes = list(map(_DTYPE, leaves))
    codes = {dtype: _kind(dtype) for dtype in set(dtypes)}
    if None in codes.values():
        index = next(i for i, d in enumerate(dtypes) if codes[d] is None)
        name = getattr(dtypes[index], "name", None) or str(dtypes[index]).rsplit(".", 1)[-1]
        raise TypeError(f"leaf [{index}] has dtype {name}; FP8 amaxes are taken of {ACCEPTED} arrays")
    if len(codes) == 1:
        return [next(iter(codes.values()))] * len(leaves)  # type: ignore[list-item]
    return [codes[d] for d in dtypes]  # type: ignore[misc]


def _check_format(fmt: Any) -> str:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}; got {fmt!r}")
    return fmt


def amax(tree: Any, *, with_finite: bool = False) -> Any:
    """``max(|x|)`` of every leaf of ``tree``, in one pass: an ``[N]`` float32 array in tree order.

    Args:
        tree: arrays of one framework (NumPy, JAX, torch or CuPy), in any list / tuple / dict
            nesting (any pytree under JAX), of dtype float16, bfloat16, float32 or float64.
        with_finite: also return ``finite``, a 0-d bool array: true when every amax is finite
            (no leaf holds an inf or a NaN), the loss scaler's gradient check from the same
            reduction.

    Returns:
        ``amaxes`` on the leaves' framework and device (NaN where a leaf holds a NaN, else inf
        where it holds an inf; 0 for an empty leaf), or ``(amaxes, finite)``.

    Raises:
        TypeError: a leaf of another dtype or framework, or not an array.
        ValueError: a tree with no leaves.

    Example:
        >>> import numpy as np, ampscale.fp8 as fp8
        >>> fp8.amax({"w": np.float32([1.5, -3.0]), "b": np.float16([np.inf])})
        array([ 3., inf], dtype=float32)
    """
    if not isinstance(with_finite, bool):
        raise TypeError(f"with_finite must be a bool; got {with_finite!r}")
    leaves, _spec, framework = _flatten(tree)
    if framework == "array_api":
        amaxes = _standard_amax(leaves)
        xp = amaxes.__array_namespace__()
        return (amaxes, xp.all(xp.isfinite(amaxes))) if with_finite else amaxes
    kinds = _kinds(leaves)
    finite: Any
    if framework == "numpy":
        amaxes, finite = _numpy_amax(leaves, kinds)
    elif framework == "torch":
        from ampscale.fp8 import _fused_torch

        amaxes, finite = _fused_torch.amax(leaves, kinds)
    elif framework == "jax":
        from ampscale.fp8 import _fused_jax

        amaxes = _fused_jax.amax(leaves)
        finite = _fused_jax.all_finite(amaxes) if with_finite else None
    else:
        from ampscale.fp8 import _fused_cuda

        done = _fused_cuda.cupy_amax(leaves, kinds)
        if done is None:
            amaxes = _xp_amax(leaves)
            finite = _xp_of(amaxes).isfinite(amaxes).all() if with_finite else None
        else:
            amaxes, finite = done
    return (amaxes, finite) if with_finite else amaxes


def amax_and_cast(tree: Any, scales: Any, fmt: str, *, divide: bool = False) -> tuple[Any, Any, Any]:
    """:func:`amax`, and each leaf's saturated FP8 payload, in one pass.

    Args:
        tree: as for :func:`amax`.
        scales: ``[N]`` float32 array of the leaves' framework (and device), one quantization
            scale per leaf in tree order (the dequantization scale with ``divide``); NumPy also
            takes a sequence of numbers (rounded to float32).
        fmt: ``"e4m3fn"``, ``"e5m2"``, ``"e4m3fnuz"`` or ``"e5m2fnuz"``.
        divide: divide by the scale instead of multiplying (the flax and Keras presets).

    Returns:
        ``(payloads, amaxes, saturated)``: the payloads in the tree's structure, each of its
        leaf's shape and of the framework's float8 dtype, bit for bit
        ``quantize(x, scales[i], fmt, divide, compute_dtype="float32")`` (a division in
        float32 whatever the input's dtype; ``quantize`` left to itself divides a bfloat16 or
        float16 input in that dtype, as flax and Keras do); the ``[N]`` float32 amaxes of the inputs; and
        ``[N]`` counts (int64; int32 under JAX without x64) of the elements whose product
        exceeded fp8_max (inf included, NaN not) and was clipped.

    Raises:
        ValueError: an unknown ``fmt``, or ``scales`` of the wrong shape; nothing is written.
        TypeError: as for :func:`amax`, or ``scales`` of another dtype or framework.

    Example:
        >>> import numpy as np, ampscale.fp8 as fp8
        >>> q, a, clipped = fp8.amax_and_cast([np.float32([1.0, 500.0])], np.float32([1.0]), "e4m3fn")
        >>> q[0].astype(np.float32), a, clipped
        (array([  1., 448.], dtype=float32), array([500.], dtype=float32), array([1]))
    """
    fmt = _check_format(fmt)
    if not isinstance(divide, bool):
        raise TypeError(f"divide must be a bool; got {divide!r}")
    leaves, spec, framework = _flatten(tree)
    if framework == "array_api":
        raise TypeError("amax_and_cast takes NumPy, JAX, torch or CuPy arrays: the array API has no float8 dtype")
    kinds = _kinds(leaves)
    if framework == "numpy":
        payloads, amaxes, clipped = _numpy_amax_cast(leaves, kinds, _numpy_scales(scales, len(leaves)), fmt, divide)
    elif framework == "torch":
        from ampscale.fp8 import _fused_torch

        payloads, amaxes, clipped = _fused_torch.amax_cast(leaves, kinds, scales, fmt, divide)
    elif framework == "jax":
        from ampscale.fp8 import _fused_jax

        payloads, amaxes, clipped = _fused_jax.amax_cast(leaves, scales, fmt, divide)
        import jax

        return jax.tree_util.tree_unflatten(spec, payloads), amaxes, clipped
    else:
        from ampscale.fp8 import _fused_cuda

        done = _fused_cuda.cupy_amax_cast(leaves, kinds, scales, fmt, divide)
        payloads, amaxes, clipped = _xp_amax_cast(leaves, scales, fmt, divide) if done is None else done
    return _tree.unflatten(spec, payloads), amaxes, clipped


# ------------------------------------------------------------------------------ NumPy


def _native() -> Any:
    from ampscale.backends import numpy as numpy_backend

    return numpy_backend._native if numpy_backend.NATIVE else None


def _threads() -> int:
    from ampscale.backends.numpy import num_threads

    return num_threads()


def _numpy_scales(scales: Any, count: int) -> np.ndarray:
    if isinstance(scales, (list, tuple)):
        try:
            scales = np.asarray(scales, dtype=np.float32)
        except (TypeError, ValueError):
            raise TypeError("scales must be an [N] float32 array or a sequence of numbers") from None
    check_scales(scales, count, "numpy")
    return np.ascontiguousarray(scales)


def _readable(leaf: Any) -> np.ndarray:
    """A leaf as an array the native kernels read: contiguous (a copy of a strided view) and of
    native byte order, bfloat16 as its uint16 bits (it exports no buffer format)."""
    array = np.asarray(leaf)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def _numpy_amax(leaves: list[Any], kinds: list[int]) -> tuple[np.ndarray, np.bool_]:
    native = _native()
    out = np.empty(len(leaves), np.float32)
    if native is None:
        for i, leaf in enumerate(leaves):
            out[i] = bits_amax_numpy(np.asarray(leaf))
        return out, np.bool_(np.isfinite(out).all())
    codes: int | bytes = kinds[0] if len(set(kinds)) == 1 else bytes(kinds)
    arrays = leaves if _plain(leaves) else [_readable(leaf) for leaf in leaves]
    try:
        finite = native.fp8_amax(arrays, codes, out, _threads())
    except BufferError:  # a strided view among them: copied, then read in the same pass
        finite = native.fp8_amax([_readable(leaf) for leaf in leaves], codes, out, _threads())
    return out, np.bool_(finite)


def _plain(leaves: list[Any]) -> bool:
    """Whether the kernels can take ``leaves`` as they are (but for strided views, which they
    refuse): arrays of native byte order, no bfloat16 (which exports no buffer format)."""
    if set(map(type, leaves)) != {np.ndarray}:
        return False
    return all(d.isnative and d.name != "bfloat16" for d in set(map(_DTYPE, leaves)))


def _numpy_amax_cast(
    leaves: list[Any], kinds: list[int], scales: np.ndarray, fmt: str, divide: bool
) -> tuple[list[Any], np.ndarray, np.ndarray]:
    arrays = [_readable(leaf) for leaf in leaves]
    dtype = fp8_dtype(fmt, "numpy")
    # the payload has its input's layout (C or Fortran order), so element i is element i
    payloads = [np.empty_like(a, dtype=dtype) for a in arrays]
    amaxes = np.empty(len(leaves), np.float32)
    clipped = np.zeros(len(leaves), np.int64)
    native = _native()
    if native is None:
        for i, a in enumerate(np.asarray(x) for x in leaves):
            payloads[i][...], clipped[i] = reference_cast_numpy(a, scales[i], fmt, divide)
            amaxes[i] = bits_amax_numpy(a)
        return payloads, amaxes, clipped
    codes: int | bytes = kinds[0] if len(set(kinds)) == 1 else bytes(kinds)
    native.fp8_amax_cast(
        arrays,
        codes,
        [p.view(np.uint8) for p in payloads],
        scales,
        FORMAT_CODES[fmt],
        divide,
        nan_byte(fmt, "numpy"),
        amaxes,
        clipped,
        _threads(),
    )
    return (
        [p[()] if isinstance(leaf, np.generic) else p for p, leaf in zip(payloads, leaves, strict=True)],
        amaxes,
        clipped,
    )


# ------------------------------------------------------------------------------ the bit arithmetic

#: itemsize -> (unsigned type of that size, the mask that clears the sign bit)
_BITS = {2: (np.uint16, 0x7FFF), 4: (np.uint32, 0x7FFFFFFF), 8: (np.uint64, (1 << 63) - 1)}


def bits_amax_numpy(array: np.ndarray) -> Any:
    """The amax of one NumPy array by the kernels' arithmetic: the largest magnitude bit pattern,
    converted to float32 (float64 rounded as ``astype`` does), NaN canonical."""
    if array.size == 0:
        return np.float32(0.0)
    unsigned, mask = _BITS[array.dtype.itemsize]
    top = int((np.ascontiguousarray(array).view(unsigned) & unsigned(mask)).max())
    name = array.dtype.name
    if name == "float16":
        value = np.float32(np.uint16(top).view(np.float16))
    elif name == "bfloat16":
        value = np.uint32(top << 16).view(np.float32)
    elif name == "float32":
        value = np.uint32(top).view(np.float32)
    else:
        with np.errstate(over="ignore"):  # past float32's range: inf, as astype gives
            value = np.float32(np.uint64(top).view(np.float64))
    return np.float32(np.nan) if np.isnan(value) else value  # the canonical quiet NaN


def reference_cast_numpy(array: np.ndarray, scale: Any, fmt: str, divide: bool) -> tuple[np.ndarray, int]:
    """The reference cast of one array and its clipped count (the pure-NumPy path)."""
    from ampscale.fp8._cast import quantize

    wide = array.astype(np.float32)
    with np.errstate(all="ignore"):
        product = wide / np.float32(scale) if divide else wide * np.float32(scale)
        clipped = int(np.count_nonzero(np.abs(product) > np.float32(FORMATS[fmt])))
    return quantize(array, np.float32(scale), fmt, divide=divide, compute_dtype=DIVIDE_IN), clipped


# ------------------------------------------------------------------------------ the array API


def _standard_amax(leaves: list[Any]) -> Any:
    """The ``[N]`` float32 amaxes of array-API ``leaves``, in the standard's functions: a NaN
    leaf gives the canonical NaN, else the largest magnitude (inf included), 0 for an empty leaf."""
    xp = leaves[0].__array_namespace__()
    parts = []
    for index, x in enumerate(leaves):
        if not xp.isdtype(x.dtype, "real floating"):
            name = str(x.dtype).rsplit(".", 1)[-1]  # array_api_strict.int32 -> int32
            raise TypeError(f"leaf [{index}] has dtype {name}; FP8 amaxes are taken of {ACCEPTED} arrays")
        if x.size == 0:
            parts.append(xp.zeros((), dtype=xp.float32))
            continue
        top = xp.astype(xp.max(xp.abs(x)), xp.float32)
        parts.append(xp.where(xp.any(xp.isnan(x)), xp.asarray(np.nan, dtype=xp.float32), top))
    return xp.stack(parts)


# ------------------------------------------------------------------------------ CuPy


def _xp_of(array: Any) -> Any:
    return __import__("cupy") if framework_of(array) == "cupy" else np


def _xp_amax_one(x: Any, xp: Any) -> Any:
    """:func:`bits_amax_numpy` in ``xp``'s operations, a 0-d float32 array on the device."""
    if x.size == 0:
        return xp.zeros((), xp.float32)
    unsigned, mask = _BITS[x.dtype.itemsize]
    top = (xp.ascontiguousarray(x).reshape(-1).view(unsigned) & unsigned(mask)).max()
    if x.dtype.name == "bfloat16":  # the top half of a float32
        value = (top.astype(xp.uint32) << 16).view(xp.float32)
    elif x.dtype.itemsize == 2:
        value = top.view(xp.float16).astype(xp.float32)
    elif x.dtype.itemsize == 4:
        value = top.view(xp.float32)
    else:
        value = top.view(xp.float64).astype(xp.float32)
    return xp.where(xp.isnan(value), xp.float32(np.nan), value)  # the canonical quiet NaN


def _xp_amax(leaves: list[Any]) -> Any:
    xp = _xp_of(leaves[0])
    return xp.stack([_xp_amax_one(x, xp) for x in leaves])


def xp_encode(product: Any, fmt: str, nan: int, xp: Any) -> tuple[Any, Any]:
    """The kernels' FP8 encoder in ``xp``'s array operations (for CuPy, which has no float8
    dtype): float32 ``product`` -> ``(uint8 bytes, clipped mask)``. Integer arithmetic only."""
    mbits, bias = {"e4m3fn": (3, 7), "e5m2": (2, 15), "e4m3fnuz": (3, 8), "e5m2fnuz": (2, 16)}[fmt]
    max_bits = int(np.float32(FORMATS[fmt]).view(np.uint32))
    fnuz = fmt.endswith("fnuz")
    u = product.astype(xp.float32).view(xp.uint32)
    sign = (u >> 24) & xp.uint32(0x80)
    a = u & xp.uint32(0x7FFFFFFF)
    is_nan = a > xp.uint32(0x7F800000)
    clipped = (a > xp.uint32(max_bits)) & ~is_nan
    a = xp.where(clipped, xp.uint32(max_bits), a)
    rounded = a + xp.uint32((1 << (22 - mbits)) - 1) + ((a >> (23 - mbits)) & xp.uint32(1))
    normal = (rounded >> (23 - mbits)) - xp.uint32((127 - bias) << mbits)
    exponent = a >> 23
    mantissa = (a & xp.uint32(0x7FFFFF)) | xp.uint32(0x800000)
    shift = xp.clip(xp.int32(151 - bias - mbits) - exponent.astype(xp.int32), 1, 31).astype(xp.uint32)
    q = mantissa >> shift
    rest = mantissa & ((xp.uint32(1) << shift) - xp.uint32(1))
    half = xp.uint32(1) << (shift - xp.uint32(1))
    q = q + ((rest > half) | ((rest == half) & ((q & xp.uint32(1)) == 1))).astype(xp.uint32)
    magnitude = xp.where(exponent >= xp.uint32(128 - bias), normal, q)
    code = sign | magnitude
    if fnuz:
        code = xp.where(magnitude == 0, xp.uint32(0), code)
    code = xp.where(is_nan, xp.uint32(nan) if fnuz else sign | xp.uint32(nan), code)
    return code.astype(xp.uint8), clipped


def _xp_amax_cast(leaves: list[Any], scales: Any, fmt: str, divide: bool) -> tuple[list[Any], Any, Any]:
    xp = _xp_of(leaves[0])
    check_scales(scales, len(leaves), framework_of(leaves[0]))
    payloads, counts = [], []
    for k, x in enumerate(leaves):
        wide = x.astype(xp.float32)
        with np.errstate(all="ignore"):
            product = wide / scales[k] if divide else wide * scales[k]
        code, clipped = xp_encode(product, fmt, nan_byte(fmt, "cupy"), xp)
        payloads.append(code)
        counts.append(clipped.sum())
    return payloads, _xp_amax(leaves), xp.stack(counts).astype(xp.int64)
