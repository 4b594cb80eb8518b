"""The FP8 update as ONE CUDA launch on CuPy and torch: the emitted C transition in a kernel.

The eager path runs the transition as array operations, a few dozen small kernels per update
on a GPU. Here the transition of one configuration, emitted as C by
:func:`ampscale.fp8._codegen.c_transition`, is compiled into ``ampscale_fp8_update``: one
thread per slot reads the slot's fields (its ring's ``head`` included) and history row, runs
the slot transition, writes the next fields into new arrays (the scaler is functional; the
ring's row is copied and one amax written at its head), and thread 0 counts the step. With
``donate`` the next fields are the old arrays themselves: one store per written amax, as the
transition may write its output over its input. One launch per update, no host read: the
step's flag is read on the device (a bool array, or a Python bool passed by value).

Built like the loss scaler's kernels: by ampscale's own NVRTC call
(:func:`ampscale._native.cuda.nvrtc.compiled`, cached on disk) with IEEE options
(``--fmad=false --ftz=false --prec-div=true``): no FMA contraction and no flush-to-zero, so
the device computes the bits the Python transition computes (subnormal amaxes and scales
included). CuPy only loads the binary (``cupy.cuda.function.Module().load``): its own
compiler appends ``-ftz=true``. torch launches it through ampscale's driver launcher
(:mod:`ampscale._native.cuda.driver`), on torch's current stream.

The same source builds on the host (``-DAMPSCALE_HOST_TEST``): ``ampscale_fp8_update_host``
runs every thread of the launch in turn, so the tests run the kernel's code on the CPU.
Where the driver or NVRTC is missing the update stays on the eager path, with one
:class:`~ampscale.PerformanceWarning` per process.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ampscale._codegen import C_PRELUDE
from ampscale.fp8._codegen import FLAG_BOOL, FLAG_FALSE, FLAG_TRUE, FP8_C_PRELUDE, c_state_update, c_transition
from ampscale.fp8._transition import Fp8State

if TYPE_CHECKING:
    from ampscale.fp8._config import Fp8Config

__all__ = [
    "BLOCK",
    "FLAG_BOOL",
    "FLAG_FALSE",
    "FLAG_TRUE",
    "KERNEL",
    "launch_arguments",
    "module_source",
]

#: the kernel's name, and its threads per block (one thread per slot)
KERNEL = "ampscale_fp8_update"
BLOCK = 128
_PREFIX = "ampscale_fp8_"


@functools.lru_cache(maxsize=64)
def module_source(config: Fp8Config) -> str:
    """The CUDA module of ``config``: the preludes, the emitted transition, the per-slot update
    on the state's arrays (:func:`~ampscale.fp8._codegen.c_state_update`), and the kernel.

    The kernel's parameters, all 8 bytes (pointers and ``long long``, so a launcher needs no
    signature): every field of :class:`~ampscale.fp8.Fp8State` in, every field out, ``amax``,
    ``fp8_max``, ``step_ok`` and its kind, ``updated`` (bytes, may be null) and ``n``.
    """
    params = (
        "AMPSCALE_FP8_STATE_PARAMS, const float* amax, const float* fp8_max, const void* step_ok, "
        "long long step_ok_kind, unsigned char* updated, long long n"
    )
    names = "AMPSCALE_FP8_STATE_ARGS, amax, fp8_max, step_ok, step_ok_kind, updated, n"
    body = rf"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
extern "C" __global__ void {KERNEL}({params}) {{
    {_PREFIX}thread((long long)blockIdx.x * blockDim.x + threadIdx.x, {names});
}}
#endif

#ifdef AMPSCALE_HOST_TEST
/* host harness (tests only): every thread of a launch of `grid` blocks, in turn */
extern "C" void {KERNEL}_host(long long grid, {params}) {{
    for (long long k = 0; k < grid * {BLOCK}LL; k++) {_PREFIX}thread(k, {names});
}}
#endif
"""
    return "\n".join(
        [
            f"// ampscale FP8 update for preset {config.preset!r}, {config.size} slots, history {config.history_len}",
            C_PRELUDE,
            FP8_C_PRELUDE,
            c_transition(config, prefix=_PREFIX),
            c_state_update(config, prefix=_PREFIX),
            body,
        ]
    )


def grid_for(n: int) -> int:
    """Blocks of :data:`BLOCK` threads for ``n`` slots (one at least: thread 0 counts the step)."""
    return max(1, -(-n // BLOCK))


def with_head(state: Fp8State, zeros: Any) -> Fp8State:
    """``state`` with its ring's head: a state built in canonical order (``head=None``) starts
    at position 0 of every row; ``zeros(n)`` makes the int32 zeros on the state's device."""
    return state if state.head is not None else state._replace(head=zeros(state.scale.shape[0]))


def launch_arguments(
    state: Fp8State, nxt: Fp8State, amax: int, fp8_max: int, flag: tuple[int, int], updated: int, n: int
) -> list[int]:
    """The kernel's arguments as integers: the ``*_ptr`` of every field in and out, then the rest.

    ``state`` and ``nxt`` hold device addresses (ints) in place of arrays.
    """
    return [*state, *nxt, amax, fp8_max, flag[0], flag[1], updated, n]


# ------------------------------------------------------------------------------ the modules

_lock = threading.Lock()
_cupy_functions: dict[tuple[str, int], Any] = {}
_torch_modules: dict[tuple[str, int], Any] = {}


def _warn(framework: str, reason: str) -> None:
    from ampscale._native.cuda.driver import warn_fallback

    warn_fallback(f"{framework} (the FP8 update)", reason, stacklevel=6)


def _cupy_function(config: Fp8Config, device_id: int) -> Any:
    """``ampscale_fp8_update`` of ``config`` loaded into CuPy on a device (``None``, with one
    warning, where NVRTC or the driver refuses it)."""
    source = module_source(config)
    key = (source, device_id)
    with _lock:
        if key not in _cupy_functions:
            cupy = sys.modules["cupy"]
            from ampscale._native.cuda import _plan, nvrtc

            try:
                with cupy.cuda.Device(device_id) as device:
                    arch = int(device.compute_capability)
                    image, kind = nvrtc.compiled(source, arch, _plan.COMPILE_OPTIONS, "ampscale_fp8.cu")
                    if kind == "ptx" and not image.endswith(b"\0"):
                        image += b"\0"  # the driver reads PTX as a C string
                    module = cupy.cuda.function.Module()
                    module.load(image)
                    _cupy_functions[key] = (module, module.get_function(KERNEL))
            except Exception as exc:  # OSError (no NVRTC), NvrtcError, CuPy's CUDADriverError
                _warn("cupy", f"the FP8 kernel could not be built or loaded: {exc}")
                _cupy_functions[key] = None
        entry = _cupy_functions[key]
    return None if entry is None else entry[1]


@functools.lru_cache(maxsize=64)
def _cupy_fp8_max(config: Fp8Config, device_id: int) -> Any:
    cupy = sys.modules["cupy"]
    with cupy.cuda.Device(device_id):
        return cupy.asarray(np.asarray(config.slot_max, np.float32))  # one copy, at the first update


def update_cupy(
    config: Fp8Config, state: Fp8State, amax: Any, step_ok: Any, donate: bool = False
) -> tuple[Fp8State, Any] | None:
    """The update of a CuPy state in one launch; ``None`` where the kernel is not available.
    ``donate``: write the next state over ``state``'s arrays."""
    cupy = sys.modules["cupy"]
    device_id = state.scale.data.device_id
    function = _cupy_function(config, device_id)
    if function is None:
        return None
    if cupy.cuda.get_current_stream().is_capturing():
        raise RuntimeError(
            "ampscale: the FP8 update cannot run under CUDA graph capture: each update writes new "
            "arrays, so a replay would repeat the captured scales; run it outside the capture"
        )
    with cupy.cuda.Device(device_id):
        if amax.data.device_id != device_id:
            amax = cupy.asarray(amax)  # a copy between devices, queued
        if not amax.flags.c_contiguous:
            amax = cupy.ascontiguousarray(amax)
        state = with_head(state, lambda n: cupy.zeros(n, dtype=cupy.int32))
        nxt = state if donate else Fp8State(*(cupy.empty_like(field) for field in state))
        updated = cupy.empty(config.size, dtype=cupy.bool_)
        flag_pointer, flag_kind, keep = _cupy_flag(cupy, step_ok, device_id)
        args = [
            *state,
            *nxt,
            amax,
            _cupy_fp8_max(config, device_id),
            np.uint64(flag_pointer),
            np.int64(flag_kind),
            updated,
            np.int64(config.size),
        ]
        function((grid_for(config.size),), (BLOCK,), tuple(args))
        # CuPy's pool may hand a freed block to its own stream at once: the inputs outlive the
        # launch on this stream (their arrays may come from another stream)
        from ampscale.backends.cupy import _hold_for_stream

        _hold_for_stream((*state, amax, keep))
    return nxt, updated


def _cupy_flag(cupy: Any, flag: Any, device_id: int) -> tuple[int, int, Any]:
    if isinstance(flag, (bool, np.bool_)):
        return 0, FLAG_TRUE if flag else FLAG_FALSE, None
    flag = cupy.asarray(flag)
    if flag.data.device_id != device_id:
        flag = cupy.asarray(flag)
    if flag.dtype != cupy.bool_:
        flag = flag.astype(cupy.bool_)
    return flag.data.ptr, FLAG_BOOL, flag


class TorchModule:
    """``ampscale_fp8_update`` of one configuration, loaded on one device through the driver."""

    __slots__ = ("context", "function", "kind", "launch", "module")

    def __init__(self, source: str, ordinal: int) -> None:
        from ampscale._native.cuda import _plan, driver, nvrtc

        launcher = driver.launcher()
        major, minor = launcher.compute_capability(ordinal)
        image, self.kind = nvrtc.compiled(source, 10 * major + minor, _plan.COMPILE_OPTIONS, "ampscale_fp8.cu")
        if self.kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"
        self.module, self.context = launcher.load_module(ordinal, image)
        self.function = launcher.get_function(self.module, self.context, KERNEL)
        self.launch = launcher.launch


def torch_module(config: Fp8Config, device: Any) -> Any:
    """The loaded kernel of ``config`` on a CUDA ``device`` (``None``, with one warning, where
    the driver path cannot run: ROCm, no driver, no NVRTC)."""
    import torch

    from ampscale._native.cuda import driver

    source = module_source(config)
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    key = (source, ordinal)
    with _lock:
        if key in _torch_modules:
            return _torch_modules[key]
    reason = "this torch runs on ROCm" if getattr(torch.version, "hip", None) else driver.unavailable_reason()
    module = None
    if reason is None:
        try:
            module = TorchModule(source, ordinal)
        except (OSError, RuntimeError) as exc:  # NvrtcError is a RuntimeError
            reason = str(exc)
    if module is None:
        _warn("torch", str(reason))
    with _lock:
        _torch_modules[key] = module
    return module


def is_torch_cuda(tensor: Any) -> bool:
    """Whether a torch state lives on a CUDA device (the stand-in tests route CPU tensors here)."""
    return bool(tensor.is_cuda)


@functools.lru_cache(maxsize=64)
def _torch_fp8_max(config: Fp8Config, device: Any) -> Any:
    import torch

    return torch.tensor(config.slot_max, dtype=torch.float32).to(device)  # once, at the first update


def update_torch(
    config: Fp8Config, state: Fp8State, amax: Any, step_ok: Any, donate: bool = False
) -> tuple[Fp8State, Any] | None:
    """The update of a torch CUDA state in one launch on torch's current stream; ``None``
    where the kernel is not available. ``donate``: write the next state over ``state``'s
    tensors."""
    import torch

    from ampscale.backends import torch as torch_backend

    device = state.scale.device
    module = torch_module(config, device)
    if module is None:
        return None
    torch_backend._refuse_capture("the FP8 update")
    amax = amax.to(device=device, dtype=torch.float32).contiguous()
    state = with_head(state, lambda n: torch.zeros(n, dtype=torch.int32, device=device))
    nxt = state if donate else Fp8State(*(torch.empty_like(field) for field in state))
    updated = torch.empty(config.size, dtype=torch.bool, device=device)
    keep = None
    if isinstance(step_ok, (bool, np.bool_)):
        flag = (0, FLAG_TRUE if step_ok else FLAG_FALSE)
    else:
        keep = torch.as_tensor(step_ok).to(device=device, dtype=torch.bool, non_blocking=True)
        flag = (keep.data_ptr(), FLAG_BOOL)
    fp8_max = _torch_fp8_max(config, device)
    pointers = launch_arguments(
        Fp8State(*(f.data_ptr() for f in state)),
        Fp8State(*(f.data_ptr() for f in nxt)),
        amax.data_ptr(),
        fp8_max.data_ptr(),
        flag,
        updated.data_ptr(),
        config.size,
    )
    stream = torch_backend._raw_stream(device)
    module.launch(module.function, module.context, grid_for(config.size), BLOCK, stream, *pointers)
    # the caching allocator must not reuse the inputs before this stream has read them
    for tensor in (*state, amax, fp8_max, keep):
        if tensor is not None:
            torch_backend._record_stream(tensor)
    return nxt, updated
