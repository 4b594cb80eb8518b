"""What this installation can run: :func:`info`, and its text form for ``python -m ampscale info``.

Package layer.

A framework that imports is not yet a backend that works: CuPy installs without a GPU or with
a driver older than its CUDA runtime, and fails only at the first kernel. So each backend is
reported as *installed* (its package imports), *usable* (a small computation ran on one of its
devices) and, where it is not, the *problem* in one line and the *fix* (usually a command).

Backend-specific facts go into each backend's ``details`` mapping (name to one-line text); the
text form prints every entry, so a new fact needs no change here.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
from collections.abc import Callable, Iterable
from typing import Any

from ampscale._config import PRESETS
from ampscale._version import __version__

__all__ = ["BACKENDS", "backend_info", "format_info", "info", "missing_framework"]

#: backend name -> (the package it needs, what to call it in messages, the install command)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "numpy": ("numpy", "NumPy", "pip install ampscale"),
    "torch": ("torch", "PyTorch", "pip install 'ampscale[torch]'"),
    "jax": ("jax", "JAX", "pip install 'ampscale[jax]'"),
    "cupy": ("cupy", "CuPy", "pip install 'ampscale[cupy]' (CUDA 12) or pip install 'ampscale[cupy-cuda13]' (CUDA 13)"),
}


def info(backends: Iterable[str] | None = None) -> dict[str, Any]:
    """Facts about this installation, as plain values (JSON-serialisable).

    Each installed framework is imported and runs one small computation on its devices, so
    this takes as long as those imports (seconds with torch and JAX); nothing else is changed.

    Args:
        backends: the backends to examine (default: ``"numpy"``, ``"torch"``, ``"jax"`` and
            ``"cupy"``).

    Returns:
        ``{"ampscale": version, "python": version, "platform": text, "presets": [names],
        "backends": {name: facts}}``, where the facts of one backend are ``installed`` (bool),
        ``version`` (str or ``None``), ``usable`` (bool: a computation ran on a device),
        ``devices`` (list of str), ``problem`` and ``fix`` (one line each, ``None`` when
        usable) and ``details`` (name to one-line text, e.g. the NumPy kernel in use).

    Raises:
        ValueError: an unknown backend name.

    Example:
        >>> import ampscale
        >>> backends = ampscale.info(["numpy"])["backends"]
        >>> numpy_facts = backends["numpy"]
        >>> numpy_facts["usable"], numpy_facts["devices"]
        (True, ['cpu'])
    """
    names = list(BACKENDS) if backends is None else list(backends)
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"backends must name some of {list(BACKENDS)}; got {name!r}")
    return {
        "ampscale": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "presets": list(PRESETS),
        "backends": {name: backend_info(name) for name in names},
    }


def backend_info(name: str) -> dict[str, Any]:
    """The facts :func:`info` gives for one backend (see there)."""
    package, label, install = BACKENDS[name]
    facts: dict[str, Any] = {
        "installed": False,
        "version": None,
        "usable": False,
        "devices": [],
        "problem": None,
        "fix": None,
        "details": {},
    }
    if importlib.util.find_spec(package) is None:
        facts["problem"] = f"{label} is not installed"
        facts["fix"] = install
        return facts
    try:
        module = importlib.import_module(package)
    except Exception as exc:  # a broken install: say why, in one line
        facts["problem"] = f"{label} is installed but does not import ({_one_line(exc)})"
        facts["fix"] = f"reinstall it: {install}"
        return facts
    facts["installed"] = True
    facts["version"] = str(getattr(module, "__version__", "unknown"))
    try:
        _PROBES[name](module, facts)
    except Exception as exc:  # the device is the problem, not ampscale: report, do not raise
        facts["devices"] = []
        facts["problem"] = f"{label} {facts['version']} is installed but cannot compute ({_one_line(exc)})"
        facts["fix"] = _DEVICE_FIX[name]
        return facts
    facts["usable"] = bool(facts["devices"])
    if not facts["usable"] and facts["problem"] is None:
        facts["problem"] = f"{label} {facts['version']} is installed but sees no device"
        facts["fix"] = _DEVICE_FIX[name]
    return facts


def _probe_numpy(np: Any, facts: dict[str, Any]) -> None:
    from ampscale.backends import numpy as numpy_backend

    if not bool(np.isfinite(np.ones(2, np.float32) * np.float32(2)).all()):
        raise RuntimeError("NumPy arithmetic gave a non-finite result")
    facts["devices"] = ["cpu"]
    if numpy_backend.NATIVE:
        kernel = f"native ({numpy_backend.kernel_isa()}), {numpy_backend.num_threads()} threads"
    else:
        kernel = "pure NumPy (the native kernel was not built: reinstall with a C compiler for the fast path)"
    facts["details"]["kernel"] = kernel


def _probe_torch(torch: Any, facts: dict[str, Any]) -> None:
    float(torch.ones(2).sum())
    facts["devices"] = ["cpu"]
    if not torch.cuda.is_available():
        facts["details"]["cuda"] = "not available (CPU only)"
        return
    try:  # the CPU works whatever happens here: a broken GPU is reported as a detail
        for index in range(torch.cuda.device_count()):
            float(torch.ones(2, device=f"cuda:{index}").sum())
            facts["devices"].append(f"cuda:{index} ({torch.cuda.get_device_name(index)})")
    except Exception as exc:
        facts["details"]["cuda"] = f"not usable ({_one_line(exc)})"


def _probe_jax(jax: Any, facts: dict[str, Any]) -> None:
    devices = jax.devices()
    float(jax.numpy.ones(2).sum())  # on the default device
    facts["devices"] = [f"{device.platform}:{device.id}" for device in devices]
    # loads (on first use, compiles) the CPU handler of the fused custom call
    facts["details"]["custom call"] = str(importlib.import_module("ampscale.backends.jax").custom_call_status())
    optax_spec = importlib.util.find_spec("optax")
    if optax_spec is None:
        facts["details"]["optax"] = "not installed (needed by ampscale.jax.loss_scaled: pip install optax)"
    else:
        facts["details"]["optax"] = str(getattr(importlib.import_module("optax"), "__version__", "installed"))


def _probe_cupy(cupy: Any, facts: dict[str, Any]) -> None:
    count = int(cupy.cuda.runtime.getDeviceCount())
    devices = []
    for index in range(count):
        with cupy.cuda.Device(index):
            float(cupy.ones(2, dtype=cupy.float32).sum())  # compiles and runs a kernel: driver, NVRTC
        name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
        devices.append(f"cuda:{index} ({name.decode() if isinstance(name, bytes) else name})")
    facts["devices"] = devices


_PROBES: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "numpy": _probe_numpy,
    "torch": _probe_torch,
    "jax": _probe_jax,
    "cupy": _probe_cupy,
}

_DEVICE_FIX = {
    "numpy": "reinstall NumPy: pip install --force-reinstall numpy",
    "torch": "reinstall PyTorch for this machine (https://pytorch.org/get-started/locally/)",
    "jax": "reinstall JAX for this machine (https://docs.jax.dev/en/latest/installation.html)",
    "cupy": "CuPy needs an NVIDIA GPU and a driver at least as new as its CUDA runtime: update the driver "
    "(nvidia-smi shows it), install the CuPy package of the driver's CUDA version, or use another backend",
}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {text}"


def format_info(facts: dict[str, Any]) -> str:
    """The text ``python -m ampscale info`` prints for :func:`info`'s result."""
    lines = [f"ampscale {facts['ampscale']} (Python {facts['python']}, {facts['platform']})"]
    for name, backend in facts["backends"].items():
        label = BACKENDS[name][1]
        if backend["usable"]:
            lines.append(f"{name}: usable on {_devices_text(backend['devices'])} ({label} {backend['version']})")
        elif backend["installed"]:
            lines.append(f"{name}: NOT usable: {backend['problem']}")
            lines.append(f"  fix: {backend['fix']}")
        else:
            lines.append(f"{name}: not installed; to install: {backend['fix']}")
        for key, value in backend["details"].items():
            lines.append(f"  {key}: {value}")
    lines.append(f"presets: {', '.join(facts['presets'])}")
    return "\n".join(lines)


def _devices_text(devices: list[str]) -> str:
    if len(devices) <= 3:
        return ", ".join(devices)
    return f"{devices[0]} ... {devices[-1]} ({len(devices)} devices)"


def missing_framework(module: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error to raise when ``import <module>`` fails for want of a framework.

    ``exc`` itself when what is missing is not one of :data:`BACKENDS`' frameworks; otherwise a
    ``ModuleNotFoundError`` (same ``name``) that says which command installs it.
    """
    for package, label, install in BACKENDS.values():
        if exc.name == package:
            message = f"{module} needs {label}, which is not installed: {install}"
            return ModuleNotFoundError(message, name=package)
    return exc
