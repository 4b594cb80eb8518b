"""The backend registry (its own layer, above the adapters): lazy, and never importing a
framework the user did not import.

A backend is chosen by name (``"numpy"``, ``"torch"``, ``"jax"``, ``"cupy"``), by array-API
namespace (``array_api_strict``, ``jax.numpy``, ...), or detected from an array's *type*. The
detection looks at the module the type comes from, so it needs no import; the adapter module
is imported the first time its backend is used (it then imports its framework, which is
already loaded since the user holds one of its arrays).

:func:`flatten_tree` is the one way down for a tree of arrays: it finds the tree's backend
(unless the caller knows it) and flattens the tree once, with that backend's tree utility.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from ampscale import _tree
from ampscale._config import shown
from ampscale.backends._base import FRAMEWORK_MODULES, Backend

__all__ = ["available_backends", "backend_of", "backend_of_leaves", "flatten_tree", "get_backend", "probe_leaves"]

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


def flatten_tree(
    tree: Any, backend: Backend | None = None, *, also: Any = None, what: str = "gradients"
) -> tuple[Backend, list[Any], Any]:
    """``(backend, leaves, spec)``: ``tree`` flattened once, by its backend's tree utility.

    ``backend``: the one the caller knows already (a scaler's), used as it is. Without it the
    backend is that of the tree's first array in tree order (or of ``also``, an array that goes
    with the tree: the scaled loss), NumPy's where there is none; the walk that finds it stops
    at that array. Every leaf (and ``also``) must then be of that backend or of none:
    ``TypeError`` naming the two frameworks otherwise.
    """
    if backend is not None:
        leaves, spec = backend.flatten(tree)
        return backend, leaves, spec
    found = _first_backend(tree)
    if found is None and also is not None:
        found = backend_of(also)
    if found is None:
        found = _load("numpy")
    leaves, spec = found.flatten(tree)
    # one leaf of each type is looked up (the dict is built in C); an array of another backend,
    # or an object of none that JAX may flatten into arrays, is named in tree order
    others = [backend_of(leaf) for leaf in dict(zip(map(type, leaves), leaves, strict=True)).values()]
    if also is not None:
        others.append(backend_of(also))
    for other in others:
        if other is not found and (other is not None or ("jax" in sys.modules and found.name != "jax")):
            _one_framework(tree, also, what)
            break
    return found, leaves, spec


def _first_backend(tree: Any) -> Backend | None:
    """The backend of the first array of ``tree`` in tree order (``None``: it holds none)."""
    for leaf in _tree.iter_leaves(tree):
        found = backend_of(leaf)
        if found is None and "jax" in sys.modules:
            for inner in _pytree_leaves(leaf):
                found = backend_of(inner)
                if found is not None:
                    return found
        elif found is not None:
            return found
    return None


def _pytree_leaves(value: Any) -> list[Any]:
    """The leaves of an object that is no array of any backend, in case it is a pytree registered
    with JAX (a flax struct, an optax state, ...): JAX's own flatten, through its adapter (the
    object itself where the adapter cannot load)."""
    try:
        jax_backend = _load("jax")
    except Exception:  # a JAX the adapter cannot use: its first use will say why
        return [value]
    return jax_backend.flatten(value)[0]


def probe_leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` in tree order, the leaves of objects registered with JAX included,
    the same whether or not JAX is imported (a flatten, for detection only).

    Plain containers are walked by ampscale itself (JAX would sort dict keys, and fail on
    ``{1: a, "b": b}``); only an object that is no array of any backend is handed to JAX.
    """
    out: list[Any] = []
    for leaf in _tree.iter_leaves(tree):
        if backend_of(leaf) is None and "jax" in sys.modules:
            out.extend(_pytree_leaves(leaf))
        else:
            out.append(leaf)
    return out


def _one_framework(tree: Any, also: Any, what: str) -> None:
    """Raise the ``TypeError`` for a tree (and ``also``) that mixes two frameworks' arrays,
    naming the first array of each in tree order (an error path: the tree is walked again)."""
    leaves = probe_leaves(tree)
    backend_of_leaves(leaves if also is None else [*leaves, also], what)
