"""The JAX CUDA handler's kernels, made ready for it in this process: no JAX import here.

The XLA FFI handler (``ampscale/_native/cuda/jax_ffi_cuda.cc``, in the handler library with the CPU
one) launches ``ampscale_jax_begin`` and ``ampscale_jax_unscale`` (``jax_kernels.cu``, after the
shared ``kernels.cu``) on XLA's stream. It finds them in a per-process table that this module
fills before anything is lowered to the custom call:

* :func:`set_driver`: the driver entry points the handler calls (``cuLaunchKernel``,
  ``cuMemcpyDtoDAsync``, the context calls, ``cuGetErrorString``), looked up in ``libcuda.so.1``;
* :func:`bind`: for one device, the module compiled by NVRTC for its architecture (cached on
  disk by :mod:`ampscale._native.cuda.nvrtc`), loaded into its primary context (the one XLA uses) by
  :mod:`ampscale._native.cuda.driver`, and the two kernels recorded under the device's CUDA ordinal.

Registering a table from Python rather than preparing the kernels in an XLA instantiate stage
keeps NVRTC, its disk cache and the driver loading in one place for every GPU backend, and lets
the lowering choose the pure-XLA path, with the reason, when any of it fails.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re
import threading
from typing import Any

from ampscale._native.cuda import _plan, driver

__all__ = [
    "CHUNK",
    "DRIVER_FUNCTIONS",
    "FUNCTIONS",
    "LEAVES",
    "THREADS",
    "bind",
    "declare",
    "kernel_source",
    "module_source",
    "set_driver",
]

#: the kernels the handler launches
FUNCTIONS = ("ampscale_jax_begin", "ampscale_jax_unscale")
#: the driver entry points the handler calls, in ``ampscale_ffi_cuda_set_driver``'s order
DRIVER_FUNCTIONS = (
    "cuLaunchKernel",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuGetErrorString",
)
_SOURCE = pathlib.Path(__file__).with_name("jax_kernels.cu")
_lock = threading.Lock()
_bound: dict[int, str] = {}  # ordinal -> what was loaded ("cubin for sm_90", ...)


def _defined(name: str) -> int:
    match = re.search(rf"^#define {name} (\d+)", kernel_source(), re.MULTILINE)
    assert match is not None, name
    return int(match.group(1))


def kernel_source() -> str:
    """``jax_kernels.cu``: the launch layout and the JAX kernels."""
    return _SOURCE.read_text()


@functools.lru_cache(maxsize=1)
def module_source() -> str:
    """The whole NVRTC source: ``kernels.cu`` (with the default configuration's transition, which
    its update kernels need; the JAX kernels do not use it), then ``jax_kernels.cu``."""
    from ampscale._config import make_config

    return _plan.module_source(make_config()) + "\n" + kernel_source()


#: buffers per launch (``AMPSCALE_JAX_LEAVES``), elements per block and threads per block
LEAVES, CHUNK, THREADS = (_defined(f"AMPSCALE_JAX_{name}") for name in ("LEAVES", "CHUNK", "THREADS"))


def declare(library: ctypes.CDLL) -> None:
    """The C signatures of the handler library's CUDA entry points."""
    p = ctypes.c_void_p
    library.ampscale_ffi_cuda_set_driver.argtypes = [p] * 6
    library.ampscale_ffi_cuda_set_driver.restype = ctypes.c_int
    library.ampscale_ffi_cuda_bind.argtypes = [ctypes.c_int, p, p, p]
    library.ampscale_ffi_cuda_bind.restype = ctypes.c_int
    library.ampscale_ffi_cuda_run.argtypes = [
        ctypes.c_int,
        p,
        p,
        p,
        ctypes.c_longlong,
        p,
        p,
        p,
        p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    library.ampscale_ffi_cuda_run.restype = ctypes.c_int


def set_driver(library: ctypes.CDLL, cuda: Any = None) -> None:
    """Give the handler the driver entry points it calls.

    Args:
        library: the handler library (:func:`declare` done).
        cuda: where to look them up (default: ``libcuda.so.1``, loaded by the driver launcher).

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
    if library.ampscale_ffi_cuda_set_driver(*pointers) != 0:
        raise OSError("the CUDA driver's entry points could not be given to the JAX handler")


def bind(library: ctypes.CDLL, ordinal: int) -> str:
    """Compile (or take from the disk cache), load and record the kernels for device ``ordinal``.

    Once per device and process. Returns what was loaded, e.g. ``"cubin for sm_90"``.

    Raises:
        OSError, RuntimeError: the driver launcher, NVRTC or the driver failed (the message says
            which); the handler then has no kernels for this device.
    """
    with _lock:
        if ordinal in _bound:
            return _bound[ordinal]
        launcher = driver.launcher()
        module = driver.DeviceModule(module_source(), ordinal)
        begin, unscale = (launcher.get_function(module.module, module.context, name) for name in FUNCTIONS)
        if library.ampscale_ffi_cuda_bind(ordinal, module.context, begin, unscale) != 0:
            raise RuntimeError(f"the JAX handler refused the kernels for CUDA device {ordinal}")
        major, minor = launcher.compute_capability(ordinal)
        _bound[ordinal] = f"{module.kind} for sm_{major}{minor}"
        return _bound[ordinal]
