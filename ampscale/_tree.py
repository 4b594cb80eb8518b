"""Tree handling: flatten and rebuild nested containers of arrays (lists, tuples, named tuples,
dicts, None), walk them, name their leaves. Foundation layer: imports nothing of ampscale.

Every adapter but JAX's flattens with :func:`flatten`; the JAX adapter uses ``jax.tree_util``,
which also knows registered pytrees (the registry hands it objects that are no array of any
backend, see :func:`ampscale.backends.flatten_tree`). Paths (``"['layer1']['w']"``) are only
computed when something must be named, e.g. in an error or an overflow report, so flattening
stays cheap on the hot path.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["TreeSpec", "flat_spec", "flatten", "holds_none", "iter_leaves", "leaf_paths", "unflatten"]

_LEAF = 0
_NONE = 1
_NONE_TYPE = type(None)
_CONTAINERS = (list, tuple, dict)


class TreeSpec:
    """The structure of a flattened tree; rebuild it with :func:`unflatten`."""

    __slots__ = ("children", "flat", "kind", "meta", "num_leaves")

    def __init__(self, kind: Any, meta: Any, children: list[Any] | None, num_leaves: int, flat: bool = False) -> None:
        self.kind = kind
        self.meta = meta
        self.children = children
        self.num_leaves = num_leaves
        self.flat = flat  # a list or tuple whose items are all leaves (children is then None)

    def __repr__(self) -> str:
        return f"TreeSpec({getattr(self.kind, '__name__', self.kind)}, leaves={self.num_leaves})"


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Return the leaves of ``tree`` in order, and a spec to rebuild it. ``None`` is no leaf."""
    kind = type(tree)
    # Fast path for the most common shape, a flat list or tuple of arrays: one pass over the
    # item types in C, then a check of the few distinct types.
    if kind is list or kind is tuple:
        for item_type in set(map(type, tree)):
            if item_type is _NONE_TYPE or issubclass(item_type, _CONTAINERS):
                break
        else:
            return list(tree), flat_spec(kind, len(tree))
    leaves: list[Any] = []
    spec = _flatten(tree, leaves)
    return leaves, spec


def iter_leaves(tree: Any) -> Iterator[Any]:
    """The leaves of ``tree`` one at a time, in :func:`flatten`'s order.

    A walk that goes only as far as its caller reads: finding a tree's backend from its first
    array costs the depth of the tree, not a flatten.
    """
    if tree is None:
        return
    if isinstance(tree, dict):
        for value in tree.values():
            yield from iter_leaves(value)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from iter_leaves(item)
    else:
        yield tree


def holds_none(tree: Any) -> bool:
    """Whether ``tree`` holds a ``None`` (for a tree without leaves: a gradient never computed)."""
    if tree is None:
        return True
    if isinstance(tree, dict):
        return any(holds_none(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(holds_none(item) for item in tree)
    return False


_flat_specs: dict[tuple[type, int], TreeSpec] = {}


def flat_spec(kind: type, size: int) -> TreeSpec:
    """The spec of a flat ``kind`` (list or tuple) of ``size`` leaves.

    Specs of flat lists and tuples are immutable: one is shared per (type, length).
    """
    spec = _flat_specs.get((kind, size))
    if spec is None:
        if len(_flat_specs) > 4096:
            _flat_specs.clear()
        spec = _flat_specs[kind, size] = TreeSpec(kind, None, None, size, flat=True)
    return spec


def _flatten(node: Any, leaves: list[Any]) -> Any:
    if node is None:
        return _NONE
    if isinstance(node, dict):
        keys = list(node)
        children = [_flatten(node[k], leaves) for k in keys]
        return TreeSpec(type(node), (keys, getattr(node, "default_factory", None)), children, 0)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return TreeSpec(type(node), "namedtuple", [_flatten(c, leaves) for c in node], 0)
    if isinstance(node, (list, tuple)):
        return TreeSpec(type(node), None, [_flatten(c, leaves) for c in node], 0)
    leaves.append(node)
    return _LEAF


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    """Rebuild the tree described by ``spec`` with ``leaves`` in place of its leaves."""
    if isinstance(spec, TreeSpec) and spec.flat:
        return leaves if spec.kind is list else spec.kind(leaves)
    iterator = iter(leaves)
    return _unflatten(spec, iterator)


def _unflatten(spec: Any, leaves: Any) -> Any:
    if spec is _LEAF:
        return next(leaves)
    if spec is _NONE:
        return None
    children = [_unflatten(c, leaves) for c in spec.children]
    kind = spec.kind
    if isinstance(spec.meta, tuple):  # a dict
        keys, default_factory = spec.meta
        items = zip(keys, children, strict=True)
        if kind is defaultdict:
            return defaultdict(default_factory, items)
        return kind(items)
    if spec.meta == "namedtuple":
        return kind(*children)
    return kind(children)


def leaf_paths(spec: Any) -> list[str]:
    """The path of every leaf of a spec from :func:`flatten`, e.g. ``"['blocks'][0]['w']"``."""
    paths: list[str] = []
    _paths(spec, "", paths)
    return paths


def _paths(spec: Any, prefix: str, out: list[str]) -> None:
    if spec is _LEAF:
        out.append(prefix or "<root>")
        return
    if spec is _NONE:
        return
    if spec.flat:
        out.extend(f"{prefix}[{index}]" for index in range(spec.num_leaves))
        return
    if isinstance(spec.meta, tuple):
        for key, child in zip(spec.meta[0], spec.children, strict=True):
            _paths(child, f"{prefix}[{key!r}]", out)
    elif spec.meta == "namedtuple":
        for name, child in zip(spec.kind._fields, spec.children, strict=True):
            _paths(child, f"{prefix}.{name}", out)
    else:
        for index, child in enumerate(spec.children):
            _paths(child, f"{prefix}[{index}]", out)
