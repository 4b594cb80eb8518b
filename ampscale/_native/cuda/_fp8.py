"""The host side of the CUDA FP8 pass that needs no GPU: the module source, the options, the table.

The kernels are ``fp8_kernels.cu``, appended to ``kernels.cu`` (whose conversions they use) after
the default loss-scaler configuration's transition (which ``kernels.cu`` needs and the FP8 pass
does not use). :func:`module_source` with an FP8 configuration also emits that configuration's
FP8 transition and its per-slot update on the state's arrays, and compiles
``ampscale_fp8_pass_step``, which runs that update of every slot in the pass's last block.
The table layout matches ``struct AmpscaleFp8Chunk``. Framework-free: tested on any machine.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ampscale._native.cuda import _plan

if TYPE_CHECKING:
    from ampscale.fp8._config import Fp8Config

__all__ = [
    "CAST",
    "CHUNK",
    "CHUNK_DTYPE",
    "DIVIDE",
    "DRIVER_FUNCTIONS",
    "FUNCTIONS",
    "JAX_LEAVES",
    "THREADS",
    "bind",
    "declare",
    "set_driver",
    "chunk_table",
    "kernel_source",
    "module_source",
    "options",
    "payload_offsets",
]

_SOURCE = pathlib.Path(__file__).with_name("fp8_kernels.cu")
#: the layout of ``struct AmpscaleFp8Chunk``: 5 x 8 bytes
CHUNK_DTYPE = np.dtype([("data", "<u8"), ("out", "<u8"), ("start", "<i8"), ("length", "<i8"), ("meta", "<i8")])
#: the kernels of every module; ``ampscale_fp8_pass_step`` too in a module made for an FP8 configuration
FUNCTIONS = ("ampscale_fp8_pass", "ampscale_fp8_jax_pass")
#: the driver entry points the JAX CUDA handler calls, in ``ampscale_ffi_fp8_cuda_set_driver``'s order
DRIVER_FUNCTIONS = (
    "cuLaunchKernel",
    "cuMemsetD32Async",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuGetErrorString",
)
_lock = threading.Lock()
_bound: dict[int, str] = {}  # ordinal -> what was loaded for the JAX handler


def kernel_source() -> str:
    """``fp8_kernels.cu``."""
    return _SOURCE.read_text()


def _defined(name: str) -> int:
    match = re.search(rf"^#define {name} (\d+)", kernel_source(), re.MULTILINE)
    assert match is not None, name
    return int(match.group(1))


#: threads per block, elements per row of the table, and the options' bits
THREADS, CHUNK = _defined("AMPSCALE_FP8_THREADS"), _defined("AMPSCALE_FP8_CHUNK")
#: tensors per launch of the JAX handler's kernel
JAX_LEAVES = _defined("AMPSCALE_FP8_JAX_LEAVES")
CAST, DIVIDE = _defined("AMPSCALE_FP8_CAST"), _defined("AMPSCALE_FP8_DIVIDE")
_FORMAT_SHIFT, _NAN_SHIFT = _defined("AMPSCALE_FP8_FORMAT_SHIFT"), _defined("AMPSCALE_FP8_NAN_SHIFT")


@functools.lru_cache(maxsize=8)
def module_source(config: Fp8Config | None = None) -> str:
    """The whole NVRTC source: ``kernels.cu`` (with the default loss-scaler transition it
    needs), then, for an FP8 ``config``, its emitted transition and per-slot state update
    (:func:`ampscale.fp8._codegen.c_state_update`), then ``fp8_kernels.cu``."""
    from ampscale._config import make_config

    parts = [_plan.module_source(make_config())]
    if config is not None:
        from ampscale.fp8._codegen import FP8_C_PRELUDE, c_state_update, c_transition

        parts += [FP8_C_PRELUDE, c_transition(config), c_state_update(config), "#define AMPSCALE_FP8_TRANSITION 1"]
    return "\n".join([*parts, kernel_source()])


def options(fmt_code: int | None, divide: bool = False, nan_byte: int = 0) -> int:
    """The ``options`` argument: amax only (``fmt_code`` ``None``), or a cast to that format."""
    if fmt_code is None:
        return 0
    return CAST | (DIVIDE if divide else 0) | (fmt_code << _FORMAT_SHIFT) | (nan_byte << _NAN_SHIFT)


def payload_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's payload offset in one buffer (16-byte aligned, so the kernel's word stores
    stay aligned), and the buffer's size in bytes."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (int(size) + 15) // 16 * 16
    return offsets, total


def chunk_table(
    addresses: Sequence[int], outs: Sequence[int], sizes: Sequence[int], kinds: Sequence[int], chunk: int = CHUNK
) -> np.ndarray:
    """One row per chunk of at most ``chunk`` elements of every tensor, in order; tensor ``i``'s
    rows carry slot ``i`` and ``outs[i]``, its payload's byte offset in the launch's payload
    buffer (empty tensors get no row, their slot still gets its amax, 0).

    Raises:
        ValueError: the sequences differ in length, or a size or kind is invalid.
    """
    if not (len(addresses) == len(outs) == len(sizes) == len(kinds)):
        given = f"{len(addresses)}, {len(outs)}, {len(sizes)}, {len(kinds)}"
        raise ValueError(f"addresses, outs, sizes and kinds must have one entry per tensor; got {given}")
    rows = _plan.chunk_table(addresses, sizes, kinds, chunk)
    counts = (np.asarray(sizes, dtype=np.int64) + chunk - 1) // chunk
    slot = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    table = np.empty(rows.size, dtype=CHUNK_DTYPE)
    table["data"] = rows["data"]
    table["out"] = np.asarray(outs, dtype=np.uint64)[slot] if rows.size else []
    table["start"] = rows["start"]
    table["length"] = rows["length"]
    table["meta"] = (slot << 8) | rows["kind"]
    return table


# ------------------------------------------------------------------------------ the JAX CUDA handler


def declare(library: ctypes.CDLL) -> None:
    """The C signatures of the handler library's FP8 CUDA entry points (``jax_ffi_fp8_cuda.cc``)."""
    p = ctypes.c_void_p
    library.ampscale_ffi_fp8_cuda_set_driver.argtypes = [p] * 6
    library.ampscale_ffi_fp8_cuda_set_driver.restype = ctypes.c_int
    library.ampscale_ffi_fp8_cuda_bind.argtypes = [ctypes.c_int, p, p]
    library.ampscale_ffi_fp8_cuda_bind.restype = ctypes.c_int
    library.ampscale_ffi_fp8_cuda_run.argtypes = [
        ctypes.c_int,
        p,
        ctypes.c_longlong,
        p,
        p,
        p,
        p,
        p,
        ctypes.c_int,
        ctypes.c_int,
        p,
        p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    library.ampscale_ffi_fp8_cuda_run.restype = ctypes.c_int


def set_driver(library: ctypes.CDLL, cuda: Any = None) -> None:
    """Give the FP8 handlers the driver entry points they call (default: from ``libcuda.so.1``).

    Raises:
        OSError: the driver cannot be loaded or lacks an entry point.
    """
    if cuda is None:
        cuda = ctypes.CDLL("libcuda.so.1")
    pointers = []
    for name in DRIVER_FUNCTIONS:
        function = getattr(cuda, name, None)
        if function is None:
            raise OSError(f"the CUDA driver libcuda.so.1 has no {name}")
        pointers.append(ctypes.cast(function, ctypes.c_void_p).value)
    if library.ampscale_ffi_fp8_cuda_set_driver(*pointers) != 0:
        raise OSError("the CUDA driver's entry points could not be given to the JAX FP8 handlers")


def bind(library: ctypes.CDLL, ordinal: int) -> str:
    """Compile (or take from the disk cache), load and record ``ampscale_fp8_jax_pass`` for
    device ``ordinal``, once per device and process; what was loaded (``"cubin for sm_90"``).

    Raises:
        OSError, RuntimeError: the driver launcher, NVRTC or the driver failed.
    """
    from ampscale._native.cuda import driver

    with _lock:
        if ordinal in _bound:
            return _bound[ordinal]
        launcher = driver.launcher()
        module = driver.DeviceModule(module_source(), ordinal)
        function = launcher.get_function(module.module, module.context, "ampscale_fp8_jax_pass")
        if library.ampscale_ffi_fp8_cuda_bind(ordinal, module.context, function) != 0:
            raise RuntimeError(f"the JAX FP8 handler refused the kernel for CUDA device {ordinal}")
        major, minor = launcher.compute_capability(ordinal)
        _bound[ordinal] = f"{module.kind} for sm_{major}{minor}"
        return _bound[ordinal]
