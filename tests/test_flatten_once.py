"""Each tree a call is given is flattened once, and its backend found once (``flatten_tree``).

Every flatten of ampscale's is counted (``ampscale._tree.flatten`` and every adapter's
``flatten``; the outermost call only, as an adapter's flatten may call ``_tree``'s), keyed by
the tree it was given, over the public calls that take trees, on every installed backend,
with a scaler whose backend is already known and with a fresh one that must find it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ampscale
from ampscale import _tree
from ampscale import backends as registry
from ampscale.backends._base import Backend


def _adapter_classes(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _adapter_classes(sub)


@contextlib.contextmanager
def counted(monkeypatch: pytest.MonkeyPatch, trees: dict[str, Any]) -> Iterator[collections.Counter[str]]:
    """Count the flattens of each of ``trees`` (by name) and the backend detections."""
    names = {id(tree): name for name, tree in trees.items()}
    counts: collections.Counter[str] = collections.Counter()
    depth = [0]

    def wrap(flatten: Any, tree_position: int) -> Any:
        @functools.wraps(flatten)
        def counting(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[names.get(id(args[tree_position]), "other trees")] += 1
            depth[0] += 1
            try:
                return flatten(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counting

    monkeypatch.setattr(_tree, "flatten", wrap(_tree.flatten, 0))
    for cls in _adapter_classes(Backend):
        if "flatten" in cls.__dict__:
            monkeypatch.setattr(cls, "flatten", wrap(cls.__dict__["flatten"], 1))
    detect = registry._first_backend

    def detecting(tree: Any) -> Any:
        counts["detections"] += 1
        return detect(tree)

    monkeypatch.setattr(registry, "_first_backend", detecting)
    yield counts


def _trees(fw: Any) -> dict[str, Any]:
    # nested, so no flat-list fast path stands in for the general one
    def leaf(*values: float) -> Any:
        return fw.array(np.array(values, np.float32))

    return {
        "params": {"w": [leaf(1.0, 2.0), leaf(3.0)], "b": leaf(0.5)},
        "grads": {"w": [leaf(4.0, 8.0), leaf(2.0)], "b": leaf(1.0)},
        "opt_state": {"m": [leaf(0.0, 0.0), leaf(0.0)], "v": leaf(0.0)},
        "loss": fw.array(np.array(2.0, np.float32)),
    }


def sgd(params: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
    new = {
        "w": [p - 0.1 * g for p, g in zip(params["w"], grads["w"], strict=True)],
        "b": params["b"] - 0.1 * grads["b"],
    }
    state = {"m": [m + g for m, g in zip(opt_state["m"], grads["w"], strict=True)], "v": opt_state["v"] + 1.0}
    return new, state


def sgd_in_place(params: Any, grads: Any, opt_state: Any, finite: Any) -> tuple[Any, Any]:
    ampscale.masked_add_(finite, [*params["w"], params["b"]], [*grads["w"], grads["b"]], alpha=-0.1)
    return params, opt_state


@pytest.mark.parametrize("fresh", [False, True], ids=["backend known", "backend found"])
@pytest.mark.parametrize("call", ["unscale", "step", "step again", "step in place"])
def test_a_scaler_call_flattens_each_tree_once(fw: Any, call: str, fresh: bool, monkeypatch) -> None:
    writable = registry.get_backend(fw.backend).mutable_arrays
    if call == "step in place" and not writable:
        pytest.skip("arrays that cannot be written")
    trees = _trees(fw)
    scaler = ampscale.create_scaler() if fresh else ampscale.create_scaler(backend=fw.backend)
    if call == "step again":  # sgd is known by now: no run on copies first
        scaler.step(sgd, *(_trees(fw)[name] for name in ("params", "grads", "opt_state")))
    with counted(monkeypatch, trees) as counts:
        if call == "unscale":
            scaler.unscale(trees["grads"], loss=trees["loss"])
        else:
            update = sgd_in_place if call == "step in place" else sgd
            scaler.step(
                update,
                trees["params"],
                trees["grads"],
                trees["opt_state"],
                loss=trees["loss"],
                in_place=call == "step in place",
            )
    expected = {"grads": 1}
    if call in ("step", "step again") and writable:
        expected |= {"params": 1, "opt_state": 1}  # the watch for in-place writes, and the select
    # (the masked_add_ inside sgd_in_place finds its backend too: a call of its own)
    detections = int(fresh) + (call == "step in place")
    if detections:
        expected["detections"] = detections
    assert {k: v for k, v in counts.items() if k != "other trees"} == expected


@pytest.mark.parametrize("call", ["all_finite", "diagnose", "masked_add_", "masked_copy_"])
def test_a_function_flattens_each_tree_once(fw: Any, call: str, monkeypatch) -> None:
    if call.startswith("masked") and not registry.get_backend(fw.backend).mutable_arrays:
        pytest.skip("arrays that cannot be written")
    trees = _trees(fw)
    with counted(monkeypatch, trees) as counts:
        if call == "all_finite":
            ampscale.all_finite(trees["grads"])
        elif call == "diagnose":
            ampscale.diagnose(trees["grads"])
        else:
            getattr(ampscale, call)(True, trees["params"], trees["grads"])
    expected = {"grads": 1, "detections": 1}
    if call.startswith("masked"):
        expected["params"] = 1
    assert {k: v for k, v in counts.items() if k != "other trees"} == expected
