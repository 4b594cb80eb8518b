"""The backend registry: lazy, and never importing a framework the user did not import.

A backend is chosen by name (``"numpy"``, ``"torch"``, ``"jax"``, ``"cupy"``), by array-API
namespace (``array_api_strict``, ``jax.numpy``, ...), or detected from an array's *type*. The
detection looks at the module the type comes from, so it needs no import; the adapter module
is imported the first time its backend is used (it then imports its framework, which is
already loaded since the user holds one of its arrays).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from ampscale._config import shown
from ampscale.backends._base import FRAMEWORK_MODULES, Backend

__all__ = ["available_backends", "backend_of", "backend_of_leaves", "get_backend"]

#: name -> (adapter module, framework module whose arrays it handles)
_ADAPTERS: dict[str, tuple[str, str]] = {
    "numpy": ("ampscale.backends.numpy", "numpy"),
    "torch": ("ampscale.backends.torch", "torch"),
    "jax": ("ampscale.backends.jax", "jax"),
    "cupy": ("ampscale.backends.cupy", "cupy"),
}


_loaded: dict[str, Backend] = {}
#: namespace module -> its generic backend (keyed by the module itself: an id() could be reused)
_namespaces: dict[Any, Backend] = {}


def available_backends() -> list[str]:
    """Names of the backends whose framework can be imported here (imports nothing)."""
    import importlib.util

    return [name for name, (_, module) in _ADAPTERS.items() if importlib.util.find_spec(module) is not None]


def get_backend(spec: Any) -> Backend:
    """Return the backend for a name, an array-API namespace, or a backend instance.

    Raises:
        ValueError: ``spec`` names no known backend, or its framework is not installed.
    """
    if isinstance(spec, Backend):
        return spec
    if isinstance(spec, str):
        if spec not in _ADAPTERS:
            namespace = _imported_namespace(spec)
            if namespace is not None:
                return get_backend(namespace)
            raise ValueError(
                f"backend must be one of {sorted(_ADAPTERS)}, the name of an array-API namespace "
                f"already imported, a namespace module, or None (detect from the arrays); got {shown(spec)}"
            )
        return _load(spec)
    namespace_name = getattr(spec, "__name__", None)
    if isinstance(namespace_name, str):
        top = namespace_name.split(".")[0]
        if namespace_name in ("numpy", "torch", "cupy", "jax.numpy", "jax"):
            return _load(FRAMEWORK_MODULES[top])
        if namespace_name.startswith("array_api_compat."):
            wrapped = namespace_name.split(".")[1]
            if wrapped in _ADAPTERS:
                return _load(wrapped)
        if hasattr(spec, "asarray") and hasattr(spec, "isfinite"):
            return _generic(spec)
    raise ValueError(
        f"backend must be one of {sorted(_ADAPTERS)}, an array-API namespace, or None "
        f"(detect from the arrays); got {shown(spec)}"
    )


def _imported_namespace(name: str) -> Any:
    """The module ``name``, if it is already imported and looks like an array-API namespace.

    A name is only looked up, never imported: importing a module runs its code, and a backend
    name is not a request to run anything (``backend="this"`` must not print the Zen of Python).
    """
    module = sys.modules.get(name)
    if module is None:
        return None
    if hasattr(module, "asarray") and hasattr(module, "isfinite") and hasattr(module, "__array_api_version__"):
        return module
    return None


def _load(name: str) -> Backend:
    backend = _loaded.get(name)
    if backend is None:
        module_name, framework = _ADAPTERS[name]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if sys.modules.get(framework) is None and exc.name == framework:
                raise ValueError(
                    f"backend {name!r} needs the {framework!r} package, which is not installed "
                    f"(pip install 'ampscale[{name}]')"
                ) from exc
            raise
        backend = module.BACKEND
        _loaded[name] = backend
    return backend


def _generic(namespace: Any) -> Backend:
    try:
        backend = _namespaces.get(namespace)
    except TypeError:  # an unhashable namespace object: not cached
        backend = None
    if backend is None:
        from ampscale.backends.array_api import ArrayApiBackend

        backend = ArrayApiBackend(namespace)
        with contextlib.suppress(TypeError):
            _namespaces[namespace] = backend
    return backend


_type_cache: dict[type, Backend | None] = {}


def backend_of(value: Any) -> Backend | None:
    """The backend of one array, or ``None`` for Python scalars and unknown objects.

    Cached by type; the adapter is loaded on first use, never the framework itself (an
    instance of its array type exists, so the framework is already imported).
    """
    kind = type(value)
    try:
        return _type_cache[kind]
    except KeyError:
        pass
    backend = backend_of_type(kind)
    if backend is None and hasattr(value, "__array_namespace__"):
        backend = get_backend(value.__array_namespace__())
    _type_cache[kind] = backend
    return backend


def backend_of_type(kind: type) -> Backend | None:
    """The backend of a framework's array type, from the module the type is defined in."""
    name = FRAMEWORK_MODULES.get(kind.__module__.split(".")[0])
    if name is not None and _ADAPTERS[name][1] in sys.modules:
        return _load(name)
    cached = _type_cache.get(kind)
    return cached


def backend_of_leaves(leaves: Any, what: str = "gradients") -> Backend | None:
    """The one backend of all ``leaves``; ``TypeError`` when they come from two frameworks."""
    found: Backend | None = None
    first_kind: type | None = None
    seen: set[type] = set()
    for leaf in leaves:
        kind = type(leaf)
        if kind in seen:
            continue
        seen.add(kind)
        backend = backend_of(leaf)
        if backend is None:
            continue
        if found is None:
            found, first_kind = backend, kind
        elif backend is not found:
            raise TypeError(
                f"{what} mix arrays of two frameworks: {_describe(first_kind)} ({found.name}) and "
                f"{_describe(kind)} ({backend.name}); ampscale checks one framework's arrays per call"
            )
    return found


def _describe(kind: type | None) -> str:
    return "?" if kind is None else f"{kind.__module__}.{kind.__qualname__}"
