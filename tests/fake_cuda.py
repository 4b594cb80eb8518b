"""CUDA stand-ins for the CPU: the kernels' host build behind torch's launcher and behind a fake CuPy.

No GPU here, so the CUDA code paths of the torch and CuPy backends and of the drop-in
``GradScaler`` are driven on the CPU:

* :class:`HostModule` replaces a loaded module of :mod:`ampscale._native.cuda.driver`: its
  ``launch`` (the signature of ``ampscale._native.cuda._driver.launch``, with the same grid and
  block checks) runs the host build of the very same module source (``kernels.cu`` after the
  configuration's emitted transition, built with ``-DAMPSCALE_HOST_TEST``), block after block,
  on CPU pointers. One build per distinct source, cached for the session.
* :func:`fake_cupy` is a ``cupy`` module over NumPy: arrays are an ``ndarray`` subclass with
  CuPy's attributes (``data.ptr``, ``data.device_id``, ``_c_contiguous``, ...), devices and streams
  are context objects, events are always done, ``cuda.function.Module().load(image)`` takes the
  image that ampscale's NVRTC call produced and its functions run the host build of the source
  that image was compiled from. ``RawModule`` (CuPy's own compiler) refuses to be used.

Every launch is logged (:attr:`Launches.log`), so tests count launches per step as the GPU
tests do with the profiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ampscale._native.cuda import _plan

_lock = threading.Lock()
_builds: dict[str, ctypes.CDLL] = {}


def build_directory() -> pathlib.Path:
    import tempfile

    path = (
        pathlib.Path(tempfile.gettempdir())
        / f"ampscale-host-kernels-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]}"
    )
    path.mkdir(exist_ok=True)
    return path


def harness_for_source(source: str, directory: pathlib.Path | None = None) -> ctypes.CDLL:
    """The host build of a module source (``-DAMPSCALE_HOST_TEST``), made once per source."""
    import shutil

    with _lock:
        so = _builds.get(source)
        if so is not None:
            return so
        cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            import pytest

            pytest.skip("no C++ compiler on PATH")
        key = hashlib.sha256(source.encode()).hexdigest()[:20]
        directory = directory or build_directory()
        lib = directory / f"module-{key}.so"
        if not lib.exists():
            mine = f"{os.getpid()}-{threading.get_ident()}"  # several test processes may build it at once
            cpp = directory / f"module-{key}.{mine}.cpp"
            cpp.write_text(source)
            partial = directory / f"module-{key}.{mine}.so"
            command = [cxx, "-DAMPSCALE_HOST_TEST", "-std=c++17", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing"]
            subprocess.run([*command, "-o", str(partial), str(cpp)], check=True, timeout=300)
            partial.replace(lib)
            cpp.unlink()
        so = ctypes.CDLL(str(lib))
        _builds[source] = so
        if not hasattr(so, "ampscale_host_step"):  # another module (the FP8 update): see run_kernel
            return so
        p, q = ctypes.c_void_p, ctypes.c_longlong
        so.ampscale_host_step.argtypes = [p, q, ctypes.c_ulonglong, q, q, q, ctypes.c_float, p, p, p, q, ctypes.c_int]
        so.ampscale_host_step.restype = ctypes.c_int
        so.ampscale_host_update.argtypes = [p, p, p, q, p, q, p]
        so.ampscale_host_update_fields.argtypes = [p, p, p, p, q, p, q]
        so.ampscale_host_word_count.restype = ctypes.c_longlong
        _builds[source] = so
        return so


class Launches:
    """Every launch of the fakes, in order: ``(kernel name, grid, stream)``."""

    log: ClassVar[list[tuple[str, int, int]]] = []

    @classmethod
    def names(cls) -> list[str]:
        return [name for name, _, _ in cls.log]


#: the kernels of ``kernels.cu`` and ``fp8_kernels.cu`` whose launches :func:`run_kernel` emulates
#: block by block
KNOWN_KERNELS = frozenset(
    {"ampscale_step", "ampscale_update", "ampscale_update_fields", "ampscale_fp8_pass", "ampscale_fp8_pass_step"}
)


def run_kernel(so: ctypes.CDLL, name: str, grid: int, params: list[int]) -> None:
    """One launch of ``name`` with 64-bit ``params``, emulated on the host."""
    if name == "ampscale_step":
        table, grad_chunks, loss, meta, inv, scratch, state_in, state_out, options = params
        inverse = ctypes.c_float.from_address(inv).value
        ran = so.ampscale_host_step(
            table, grad_chunks, loss, meta, grid, _plan.CHUNK, inverse, scratch, state_in, state_out, options, 4
        )
        assert ran == (grid - 1 if options & _plan.TAIL else -1), (ran, grid)
    elif name == "ampscale_update":
        assert grid == 1
        so.ampscale_host_update(*params)
    elif name == "ampscale_update_fields":
        assert grid == 1
        so.ampscale_host_update_fields(*params)
    elif name == "ampscale_fp8_pass":
        p, q = ctypes.c_void_p, ctypes.c_longlong
        so.ampscale_fp8_host_pass.argtypes = [p, q, q, p, p, q, q, p, p, p, p, p, p, ctypes.c_int]
        so.ampscale_fp8_host_pass.restype = ctypes.c_int
        table, chunks, payload, scales, slots, options, top, clipped, ticket, amaxes, counts, finite = params
        assert grid == max(1, chunks)
        finished = so.ampscale_fp8_host_pass(
            table, chunks, grid, payload, scales, slots, options, top, clipped, ticket, amaxes, counts, finite, 4
        )
        assert finished == grid - 1
    elif name == "ampscale_fp8_pass_step":
        # the pass's 12 parameters, then the state's, every one 8 bytes: passed through as they are
        host = so.ampscale_fp8_host_pass_step
        host.argtypes = [ctypes.c_longlong, ctypes.c_int, *([ctypes.c_ulonglong] * len(params))]
        host.restype = ctypes.c_int
        assert grid == max(1, params[1])
        finished = host(grid, 4, *(int(value) & 0xFFFFFFFFFFFFFFFF for value in params))
        assert finished == grid - 1
    elif hasattr(so, f"{name}_host"):
        # a kernel whose source carries its own harness, ``{name}_host(grid, *params)``, with
        # every parameter 8 bytes (pointers and long long), e.g. ampscale_fp8_update
        host = getattr(so, f"{name}_host")
        host.argtypes = [ctypes.c_longlong, *([ctypes.c_ulonglong] * len(params))]
        host.restype = None
        host(grid, *(int(value) & 0xFFFFFFFFFFFFFFFF for value in params))
    else:  # pragma: no cover
        raise AssertionError(f"unknown kernel {name}")


class HostModule:
    """A :class:`ampscale._native.cuda.driver.DeviceModule` whose launches run the host build."""

    step, update, update_fields, context, kind = "ampscale_step", "ampscale_update", "ampscale_update_fields", 0, "host"

    def __init__(self, source: str) -> None:
        self.source = source
        self.so = harness_for_source(source)

    @property
    def launches(self) -> list[str]:
        return Launches.names()

    def launch(self, function: str, context: int, grid: int, block: int, stream: int, *params: int) -> None:
        # the checks of ampscale._native.cuda._driver.launch, before anything is queued
        if not (1 <= grid <= 0x7FFFFFFF) or not (1 <= block <= 1024):
            raise ValueError(f"launch(): grid must be in [1, 2**31 - 1] and block in [1, 1024]; got {grid}, {block}")
        Launches.log.append((function, grid, stream))
        run_kernel(self.so, function, grid, list(params))


class TorchCuda:
    """The torch backend's CUDA path on CPU tensors: modules, streams, capture, record_stream."""

    def __init__(self) -> None:
        self.stream = 0
        self.capturing = False
        self.recorded: list[tuple[int, int]] = []  # (data_ptr, stream) of every record_stream
        self.modules: dict[str, HostModule] = {}

    def module(self, config: Any, device: Any) -> HostModule:
        source = _plan.module_source(config)
        module = self.modules.get(source)
        if module is None:
            module = self.modules[source] = HostModule(source)
        return module


@contextlib.contextmanager
def torch_on_host(monkeypatch: Any, packed_on_cpu: bool = True) -> Iterator[TorchCuda]:
    """Patch the torch backend (and the drop-in) so that CPU tensors take the CUDA code path.

    ``packed_on_cpu``: the functional scaler's lazy state on CPU tensors is a packed record
    (as on CUDA) rather than host numbers.
    """
    from ampscale import _torch_scaler
    from ampscale.backends import _torch_cuda
    from ampscale.backends import torch as torch_backend

    fake = TorchCuda()
    Launches.log.clear()
    monkeypatch.setattr(_torch_cuda, "_cuda_module", fake.module)
    monkeypatch.setattr(_torch_cuda, "_current_raw_stream", lambda index: fake.stream)
    monkeypatch.setattr(_torch_cuda, "_capturing", lambda: fake.capturing, raising=False)
    monkeypatch.setattr(
        _torch_cuda,
        "_record_stream",
        lambda tensor: fake.recorded.append((tensor.data_ptr(), fake.stream)),
        raising=False,
    )
    monkeypatch.setattr(_torch_cuda, "_cuda_tables", {})
    if packed_on_cpu:
        import torch

        monkeypatch.setattr(torch_backend, "_is_cpu", lambda value: not isinstance(value, torch.Tensor))
        monkeypatch.setattr(_torch_scaler, "_DEVICE_PATH_EVERYWHERE", True)
    yield fake


# ------------------------------------------------------------------------------ a fake CuPy


class _Memory:
    __slots__ = ("device_id", "ptr")

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id


class FakeCupyState:
    """What the fake CuPy saw: images loaded, compiles refused, the current stream."""

    def __init__(self) -> None:
        self.images: list[bytes] = []
        self.sources: dict[bytes, str] = {}  # image -> the source it was compiled from
        self.stream_stack: list[Any] = []
        self.capturing = False
        self.events: list[Any] = []
        self.compute_capability = "90"
        #: every ufunc CuPy would run as one of its own kernels (compiled with -ftz=true):
        #: ``(name, method, dtypes of the array operands)``
        self.ufuncs: list[tuple[str, str, tuple[str, ...]]] = []


def fake_cupy(state: FakeCupyState | None = None) -> types.ModuleType:
    """A ``cupy`` module over NumPy (see the module docstring); ``state`` records what it saw."""
    state = state or FakeCupyState()
    cp = types.ModuleType("cupy")
    import importlib.machinery

    cp.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cp.__version__ = "0-fake"  # type: ignore[attr-defined]
    cp._fake_state = state  # type: ignore[attr-defined]

    class Device:
        def __init__(self, device_id: int | None = 0) -> None:
            self.id = 0 if device_id is None else int(device_id)
            if self.id != 0:
                raise ValueError("the fake CuPy has one device")

        @property
        def compute_capability(self) -> str:
            return state.compute_capability

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Device) and other.id == self.id

        def __hash__(self) -> int:
            return self.id

    class ndarray(np.ndarray):
        @property
        def data(self) -> _Memory:
            return _Memory(self.__array_interface__["data"][0], 0)

        @property
        def device(self) -> Device:  # type: ignore[override]
            return Device(0)

        @property
        def _c_contiguous(self) -> bool:
            return bool(self.flags.c_contiguous)

        @property
        def _f_contiguous(self) -> bool:
            return bool(self.flags.f_contiguous)

        def get(self) -> np.ndarray:
            return np.array(self)

        def __getitem__(self, key: Any) -> Any:
            # CuPy: an integer index gives a 0-d array viewing the element (NumPy: a copy)
            if isinstance(key, (int, np.integer)) and self.ndim == 1:
                k = int(key) % self.shape[0]
                return super().__getitem__(slice(k, k + 1)).reshape(())
            return super().__getitem__(key)

        def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
            # a ufunc is one of CuPy's own elementwise kernels (compiled with -ftz=true): logged,
            # so that tests see which operations would go through CuPy's compiler
            dtypes = tuple(str(x.dtype) for x in inputs if isinstance(x, np.ndarray))
            state.ufuncs.append((ufunc.__name__, method, dtypes))
            plain = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs)
            out = kwargs.get("out")
            if out is not None:
                kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, ndarray) else o for o in out)
            result = getattr(ufunc, method)(*plain, **kwargs)
            if out is not None:  # in place (``a *= x``): CuPy returns the very arrays written
                return out[0] if len(out) == 1 else out
            return _as_cupy(result)

        def __array_wrap__(self, array: Any, context: Any = None, return_scalar: bool = False) -> Any:
            if isinstance(array, ndarray):
                return array  # an in-place operation's output (``a *= x``): CuPy returns ``a`` itself
            # CuPy never returns a scalar: 0-d results stay arrays
            return np.asarray(array).view(ndarray)

    def _as_cupy(value: Any) -> Any:
        """CuPy never returns a scalar: every array or scalar result becomes an array."""
        if isinstance(value, tuple):
            return tuple(map(_as_cupy, value))
        if isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, ndarray):
            return np.asarray(value).view(ndarray)
        return value

    ndarray.__module__ = "cupy"
    ndarray.__qualname__ = ndarray.__name__ = "ndarray"

    def asarray(value: Any, dtype: Any = None) -> Any:
        if isinstance(value, ndarray) and (dtype is None or np.dtype(dtype) == value.dtype):
            return value
        return np.array(value, dtype=dtype, copy=True).view(ndarray)

    def _make(fn: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs).view(ndarray)

        return make

    cp.ndarray = ndarray  # type: ignore[attr-defined]
    cp.asarray = asarray  # type: ignore[attr-defined]
    cp.asnumpy = lambda x: np.array(x)  # type: ignore[attr-defined]
    for name in ("full", "zeros", "empty", "ones", "arange"):
        setattr(cp, name, _make(getattr(np, name)))
    for name in ("float16", "float32", "float64", "int32", "int64", "uint8", "uint16", "bool_", "nan", "inf"):
        setattr(cp, name, getattr(np, name))
    cp.__getattr__ = lambda name: getattr(np, name)  # type: ignore[attr-defined] # ufuncs and the like

    class Stream:
        made = 0

        def __init__(self, non_blocking: bool = False, ptr: int | None = None) -> None:
            Stream.made += 1
            self.ptr = ptr if ptr is not None else 1000 + Stream.made

        def __enter__(self) -> Stream:
            state.stream_stack.append(self)
            return self

        def __exit__(self, *exc: object) -> None:
            state.stream_stack.pop()

        def is_capturing(self) -> bool:
            return state.capturing or self.capturing

        # stream capture as CuPy has it (nothing is recorded: the backends refuse to run under it)
        capturing = False

        def begin_capture(self, mode: Any = None) -> None:
            self.capturing = True

        def end_capture(self) -> Any:
            self.capturing = False
            return types.SimpleNamespace(launch=lambda stream=None: None, upload=lambda stream=None: None)

        def record(self, event: Any = None) -> Any:
            event = event or Event()
            event.record(self)
            return event

        def wait_event(self, event: Any) -> None:
            return None

        def synchronize(self) -> None:
            return None

    null = Stream(ptr=0)

    def get_current_stream() -> Stream:
        return state.stream_stack[-1] if state.stream_stack else null

    class Event:
        def __init__(self, disable_timing: bool = False) -> None:
            self.recorded_on: int | None = None
            state.events.append(self)

        def record(self, stream: Stream | None = None) -> None:
            self.recorded_on = (stream or get_current_stream()).ptr

        @property
        def done(self) -> bool:
            return False  # the fake never says a stream has passed: held buffers stay held

    def _pointer(value: Any) -> int:
        return int(value.data.ptr) if isinstance(value, ndarray) else int(value)

    class Function:
        def __init__(self, module: Module, name: str) -> None:
            self.module = module
            self.name = name

        def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], **kwargs: Any) -> None:
            blocks = max(1, grid[0])  # CuPy launches at least one block
            Launches.log.append((self.name, blocks, get_current_stream().ptr))
            params = [_pointer(a) for a in args]
            if self.name in KNOWN_KERNELS or hasattr(self.module.so, f"{self.name}_host"):
                run_kernel(self.module.so, self.name, blocks, params)
            else:
                # a module of the tests' own (the transitions batched in one module): its host
                # twin of the same name does the whole launch's work in one call
                twin = getattr(self.module.so, self.name)
                twin.argtypes = [ctypes.c_longlong] * len(params)
                twin(*params)

    class Module:
        def __init__(self) -> None:
            self.so: ctypes.CDLL | None = None

        def load(self, image: bytes) -> None:
            assert isinstance(image, bytes)
            state.images.append(image)
            source = state.sources.get(image)
            if source is None:
                raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: the fake CuPy knows no source for this image")
            self.so = harness_for_source(source)

        def get_function(self, name: str) -> Function:
            return Function(self, name)

    def raw_module(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"CuPy was asked to compile (RawModule{kwargs and tuple(kwargs)}): it must not")

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device  # type: ignore[attr-defined]
    cuda.Stream = Stream  # type: ignore[attr-defined]
    cuda.Event = Event  # type: ignore[attr-defined]
    cuda.get_current_stream = get_current_stream  # type: ignore[attr-defined]
    cuda.function = types.SimpleNamespace(Module=Module, Function=Function)  # type: ignore[attr-defined]
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)  # type: ignore[attr-defined]
    cuda.nccl = _fake_nccl()  # type: ignore[attr-defined]
    cp.cuda = cuda  # type: ignore[attr-defined]
    cp.RawModule = raw_module  # type: ignore[attr-defined]
    cp.RawKernel = raw_module  # type: ignore[attr-defined]
    return cp


def _fake_nccl() -> types.ModuleType:
    """``cupy.cuda.nccl`` for one process and one rank: an all-reduce over one rank is a copy of
    the send buffer into the receive buffer (nothing when they are one buffer)."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    sizes = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8}  # NCCL's dtype codes -> bytes
    nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT64 = 7, 6, 8  # type: ignore[attr-defined]
    nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN = 0, 1, 2, 3  # type: ignore[attr-defined]
    nccl.available = True  # type: ignore[attr-defined]
    nccl.get_unique_id = lambda: (0,) * 128  # type: ignore[attr-defined]

    class NcclCommunicator:
        def __init__(self, ndev: int, commId: Any, rank: int) -> None:
            if ndev != 1 or rank != 0:
                raise ValueError("the fake NCCL has one rank")

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
            if sendbuf != recvbuf:
                ctypes.memmove(recvbuf, sendbuf, count * sizes[datatype])

        def size(self) -> int:
            return 1

        def rank_id(self) -> int:
            return 0

    nccl.NcclCommunicator = NcclCommunicator  # type: ignore[attr-defined]
    return nccl


def cupy_namespace(cp: types.ModuleType) -> types.ModuleType:
    """``array_api_compat.cupy`` for the fake CuPy: ``array_api_compat.numpy`` whose array results
    are the fake's arrays (0-d ones too: CuPy returns no scalars), as CuPy's own namespace gives
    CuPy arrays. A plain NumPy result would change type on the next operation of the step."""
    import functools

    import array_api_compat.numpy as xp_numpy

    fake = cp.ndarray  # type: ignore[attr-defined]
    device_type = cp.cuda.Device  # type: ignore[attr-defined]

    def as_cupy(value: Any) -> Any:
        if isinstance(value, fake):
            return value
        if isinstance(value, (np.ndarray, np.generic)):
            return np.asarray(value).view(fake)
        if isinstance(value, tuple):
            return tuple(map(as_cupy, value))
        if isinstance(value, list):
            return [as_cupy(v) for v in value]
        return value

    class Namespace(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            value = getattr(xp_numpy, name)
            if callable(value) and not isinstance(value, type):
                original = value

                @functools.wraps(original)
                def value(*args: Any, **kwargs: Any) -> Any:
                    if isinstance(kwargs.get("device"), device_type):
                        kwargs["device"] = "cpu"  # the fake's one GPU is NumPy's memory
                    return as_cupy(original(*args, **kwargs))

            setattr(self, name, value)
            return value

    return Namespace("array_api_compat.cupy")


def _cupy_modules(cp: types.ModuleType) -> dict[str, types.ModuleType]:
    """The entries of ``sys.modules`` that make ``from cupy.cuda import nccl`` work on the fake."""
    return {"cupy": cp, "cupy.cuda": cp.cuda, "cupy.cuda.nccl": cp.cuda.nccl}  # type: ignore[attr-defined]


@contextlib.contextmanager
def cupy_on_host(monkeypatch: Any, compile_for_real: bool = False) -> Iterator[tuple[Any, Any]]:
    """The CuPy backend over :func:`fake_cupy`: yields ``(fake cupy, ampscale.backends.cupy)``.

    ``compile_for_real``: ampscale's NVRTC call really compiles (NVRTC must load); else it
    returns a tagged image of the source. Either way the fake ``Module.load`` runs the host
    build of the source the image was compiled from.
    """
    import importlib

    from ampscale import backends
    from ampscale._native.cuda import nvrtc

    state = FakeCupyState()
    cp = fake_cupy(state)
    Launches.log.clear()
    for name, module in _cupy_modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "ampscale.backends.cupy", raising=False)
    monkeypatch.setattr(backends, "_loaded", {k: v for k, v in backends._loaded.items() if k != "cupy"})
    real_compiled = nvrtc.compiled

    def compiled(source: str, arch: int, options: Any = (), name: str = "ampscale.cu") -> tuple[bytes, str]:
        if compile_for_real:
            image, kind = real_compiled(source, arch, options, name)
        else:
            image, kind = b"host-build:" + hashlib.sha256(source.encode()).digest(), "cubin"
        state.sources[image] = source
        state.compiled = (source, arch, tuple(options), name)  # type: ignore[attr-defined]
        return image, kind

    monkeypatch.setattr(nvrtc, "compiled", compiled)
    module = importlib.import_module("ampscale.backends.cupy")
    monkeypatch.setattr(backends, "cupy", module, raising=False)  # (import set it: put it back after)
    namespace = cupy_namespace(cp)
    monkeypatch.setattr(module.CupyBackend, "namespace", lambda self: namespace)
    try:
        yield cp, module
    finally:
        sys.modules.pop("ampscale.backends.cupy", None)


def install_fake_cupy_for_the_session() -> None:
    """Put :func:`fake_cupy` in place of ``cupy`` for a whole test session (``AMPSCALE_FAKE_CUPY=1``:
    ``tests/conftest.py`` calls this before anything imports cupy), so that every test that runs
    on CuPy, the shared contract tests included (``-m gpu -k cupy``), runs once against the host
    build of the kernels. Never set in CI: it replaces a real CuPy."""
    from ampscale._native.cuda import nvrtc

    state = FakeCupyState()
    cp = fake_cupy(state)
    sys.modules.update(_cupy_modules(cp))
    real_compiled = nvrtc.compiled

    def compiled(source: str, arch: int, options: Any = (), name: str = "ampscale.cu") -> tuple[bytes, str]:
        image = b"host-build:" + hashlib.sha256(source.encode()).digest()
        state.sources[image] = source
        return image, "cubin"

    compiled.real = real_compiled  # type: ignore[attr-defined]
    nvrtc.compiled = compiled  # type: ignore[assignment]
    from ampscale.backends import cupy as module

    namespace = cupy_namespace(cp)
    module.CupyBackend.namespace = lambda self: namespace  # type: ignore[method-assign]


def install_torch_cuda_path_for_the_session() -> None:
    """CPU tensors down the torch backend's CUDA code path for a whole session
    (``AMPSCALE_FAKE_TORCH_CUDA=1``: see ``tests/conftest.py``), so that the shared contract
    tests of the ``torch`` framework (``-k torch``) run once as they would on ``torch-cuda``,
    against the host build of the kernels. Never set in CI: the CPU paths are then not tested."""
    import pytest

    torch_on_host(pytest.MonkeyPatch()).__enter__()
