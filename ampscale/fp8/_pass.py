"""The fused FP8 pass's vocabulary, shared by its framework glue: format and dtype codes, NaN
bytes, and the check of the per-leaf scales (:mod:`ampscale.fp8._fused` and its ``_fused_*``
modules; the codes are those of ``ampscale/_native/cpu/fp8_kernels.h`` and ``fp8_kernels.cu``).
"""

from __future__ import annotations

from typing import Any

from ampscale.fp8._ops import framework_of

__all__ = ["ACCEPTED", "DIVIDE_IN", "FORMAT_CODES", "KINDS", "check_scales", "nan_byte"]

#: format -> the native kernels' FP8_* code
FORMAT_CODES = {"e4m3fn": 0, "e5m2": 1, "e4m3fnuz": 2, "e5m2fnuz": 3}
#: float dtype name -> the native kernels' KIND_* code
KINDS = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
ACCEPTED = "float16, bfloat16, float32 or float64"
#: the dtype a ``divide`` cast divides in: float32 for every input dtype (one rounding, then the
#: FP8 encode), as the kernels do. ``quantize``'s default divides a bfloat16 or float16 input in
#: its own dtype, as flax and Keras do (two roundings); the pass's references name float32.
DIVIDE_IN = "float32"


def nan_byte(fmt: str, framework: str) -> int:
    """The byte a NaN becomes in ``fmt`` (before its sign), as ``framework``'s own cast writes it.

    ml_dtypes and XLA write E5M2's NaN as 0x7e, torch as 0x7f; E4M3FN's is 0x7f everywhere, and
    the fnuz formats have the one NaN 0x80.
    """
    if fmt == "e5m2":
        return 0x7F if framework == "torch" else 0x7E
    return 0x80 if fmt.endswith("fnuz") else 0x7F


def check_scales(scales: Any, count: int, framework: str) -> None:
    """``scales`` must be an ``[count]`` float32 array of ``framework``."""
    try:
        given = framework_of(scales)
    except TypeError:
        given = type(scales).__name__
    shape = tuple(getattr(scales, "shape", ()))
    dtype = str(getattr(scales, "dtype", "")).rsplit(".", 1)[-1]
    if given != framework:
        raise TypeError(f"scales must be a {framework} array like the tree's leaves; got {given}")
    if shape != (count,):
        raise ValueError(f"scales must have shape ({count},) (one scale per leaf); got shape {shape}")
    if dtype != "float32":
        raise TypeError(f"scales must be float32 (the FP8 state's dtype); got {dtype}")
