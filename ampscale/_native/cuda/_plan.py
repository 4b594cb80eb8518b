"""The host side of the CUDA kernels that needs no GPU: the module source, dtype codes, the chunk table.

Kept free of any framework import so that it is tested on any machine. The table layout
matches ``struct AmpscaleChunk`` in ``kernels.cu``; the state record is
:func:`ampscale._codegen.state_dtype`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ampscale._codegen import C_PRELUDE, c_transition

if TYPE_CHECKING:
    from ampscale._config import ScalerConfig

__all__ = [
    "BLOCK_THREADS",
    "CHUNK",
    "CHUNK_DTYPE",
    "COMPILE_OPTIONS",
    "KINDS",
    "MULTIPLY",
    "TAIL",
    "chunk_table",
    "kernel_source",
    "loss_meta",
    "module_source",
]

#: dtype name -> the kernel's AMPSCALE_KIND_* code
KINDS = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
#: elements per chunk (one CUDA block each): 64 Ki elements, a few hundred KB per block
CHUNK = 1 << 16
#: threads per block of ``ampscale_step``
BLOCK_THREADS = 512
#: the layout of ``struct AmpscaleChunk``: 4 x 8 bytes
CHUNK_DTYPE = np.dtype([("data", "<u8"), ("start", "<i8"), ("length", "<i8"), ("kind", "<i8")])
#: ``options`` bits of ``ampscale_step``
MULTIPLY, TAIL = 1, 2
#: compiler options (NVRTC and nvcc spell them alike): IEEE division, no contraction to FMA, no
#: flush-to-zero (scales can be subnormal; flushing changes ``scale == floor``), never fast math;
#: C++17 for the hex float literals
COMPILE_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--std=c++17")

_SOURCE = pathlib.Path(__file__).with_name("kernels.cu")


def kernel_source() -> str:
    """The configuration-independent CUDA source (``ampscale/_native/cuda/kernels.cu``)."""
    return _SOURCE.read_text()


def module_source(config: ScalerConfig) -> str:
    """The whole CUDA module for ``config``: the emitted transition, then the kernels."""
    return "\n".join(
        [
            f"// ampscale module for preset {config.preset!r}, mode {config.mode!r}",
            f"#define AMPSCALE_CHUNK {CHUNK}LL",
            C_PRELUDE,
            c_transition(config),
            kernel_source(),
        ]
    )


def loss_meta(size: int, kind: int) -> int:
    """The ``loss_meta`` argument of ``ampscale_step``: element count << 8 | dtype code."""
    return (size << 8) | kind


def chunk_table(addresses: Sequence[int], sizes: Sequence[int], kinds: Sequence[int], chunk: int = CHUNK) -> np.ndarray:
    """One row per chunk of at most ``chunk`` elements, over every array, in order.

    Args:
        addresses: device address of each array's first element.
        sizes: element count of each array (empty arrays get no chunk).
        kinds: the ``KINDS`` code of each array.
        chunk: the chunk length.

    Raises:
        ValueError: the three sequences differ in length, or a size or kind is invalid.
    """
    if not (len(addresses) == len(sizes) == len(kinds)):
        given = f"{len(addresses)}, {len(sizes)}, {len(kinds)}"
        raise ValueError(f"addresses, sizes and kinds must have one entry per array; got {given}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    sizes_a = np.asarray(sizes, dtype=np.int64)
    kinds_a = np.asarray(kinds, dtype=np.int64)
    if sizes_a.size and sizes_a.min() < 0:
        raise ValueError("array sizes must be >= 0")
    if kinds_a.size and not np.isin(kinds_a, list(KINDS.values())).all():
        raise ValueError(f"kinds must be codes of {KINDS}; got {sorted(set(kinds_a.tolist()))}")
    counts = (sizes_a + chunk - 1) // chunk
    total = int(counts.sum())
    table = np.empty(total, dtype=CHUNK_DTYPE)
    owner = np.repeat(np.arange(len(sizes_a)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(total) - first) * chunk
    table["data"] = np.asarray(addresses, dtype=np.uint64)[owner] if total else []
    table["start"] = start
    table["length"] = np.minimum(chunk, sizes_a[owner] - start) if total else []
    table["kind"] = kinds_a[owner] if total else []
    return table
