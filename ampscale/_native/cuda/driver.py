"""The kernels of one configuration on one GPU, compiled by NVRTC and launched through the driver.

:func:`module_for` returns a :class:`DeviceModule` (the ``ampscale_step`` and ``ampscale_update``
functions of :mod:`ampscale._native.cuda._plan`'s module source, loaded into the device's primary
context), or ``None`` where the fast path cannot run: the C extension was not built, the
driver (``libcuda.so.1``) or NVRTC cannot be loaded, or NVRTC refused the source. Then the
caller keeps its eager path, and one :class:`~ampscale.PerformanceWarning` per process says
why. Launches go through :func:`ampscale._native.cuda._driver.launch` (METH_FASTCALL, a fraction of a
microsecond of Python).
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

from ampscale._errors import PerformanceWarning
from ampscale._native.cuda import _plan, nvrtc

if TYPE_CHECKING:
    from ampscale._config import ScalerConfig

__all__ = ["DeviceModule", "launcher", "module_for", "unavailable_reason"]

_lock = threading.Lock()
_reason: list[str | None] = []  # [why the driver path cannot run, or None], once known
_warned: set[str] = set()
_modules: dict[tuple[str, int], DeviceModule] = {}  # (source, device ordinal) -> loaded module


def launcher() -> Any:
    """The C extension's module (``init()`` done). Raises ``OSError``/``RuntimeError``/``ImportError``."""
    from ampscale._native.cuda import _driver

    _driver.init()
    return _driver


def unavailable_reason() -> str | None:
    """Why modules cannot be compiled and launched here (``None``: they can). Checked once."""
    with _lock:
        if _reason:
            return _reason[0]
        reason: str | None = None
        try:
            launcher()
        except ImportError as exc:
            reason = f"the C extension ampscale._native.cuda._driver is not built ({exc})"
        except (OSError, RuntimeError) as exc:
            reason = str(exc)
        if reason is None:
            try:
                nvrtc.load()
            except OSError as exc:
                reason = str(exc)
        _reason.append(reason)
        return reason


def warn_fallback(framework: str, reason: str, stacklevel: int = 4, results: str = "the same results") -> None:
    """One :class:`PerformanceWarning` per process and framework: the eager path runs, and why.

    ``results``: how the eager path's results compare with the kernels' (CuPy's own kernels
    flush subnormals: see :mod:`ampscale.backends.cupy`).
    """
    with _lock:
        if framework in _warned:
            return
        _warned.add(framework)
    warnings.warn(
        f"ampscale: the one-launch CUDA step is not available for {framework} ({reason}); the state "
        f"update runs as eager array operations instead ({results}, more kernel launches per step)",
        PerformanceWarning,
        stacklevel=stacklevel,
    )


class DeviceModule:
    """The kernels of one configuration, loaded on one device.

    Attributes:
        ordinal: the CUDA device ordinal.
        context: the primary context the module lives in.
        step: the ``ampscale_step`` function handle.
        update: the ``ampscale_update`` function handle.
        update_fields: the ``ampscale_update_fields`` function handle (the drop-in GradScaler's
            in-place update).
        kind: ``"cubin"`` or ``"ptx"``, what NVRTC produced.
    """

    __slots__ = ("context", "kind", "launch", "module", "ordinal", "step", "update", "update_fields")

    def __init__(self, source: str, ordinal: int) -> None:
        driver = launcher()
        major, minor = driver.compute_capability(ordinal)
        image, self.kind = nvrtc.compiled(source, 10 * major + minor, _plan.COMPILE_OPTIONS, "ampscale.cu")
        if self.kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # the driver reads PTX as a C string
        self.ordinal = ordinal
        self.module, self.context = driver.load_module(ordinal, image)
        self.step = driver.get_function(self.module, self.context, "ampscale_step")
        self.update = driver.get_function(self.module, self.context, "ampscale_update")
        self.update_fields = driver.get_function(self.module, self.context, "ampscale_update_fields")
        self.launch = driver.launch


def module_for(config: ScalerConfig, ordinal: int, framework: str) -> DeviceModule | None:
    """The module for ``config`` on device ``ordinal``, made once per distinct source; ``None``
    (and one warning) if the driver path cannot run here."""
    key = f"cuda-module:{ordinal}"
    cache = config._cache
    if key in cache:
        return cache[key]  # type: ignore[no-any-return]
    reason = unavailable_reason()
    module = None
    if reason is None:
        source = _plan.module_source(config)
        try:
            with _lock:
                module = _modules.get((source, ordinal))
                if module is None:
                    module = _modules[source, ordinal] = DeviceModule(source, ordinal)
        except (OSError, RuntimeError) as exc:  # NvrtcError is a RuntimeError
            reason = str(exc)
    if module is None:
        assert reason is not None
        warn_fallback(framework, reason)
    cache[key] = module
    return module
