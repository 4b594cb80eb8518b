"""Run a callback right after a module is first imported, never importing it (foundation layer).

ampscale reacts to frameworks the user imports, in either order: the scaler becomes a JAX pytree
once ``jax`` is imported (before or after ampscale), the JAX adapter registers its flax
serialization once ``flax.serialization`` is. Neither may import the framework itself
(``import ampscale`` imports none), so each leaves a one-shot import hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["when_imported"]


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` now if the module ``name`` is imported, else right after its
    first import (a one-shot import hook, removed when it has run)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _hooks_lock:
        for finder in sys.meta_path:
            if isinstance(finder, _AfterImport) and finder.name == name:
                finder.callbacks.append(callback)
                return
        sys.meta_path.insert(0, _AfterImport(name, callback))


_hooks_lock = threading.Lock()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks once, right after the module ``name`` has been executed."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callbacks = [callback]

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        with _hooks_lock:
            try:
                sys.meta_path.remove(self)  # one shot; the real spec comes from the other finders
            except ValueError:
                return None
        spec = importlib.util.find_spec(fullname)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        callbacks = self.callbacks

        def exec_module(module: Any) -> None:
            execute(module)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
