"""``Scaler.step``'s checks of ``update_fn``: no update written in place reaches the parameters.

Scaler layer; the arrays are watched through the adapter protocol.

On a device (CuPy, torch on a GPU, array-API namespaces) ``step`` calls ``update_fn`` before the
overflow flag is known and keeps the old arrays, leaf by leaf, where the step overflowed; an
``update_fn`` that writes into the arrays it was given would already have written the
overflowed step. Two checks refuse it (:class:`ampscale.InPlaceUpdateError`):

* **before the step**, the first time a given ``update_fn`` is seen: it is called once on
  copies of the parameters, the optimizer state and the (still scaled) gradients, and the
  copies are watched: NumPy arrays are made read-only (the write itself raises), torch's
  version counters count every in-place write, and elsewhere (CuPy, other namespaces) the
  copies are compared bit for bit with the originals afterwards (one host read); on backends
  that cannot see writes, returning a copy it was given is refused too. A refusal here comes
  before anything changes: parameters, optimizer state, gradients and scaler are untouched.
  A clean verdict is remembered for the function's code, the objects its closure refers to
  (its cells) and, for a bound method, its instance, so later steps skip the check.
* **on every step**, around the real call: the same watch on the real arrays. A write found
  here is refused too, but on the device path it has happened (an ``update_fn`` whose
  behaviour changed after its first call: a branch on the step number, on its data, on a
  global).

What no check sees: writes into arrays that were not passed to ``update_fn`` (a closure over
the parameters, a torch optimizer stepping its own tensors), and, on backends that compare
bits, a write that leaves every bit as it was on the copies (harmless on that call).
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from ampscale._errors import InPlaceUpdateError, PerformanceWarning

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale.backends._base import Backend

__all__ = ["Watch", "check_before_the_step", "checked_update", "watch"]


class _Identity(NamedTuple):
    """What decides what an ``update_fn`` does, as far as ampscale can tell."""

    code: Any  # the function's code object
    cells: tuple[Any, ...]  # its closure's cells (the variables it refers to, not their values)
    owner: Any  # a bound method's instance, or a callable object; else None


#: (backend name, code) -> (cells, weak reference to the owner or None) of the last clean verdict
_CHECKED: dict[tuple[str, Any], tuple[tuple[Any, ...], Any]] = {}
#: checks again of one code with new cells or a new owner, in a row (a step that needed none
#: ends the row): a function made anew before every step, not once per training run
_RECHECKS: dict[Any, int] = {}
#: rechecks in a row after which a PerformanceWarning says how to avoid them
_RECHECKS_BEFORE_WARNING = 3


def _identity(update_fn: Any) -> _Identity | None:
    """``update_fn``'s code, closure cells and instance; ``None`` where it has no Python code
    (a builtin), which is then checked at every step."""
    fn = update_fn
    while isinstance(fn, functools.partial):  # judged by the function it wraps
        fn = fn.func
    owner = None
    if isinstance(fn, types.MethodType):
        owner, fn = fn.__self__, fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its class's __call__, for this instance
        call = next((c.__dict__["__call__"] for c in type(fn).__mro__ if "__call__" in c.__dict__), None)
        code = getattr(call, "__code__", None)
        if code is None:
            return None
        owner, fn = fn, call
    return _Identity(code, tuple(getattr(fn, "__closure__", None) or ()), owner)


def _known(backend: Backend, identity: _Identity) -> bool:
    entry = _CHECKED.get((backend.name, identity.code))
    if entry is None:
        return False
    cells, owner_ref = entry
    owner = None if owner_ref is None else owner_ref()
    return (
        owner is identity.owner
        and len(cells) == len(identity.cells)
        and all(a is b for a, b in zip(cells, identity.cells, strict=True))
    )


def _remember(backend: Backend, identity: _Identity | None) -> None:
    if identity is None:
        return
    owner_ref = None
    if identity.owner is not None:
        try:
            owner_ref = weakref.ref(identity.owner)
        except TypeError:  # no weak reference to it: checked at every step
            return
    key = (backend.name, identity.code)
    if key in _CHECKED:
        count = _RECHECKS[identity.code] = _RECHECKS.get(identity.code, 0) + 1
        if count == _RECHECKS_BEFORE_WARNING:
            warnings.warn(
                f"Scaler.step checked update_fn {identity.code.co_name!r} ({identity.code.co_filename}:"
                f"{identity.code.co_firstlineno}) again: it is made anew (a closure over new variables, or "
                "a method of a new object) before each step, and each new one is run once on copies of the "
                "parameters, optimizer state and gradients before its first step. Make it once, outside "
                "the training loop",
                PerformanceWarning,
                stacklevel=4,
            )
    # the cells are kept (only the last ones per code): a weak reference to them is impossible
    _CHECKED[key] = (identity.cells, owner_ref)


#: ``(arrays, flat)`` of :func:`watch`: the arrays ``update_fn`` must not write, and ``params``
#: and ``opt_state`` as the backend flattened them (``((leaves, spec), (leaves, spec))``)
Watch: TypeAlias = "tuple[list[Any], tuple[tuple[list[Any], Any], tuple[list[Any], Any]]]"


def watch(backend: Backend, params: Any, opt_state: Any) -> Watch:
    """The arrays ``update_fn`` must not write, every leaf of ``params`` and ``opt_state`` the
    backend owns, with the two trees flattened (once: ``Scaler.step`` hands them on to its select).
    Their names are made only for an error (:func:`_names`)."""
    flat = (backend.flatten(params), backend.flatten(opt_state))
    owns = backend.owns
    return [leaf for leaves, _ in flat for leaf in leaves if owns(leaf)], flat


def _names(backend: Backend, flat: tuple[tuple[list[Any], Any], tuple[list[Any], Any]]) -> list[str]:
    """A readable path for each watched array, in :func:`watch`'s order (``params[0]``,
    ``opt_state['m'][1]``)."""
    names: list[str] = []
    for prefix, (leaves, spec) in zip(("params", "opt_state"), flat, strict=True):
        paths = backend.leaf_paths(spec) if leaves else []
        names += [
            prefix + ("" if path == "<root>" else path)
            for path, leaf in zip(paths, leaves, strict=True)
            if backend.owns(leaf)
        ]
    return names


def check_before_the_step(
    update_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    backend: Backend,
    params: Any,
    grads: Any,
    opt_state: Any,
    flat_grads: tuple[list[Any], Any] | None = None,
) -> Watch | None:
    """Run ``update_fn`` once on copies the first time it is seen, and refuse it
    (:class:`InPlaceUpdateError`) if it writes into the copies of ``params`` or ``opt_state``
    (or, where writes cannot be seen, returns them). Nothing real is read or written but the
    arrays' values, copied. ``flat_grads``: ``grads`` as the caller flattened it already.

    Returns the :func:`watch` of ``params`` and ``opt_state`` it made, for the real call
    (``None`` where ``update_fn`` is known and nothing was run): each tree is flattened once.
    """
    identity = _identity(update_fn)
    if identity is not None and _known(backend, identity):
        if _RECHECKS:
            _RECHECKS.pop(identity.code, None)
        return None
    watched = watch(backend, params, opt_state)
    arrays, flat = watched
    copies: dict[int, Any] = {}

    def copied(flat: tuple[list[Any], Any]) -> Any:
        leaves, spec = flat
        out = []
        for leaf in leaves:
            if backend.owns(leaf):
                copy = copies.get(id(leaf))
                if copy is None:  # one copy per array: a leaf given twice stays one array
                    copy = copies[id(leaf)] = backend.copy_leaf(leaf)
                out.append(copy)
            else:
                out.append(leaf)
        return backend.unflatten(spec, out)

    params_copy, opt_state_copy = copied(flat[0]), copied(flat[1])
    grads_copy = copied(backend.flatten(grads) if flat_grads is None else flat_grads)
    guarded = [copies[id(leaf)] for leaf in arrays]
    with backend.guard_writes(guarded) as guard:
        try:
            out = update_fn(params_copy, grads_copy, opt_state_copy)
        except Exception as exc:
            if guard.refused(exc):
                raise InPlaceUpdateError(_message(backend, "wrote into one of", flat, [], before=True)) from exc
            add_note = getattr(exc, "add_note", None)
            if add_note is not None:
                add_note(
                    "ampscale: update_fn raised while Scaler.step ran it once on copies of the parameters, "
                    "optimizer state and gradients (its first call: the check for updates written in place); "
                    "nothing was changed, the scaler was not updated"
                )
            raise
    written = guard.written()
    if written is None:  # the backend cannot see writes: compare the copies with the originals
        written = [i for i, leaf in enumerate(arrays) if not backend.same_bits(leaf, guarded[i])]
    if written:
        raise InPlaceUpdateError(_message(backend, "wrote into", flat, written, before=True))
    if not guard.exact:
        returned = _returned(backend, out, guarded)
        if returned:
            raise InPlaceUpdateError(_message(backend, "returned", flat, returned, before=True))
    _remember(backend, identity)
    return watched


def _returned(backend: Backend, out: Any, watched: list[Any]) -> list[int]:
    """The indices of the watched arrays that ``update_fn``'s result holds themselves."""
    given = {id(leaf): i for i, leaf in enumerate(watched)}
    try:
        leaves = backend.flatten(out)[0]
    except Exception:  # not a tree of this backend's: select_tree will say what is wrong
        return []
    return sorted({given[id(x)] for x in leaves if id(x) in given})


def checked_update(
    update_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    backend: Backend,
    params: Any,
    opt_state: Any,
    watched: Watch | None = None,
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """``update_fn``, refusing (:class:`InPlaceUpdateError`) a call that writes into ``params``
    or ``opt_state``, or, where the backend cannot see writes, returns them: the watch on every
    real call, after :func:`check_before_the_step`. ``watched``: :func:`watch`'s result where
    the caller has it."""
    guarded, flat = watch(backend, params, opt_state) if watched is None else watched

    def run(p: Any, g: Any, s: Any) -> tuple[Any, Any]:
        with backend.guard_writes(guarded) as guard:
            try:
                out = update_fn(p, g, s)
            except Exception as exc:
                if guard.refused(exc):
                    raise InPlaceUpdateError(_message(backend, "wrote into one of", flat, [])) from exc
                raise
        written = guard.written()
        if written:
            raise InPlaceUpdateError(_message(backend, "wrote into", flat, written))
        if written is None and guarded:
            returned = _returned(backend, out, guarded)
            if returned:
                raise InPlaceUpdateError(_message(backend, "returned", flat, returned))
        return out  # type: ignore[no-any-return]

    return run


def _message(
    backend: Backend,
    what: str,
    flat: tuple[tuple[list[Any], Any], tuple[list[Any], Any]],
    indices: list[int],
    before: bool = False,
) -> str:
    names = _names(backend, flat)
    shown = [names[i] for i in indices[:4]] + (["..."] if len(indices) > 4 else [])
    which = ", ".join(shown) if shown else f"its arrays ({', '.join(names[:4])}, ...)"
    if what == "returned":
        head = (
            f"update_fn returned {which}, the arrays it was given: on the {backend.name} backend ampscale "
            "cannot watch writes into them on every step, and on a step that overflowed the select "
            "keeps the old arrays, which an in-place update has already changed"
        )
    else:
        head = (
            f"update_fn {what} {which} in place: Scaler.step computes the update before a device's "
            "overflow flag is known and keeps the old arrays where the step overflowed, so an in-place "
            f"update would already hold the overflowed step; it is refused on every backend ({backend.name} "
            "here) so that a test on the CPU finds it"
        )
    if before:
        state = (
            "Found when update_fn first ran, on copies, before the step: nothing was changed (parameters, "
            "optimizer state, gradients and scaler are as they were)"
        )
    else:
        # the real call, after a first one on copies that wrote nothing: update_fn changed
        if what == "wrote into one of":
            state = "The write itself was refused: the parameters and optimizer state are as they were"
        else:
            state = "The arrays named may hold what this call wrote (its first call, on copies, wrote nothing)"
        if backend.in_place:
            state += "; the gradients had been unscaled in place"
        state += "; the scaler was not updated"
    return (
        f"{head}. Return new arrays (a functional update; a copy for a leaf it leaves as it is), or "
        "update in place with the flag: scaler.step(update_fn, ..., in_place=True) passes it as "
        "update_fn's fourth argument, for ampscale.masked_add_ and ampscale.masked_copy_. "
        f"{state}"
    )
