"""The host transition, compiled: :func:`ampscale._core.transition` traced into one function.

Host-resident backends (NumPy, PyTorch on the CPU) run the state machine on Python scalars.
Interpreted through :class:`~ampscale._ops.HostOps`, one step costs some fifty method calls.
:func:`compile_host_transition` runs the very same ``transition`` once per configuration on
symbolic values, records the expression graph it builds (the configuration's static branches
already taken), and turns it into the source of a single Python function with the same
semantics as ``HostOps``: a conditional expression for ``where``, inline saturating
arithmetic, and the memoised ``grow``/``shrink`` of the ``HostOps`` it was compiled for,
evaluated only on the branch that needs them. The state machine is still written once; this
is only a faster way to run it on the host. The tests compare the two on every preset.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from ampscale._config import INT32_MAX, INT32_MIN
from ampscale._core import ScalerState, transition

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale._config import ScalerConfig
    from ampscale._ops import HostOps

__all__ = ["compile_host_transition"]


class _Node:
    """One value of the traced transition: an expression over earlier nodes.

    ``template`` is a format string over the operands' expressions; operands that a template
    uses more than once (``repeats``) are always bound to a local first, so no expression is
    evaluated twice. Comparisons and ``%`` build nodes too, as ``transition`` writes them with
    Python operators.
    """

    __slots__ = ("name", "operands", "template", "uses")

    def __init__(self, template: str, *operands: _Node, repeats: bool = False) -> None:
        self.template = template
        self.operands = operands
        self.uses = 0
        self.name: str | None = None
        for operand in operands:
            operand.uses += 2 if repeats else 1

    __hash__ = object.__hash__

    def _compare(self, op: str, other: Any) -> _Node:
        return _Node(f"({{}} {op} {{}})", self, _lift(other))

    def __eq__(self, other: object) -> _Node:  # type: ignore[override]
        return self._compare("==", other)

    def __ne__(self, other: object) -> _Node:  # type: ignore[override]
        return self._compare("!=", other)

    def __lt__(self, other: Any) -> _Node:
        return self._compare("<", other)

    def __le__(self, other: Any) -> _Node:
        return self._compare("<=", other)

    def __gt__(self, other: Any) -> _Node:
        return self._compare(">", other)

    def __ge__(self, other: Any) -> _Node:
        return self._compare(">=", other)

    def __mod__(self, other: Any) -> _Node:
        return self._compare("%", other)

    def __bool__(self) -> bool:
        raise TypeError(
            "the transition branched on a traced value; it must use ops.where (this is a bug in "
            "ampscale._core.transition)"
        )


def _literal(value: Any) -> _Node:
    if type(value) not in (bool, int):
        raise TypeError(f"cannot inline a {type(value).__name__} constant {value!r}")
    node = _Node(repr(value))
    node.name = repr(value)  # a literal: never bound, free to repeat
    return node


def _lift(value: Any) -> _Node:
    return value if isinstance(value, _Node) else _literal(value)


class _TraceOps:
    """The operations of :class:`~ampscale._ops.HostOps`, recorded instead of computed."""

    def __init__(self) -> None:
        self.floats: dict[float, str] = {}

    def as_bool(self, value: _Node) -> _Node:
        return _Node("bool({})", value)

    def logical_not(self, a: _Node) -> _Node:
        return _Node("(not {})", a)

    def logical_and(self, a: _Node, b: _Node) -> _Node:
        return _Node("({} and {})", a, b)

    def logical_or(self, a: _Node, b: _Node) -> _Node:
        return _Node("({} or {})", a, b)

    def where(self, condition: _Node, a: _Node, b: _Node) -> _Node:
        return _Node("({1} if {0} else {2})", condition, _lift(a), _lift(b))

    def int32(self, value: int) -> _Node:
        return _literal(int(value))

    def false(self) -> _Node:
        return _literal(False)

    def saturating_increment(self, value: _Node) -> _Node:
        return _Node(f"({{0}} + 1 if {{0}} < {INT32_MAX} else {{0}})", value, repeats=True)

    def saturating_decrement(self, value: _Node) -> _Node:
        return _Node(f"({{0}} - 1 if {{0}} > {INT32_MIN} else {{0}})", value, repeats=True)

    def saturating_add(self, value: _Node, flag: _Node) -> _Node:
        return _Node(f"({{0}} + 1 if {{1}} and {{0}} < {INT32_MAX} else {{0}})", value, flag, repeats=True)

    def scale_constant(self, value: float) -> _Node:
        # floats go through the function's globals: exact for inf, nan and every bit pattern
        name = self.floats.setdefault(float(value), f"_k{len(self.floats)}")
        node = _Node(name)
        node.name = name
        return node

    def grow(self, scale: _Node) -> _Node:
        return _Node("_grow({})", scale)

    def shrink(self, scale: _Node) -> _Node:
        return _Node("_shrink({})", scale)


def _emit(outputs: list[_Node]) -> tuple[list[str], list[str]]:
    """Statements binding the shared or repeated nodes to locals, and the outputs' expressions."""
    order: list[_Node] = []
    seen: set[int] = set()

    def visit(node: _Node) -> None:  # post-order: operands before the node
        if id(node) in seen:
            return
        seen.add(id(node))
        for operand in node.operands:
            visit(operand)
        order.append(node)

    for node in outputs:
        node.uses += 1
        visit(node)

    def expression(node: _Node) -> str:
        if node.name is not None:
            return node.name
        return node.template.format(*(expression(operand) for operand in node.operands))

    counter = itertools.count()
    lines: list[str] = []
    for node in order:
        if node.name is None and node.uses > 1:
            code = expression(node)
            node.name = f"_t{next(counter)}"
            lines.append(f"    {node.name} = {code}")
    return lines, [expression(node) for node in outputs]


def compile_host_transition(
    config: ScalerConfig, ops: HostOps
) -> Callable[[ScalerState, bool, bool], tuple[ScalerState, bool]]:
    """Return ``f(values, finite, loss_finite) -> (next_values, floor_event)``.

    ``f`` equals ``transition(config, values, finite, loss_finite, ops)`` for a state of Python
    scalars and Python-bool flags; its source is kept as ``f.source``.
    """
    fields = ScalerState._fields
    inputs = ScalerState(*(_Node(name) for name in fields))
    finite, loss_finite = _Node("finite"), _Node("loss_finite")
    for node in (*inputs, finite, loss_finite):
        node.name = node.template  # arguments: never rebound
    trace = _TraceOps()
    state, floor_event = transition(config, inputs, finite, loss_finite, trace)  # type: ignore[arg-type]
    lines, returned = _emit([_lift(value) for value in (*state, floor_event)])
    source = "\n".join(
        [
            "def _transition(_values, finite, loss_finite):",
            f"    {', '.join(fields)}, = _values",
            *lines,
            f"    return _new(_State, ({', '.join(returned[:-1])},)), {returned[-1]}",
            "",
        ]
    )
    namespace: dict[str, Any] = {
        "_new": tuple.__new__,
        "_State": ScalerState,
        "_grow": ops.grow,
        "_shrink": ops.shrink,
        **{name: value for value, name in trace.floats.items()},
    }
    exec(compile(source, f"<ampscale transition, preset {config.preset}>", "exec"), namespace)
    function = namespace["_transition"]
    function.source = source
    return function  # type: ignore[no-any-return]
