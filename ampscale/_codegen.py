"""The state transition, traced once per configuration and emitted as Python or as C.

Code generator layer: above the state machine it traces, below everything that runs it.

:func:`ampscale._core.transition` is the one definition of the state machine. Run on symbolic
values (:class:`_TraceOps`), it records the expression graph it builds for one configuration,
with the configuration's static branches already taken. Two emitters turn that graph into code:

* :func:`python_transition`: one straight-line Python function with the semantics of
  :class:`~ampscale._ops.HostOps` (a conditional expression for ``where``, inline saturating
  arithmetic, and the memoised ``grow``/``shrink`` it is given, evaluated only on the branch
  that needs them). Host backends (NumPy, PyTorch on the CPU) run it every step.
* :func:`c_transition`: a C function over the packed device state (:func:`state_dtype`), for
  the CUDA kernels and for the host compiler alike. C is not Python, and the emitter says so
  explicitly: ``%`` is emitted as a floor-mod (C truncates; trackers restored from a
  checkpoint can be negative); grow and shrink are computed in double and rounded once to the
  scale's dtype, as ``HostOps`` does; a double that is out of float32's range is narrowed to
  inf by an explicit comparison (the C conversion would be undefined); constants are hex
  float literals (exact, no decimal round trip) and ``INT32_MIN`` is written as
  ``(-2147483647 - 1)``; no header is included, so NVRTC needs no CUDA include path.

The C must be compiled without contraction to FMA and without flush-to-zero (``--fmad=false
--ftz=false`` for NVRTC and nvcc). The scale itself is never subnormal (its floor is at least
the dtype's smallest normal value), so flush-to-zero cannot change the transition, which the
tests check; the flags keep the emitted C exact whatever it computes. The tests compile the C
with the host's compiler and
compare it bit for bit with the Python transition, field by field, on every preset and mode.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ampscale._config import INT32_MAX, INT32_MIN
from ampscale._core import ScalerState, transition

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale._config import ScalerConfig

__all__ = ["STATE_BYTES", "c_transition", "python_transition", "state_dtype"]

#: bytes of one packed state (see :func:`state_dtype`)
STATE_BYTES = 80

_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def state_dtype(scale_dtype: str) -> np.dtype:
    """The packed device state: every field, the next step's ``inv_scale`` and scratch.

    One 80-byte record (``struct AmpscaleState`` in the emitted C): the two scales in 8-byte
    slots (float32 or float64), the ten int32 fields, ``inv_scale`` (float32, ``1 / scale``
    rounded once, read by the next step's unscale), the flags of the step that produced it
    (``floor_event``, ``finite``, ``loss_finite``, one byte each), and scratch that the next
    step's check writes (``found_inf`` and ``loss_found_inf``, float32 0 or 1, and the
    ``ticket`` of the last-block pattern), zero when the record is written.
    """
    scale = "<f8" if scale_dtype == "float64" else "<f4"
    names = ["scale", "last_scale", *(f for f in ScalerState._fields if f not in ("scale", "last_scale"))]
    formats: list[str] = [scale, scale] + ["<i4"] * 10
    offsets = [0, 8] + [16 + 4 * i for i in range(10)]
    names += ["inv_scale", "floor_event", "finite", "loss_finite", "found_inf", "loss_found_inf", "ticket"]
    formats += ["<f4", "u1", "u1", "u1", "<f4", "<f4", "<u4"]
    offsets += [56, 60, 61, 62, 64, 68, 72]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": STATE_BYTES})


# ------------------------------------------------------------------------------ the trace


class _Node:
    """One value of the traced transition: an operation over earlier nodes.

    ``kind`` is ``"bool"``, ``"int"`` (int32) or ``"scale"``. Comparisons and ``%`` build nodes
    too, as ``transition`` writes them with Python operators. ``uses`` counts how often the
    emitted code refers to the node (an operand that an emitter repeats counts twice), so an
    emitter binds a node used more than once to a local and evaluates no expression twice.
    """

    __slots__ = ("kind", "name", "op", "operands", "uses", "value")

    def __init__(self, op: str, kind: str, *operands: _Node, value: Any = None, repeats: bool = False) -> None:
        self.op = op
        self.kind = kind
        self.operands = operands
        self.value = value
        self.uses = 0
        self.name: str | None = None
        for operand in operands:
            operand.uses += 2 if repeats else 1

    __hash__ = object.__hash__

    def _compare(self, op: str, other: Any) -> _Node:
        return _Node(op, "bool", self, _lift(other))

    def __eq__(self, other: object) -> _Node:  # type: ignore[override]
        return self._compare("eq", other)

    def __ne__(self, other: object) -> _Node:  # type: ignore[override]
        return self._compare("ne", other)

    def __lt__(self, other: Any) -> _Node:
        return self._compare("lt", other)

    def __le__(self, other: Any) -> _Node:
        return self._compare("le", other)

    def __gt__(self, other: Any) -> _Node:
        return self._compare("gt", other)

    def __ge__(self, other: Any) -> _Node:
        return self._compare("ge", other)

    def __mod__(self, other: Any) -> _Node:
        return _Node("mod", "int", self, _lift(other))

    def __bool__(self) -> bool:
        raise TypeError(
            "the transition branched on a traced value; it must use ops.where (this is a bug in "
            "ampscale._core.transition)"
        )


def _literal(value: Any) -> _Node:
    if type(value) not in (bool, int):
        raise TypeError(f"cannot inline a {type(value).__name__} constant {value!r}")
    return _Node("literal", "bool" if type(value) is bool else "int", value=value)


def _lift(value: Any) -> _Node:
    return value if isinstance(value, _Node) else _literal(value)


class _TraceOps:
    """The operations of :class:`~ampscale._ops.HostOps`, recorded instead of computed.

    With ``fold``, a boolean operation on a literal operand is computed on the spot (``True
    and x`` is ``x``, ``where(False, a, b)`` is ``b``, ...): a trace whose flags are literals
    (:func:`python_transition`'s ``split_ok``) keeps only what those flags leave to compute.
    Without it every operation is recorded as written (the emitted code of the general
    transition does not depend on this pass).
    """

    def __init__(self, fold: bool = False) -> None:
        self.fold = fold

    def _known(self, node: _Node) -> bool | None:
        """``node``'s value, if folding and it is a literal bool; else ``None``."""
        if self.fold and node.op == "literal" and type(node.value) is bool:
            return bool(node.value)
        return None

    def as_bool(self, value: _Node) -> _Node:
        if self._known(value) is not None:
            return value
        return _Node("bool", "bool", value)

    def logical_not(self, a: _Node) -> _Node:
        known = self._known(a)
        if known is not None:
            return _literal(not known)
        return _Node("not", "bool", a)

    def logical_and(self, a: _Node, b: _Node) -> _Node:
        for this, other in ((a, b), (b, a)):
            known = self._known(this)
            if known is not None:
                return other if known else this
        return _Node("and", "bool", a, b)

    def logical_or(self, a: _Node, b: _Node) -> _Node:
        for this, other in ((a, b), (b, a)):
            known = self._known(this)
            if known is not None:
                return this if known else other
        return _Node("or", "bool", a, b)

    def where(self, condition: _Node, a: Any, b: Any) -> _Node:
        first, second = _lift(a), _lift(b)
        known = self._known(condition)
        if known is not None:
            return first if known else second
        return _Node("where", first.kind, condition, first, second)

    def int32(self, value: int) -> _Node:
        return _literal(int(value))

    def false(self) -> _Node:
        return _literal(False)

    def saturating_increment(self, value: _Node) -> _Node:
        return _Node("increment", "int", value, repeats=True)

    def saturating_decrement(self, value: _Node) -> _Node:
        return _Node("decrement", "int", value, repeats=True)

    def saturating_add(self, value: _Node, flag: _Node) -> _Node:
        known = self._known(flag)
        if known is not None:
            return self.saturating_increment(value) if known else value
        return _Node("add_flag", "int", value, flag, repeats=True)

    def scale_constant(self, value: float) -> _Node:
        return _Node("constant", "scale", value=float(value))

    def grow(self, scale: _Node) -> _Node:
        return _Node("grow", "scale", scale)

    def shrink(self, scale: _Node) -> _Node:
        return _Node("shrink", "scale", scale)


_FLAG_INPUTS = ("finite", "loss_finite")


def _trace(config: ScalerConfig, flags: tuple[bool, bool] | None = None) -> tuple[ScalerState, list[_Node]]:
    """The transition for ``config`` as nodes: the input nodes and the outputs (next state's
    fields, then the floor event).

    ``flags``: ``(finite, loss_finite)`` as constants, folded into the trace; ``None``: both
    are inputs.
    """
    inputs = ScalerState(
        *(_Node("input", "scale" if f in ("scale", "last_scale") else "int") for f in ScalerState._fields)
    )
    for node, name in zip(inputs, ScalerState._fields, strict=True):
        node.name = name  # arguments: never rebound
    if flags is None:
        finite, loss_finite = _Node("input", "bool"), _Node("input", "bool")
        finite.name, loss_finite.name = _FLAG_INPUTS
    else:
        finite, loss_finite = _literal(flags[0]), _literal(flags[1])
    ops = _TraceOps(fold=flags is not None)
    state, floor_event = transition(config, inputs, finite, loss_finite, ops)  # type: ignore[arg-type]
    return inputs, [_lift(value) for value in (*state, floor_event)]


def _emit(
    outputs: list[_Node], render: Callable[[_Node, list[str]], str]
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """The locals to bind, in order, as ``(name, kind, expression)``, and the outputs' expressions.

    ``render(node, operand_expressions)`` writes one node in the target language; it is called
    once per node and may name a node (``node.name``) to stop it from being bound.
    """
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

    code: dict[int, str] = {}

    def expression(node: _Node) -> str:
        if node.name is not None:
            return node.name
        return code[id(node)]

    counter = itertools.count()
    bound: list[tuple[str, str, str]] = []
    for node in order:
        if node.name is not None:
            continue
        code[id(node)] = render(node, [expression(operand) for operand in node.operands])
        if node.name is None and node.uses > 1:
            node.name = f"_t{next(counter)}"
            bound.append((node.name, node.kind, code[id(node)]))
    return bound, [expression(node) for node in outputs]


# ------------------------------------------------------------------------------ Python

#: how :func:`python_transition` writes the operations every traced transition shares (the
#: FP8 transition's emitter, :mod:`ampscale.fp8._codegen`, writes them the same way)
PYTHON_TEMPLATES: dict[str, str] = {
    "bool": "bool({0})",
    "not": "(not {0})",
    "and": "({0} and {1})",
    "or": "({0} or {1})",
    "where": "({1} if {0} else {2})",
    "mod": "({0} % {1})",
    "increment": f"({{0}} + 1 if {{0}} < {INT32_MAX} else {{0}})",
    "decrement": f"({{0}} - 1 if {{0}} > {INT32_MIN} else {{0}})",
    "add_flag": f"({{0}} + 1 if {{1}} and {{0}} < {INT32_MAX} else {{0}})",
}


def python_transition(
    config: ScalerConfig, grow: Callable[[Any], Any], shrink: Callable[[Any], Any]
) -> Callable[[ScalerState, bool, bool], tuple[ScalerState, bool]]:
    """Return ``f(values, finite, loss_finite) -> (next_values, floor_event)``.

    ``f`` equals ``transition(config, values, finite, loss_finite, ops)`` for a
    :class:`~ampscale._ops.HostOps` ``ops`` whose ``grow`` and ``shrink`` are the ones given,
    for a state of Python scalars and Python-bool flags; its source is kept as ``f.source``.
    """
    floats: dict[float, str] = {}

    def render(node: _Node, args: list[str]) -> str:
        op = node.op
        if op == "literal":
            node.name = repr(node.value)  # free to repeat
            return node.name
        if op == "constant":
            # floats go through the function's globals: exact for inf, nan and every bit pattern
            node.name = floats.setdefault(node.value, f"_k{len(floats)}")
            return node.name
        if op in _COMPARISONS:
            return f"({args[0]} {_COMPARISONS[op]} {args[1]})"
        templates = {**PYTHON_TEMPLATES, "grow": "_grow({0})", "shrink": "_shrink({0})"}
        return templates[op].format(*args)

    fields = ScalerState._fields
    _inputs, outputs = _trace(config)
    bound, returned = _emit(outputs, render)
    body = [f"    {name} = {code}" for name, _kind, code in bound]
    source = "\n".join(
        [
            "def _transition(_values, finite, loss_finite):",
            f"    {', '.join(fields)}, = _values",
            *body,
            f"    return _new(_State, ({', '.join(returned[:-1])},)), {returned[-1]}",
            "",
        ]
    )

    def split_function(name: str, flags: str, lines: list[str], results: list[str]) -> str:
        """A function of the scale, the tracker and the other fields as a tuple (a caller that
        keeps those two in tensors builds and slices no 12-tuple)."""
        return "\n".join(
            [
                f"def {name}({fields[0]}, {fields[1]}, _rest{flags}):",
                f"    {', '.join(fields[2:])}, = _rest",
                *lines,
                f"    return {results[0]}, {results[1]}, ({', '.join(results[2:-1])},), {results[-1]}",
                "",
            ]
        )

    split_source = split_function("_split", ", finite, loss_finite", body, returned)
    # and the step that training takes almost every time, gradients and loss finite: the
    # transition traced with those two flags folded in, only what they leave to compute
    _inputs, ok_outputs = _trace(config, flags=(True, True))
    ok_bound, ok_returned = _emit(ok_outputs, render)
    ok_body = [f"    {name} = {code}" for name, _kind, code in ok_bound]
    split_ok_source = split_function("_split_ok", "", ok_body, ok_returned)
    namespace: dict[str, Any] = {
        "_new": tuple.__new__,
        "_State": ScalerState,
        "_grow": grow,
        "_shrink": shrink,
        **{name: value for value, name in floats.items()},
    }
    for text, label in ((source, ""), (split_source, ", split"), (split_ok_source, ", split, finite step")):
        exec(compile(text, f"<ampscale transition, preset {config.preset}{label}>", "exec"), namespace)
    function = namespace["_transition"]
    function.source = source
    namespace["_split"].source = split_source
    namespace["_split_ok"].source = split_ok_source
    #: ``split(scale, growth_tracker, rest, finite, loss_finite) -> (scale, growth_tracker,
    #: rest, floor_event)``: the same transition, ``rest`` the other fields as a tuple
    function.split = namespace["_split"]
    #: ``split_ok(scale, growth_tracker, rest)``: ``split(..., True, True)``, in fewer operations
    function.split_ok = namespace["_split_ok"]
    return function  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ C

#: helpers shared by every emitted transition (no header: NVRTC gets no include path)
C_PRELUDE = r"""
#ifndef AMPSCALE_PRELUDE
#define AMPSCALE_PRELUDE
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define AMPSCALE_FN __host__ __device__ static inline
#else
#define AMPSCALE_FN static inline
#endif

AMPSCALE_FN float ampscale_f32_from_bits(unsigned int bits) {
    union { unsigned int u; float f; } v;
    v.u = bits;
    return v.f;
}

AMPSCALE_FN double ampscale_f64_from_bits(unsigned long long bits) {
    union { unsigned long long u; double f; } v;
    v.u = bits;
    return v.f;
}

AMPSCALE_FN int ampscale_finite_f32(float x) {
    union { unsigned int u; float f; } v;
    v.f = x;
    return (v.u & 0x7f800000u) != 0x7f800000u;
}

AMPSCALE_FN int ampscale_finite_f64(double x) {
    union { unsigned long long u; double f; } v;
    v.f = x;
    return (v.u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/* double -> float32, rounded to nearest even; past float32's range it is +-inf (the C
   conversion of an out-of-range value is undefined, so the range is tested first: a value at
   or past the midpoint between FLT_MAX and 2**128 rounds to inf). */
AMPSCALE_FN float ampscale_narrow(double x) {
    if (x >= 0x1.ffffffp+127) return ampscale_f32_from_bits(0x7f800000u);
    if (x <= -0x1.ffffffp+127) return ampscale_f32_from_bits(0xff800000u);
    return (float)x;
}

/* Python's a % b (the result takes the sign of b); C's % truncates toward zero. */
AMPSCALE_FN int ampscale_floormod(int a, int b) {
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

AMPSCALE_FN int ampscale_increment(int v) { return v < 2147483647 ? v + 1 : v; }

AMPSCALE_FN int ampscale_decrement(int v) { return v > (-2147483647 - 1) ? v - 1 : v; }

AMPSCALE_FN int ampscale_add_flag(int v, int flag) { return (flag && v < 2147483647) ? v + 1 : v; }
#endif
"""


#: how :func:`c_transition` writes the operations every traced transition shares (``%`` apart)
C_TEMPLATES: dict[str, str] = {
    "bool": "({0} != 0)",
    "not": "(!{0})",
    "and": "({0} && {1})",
    "or": "({0} || {1})",
    "where": "({0} ? {1} : {2})",
    "increment": "ampscale_increment({0})",
    "decrement": "ampscale_decrement({0})",
    "add_flag": "ampscale_add_flag({0}, {1})",
}


def _c_int(value: int) -> str:
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"integer constant {value} is outside int32")
    if value == INT32_MIN:
        return "(-2147483647 - 1)"
    return f"({value})" if value < 0 else str(value)


def _c_float(value: float, scale_dtype: str) -> str:
    """An exact C literal of a scale constant (float32 values carry the ``f`` suffix)."""
    if math.isnan(value):
        return (
            "ampscale_f32_from_bits(0x7fc00000u)"
            if scale_dtype == "float32"
            else "ampscale_f64_from_bits(0x7ff8000000000000ull)"
        )
    if math.isinf(value):
        if scale_dtype == "float32":
            return f"ampscale_f32_from_bits({'0xff800000u' if value < 0 else '0x7f800000u'})"
        return f"ampscale_f64_from_bits({'0xfff0000000000000ull' if value < 0 else '0x7ff0000000000000ull'})"
    if scale_dtype == "float32" and float(np.float32(value)) != value:
        raise ValueError(f"scale constant {value!r} is not a float32 value")
    literal = value.hex()
    return f"({literal}f)" if scale_dtype == "float32" else f"({literal})"


def _c_double(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"factor {value!r} is not finite")
    return f"({value.hex()})"


def c_transition(config: ScalerConfig, prefix: str = "ampscale_", floor_mod: bool = True) -> str:
    """The C source of ``struct {prefix}State`` and of the transition over it.

    Defines ``{prefix}State`` (the record of :func:`state_dtype`), ``{prefix}grow``,
    ``{prefix}shrink`` and ``int {prefix}transition(const struct {prefix}State* in, struct
    {prefix}State* out, int finite, int loss_finite)``, which writes the next state, its
    ``inv_scale`` and ``floor_event`` to ``out`` (the flags and scratch of ``out`` are left to
    the caller) and returns the floor event. Needs :data:`C_PRELUDE` before it; several
    configurations can share one translation unit under different prefixes.

    Args:
        config: the settings.
        prefix: the prefix of every name defined.
        floor_mod: emit ``%`` as Python's floor-mod (``False`` emits C's truncating ``%``: a
            deliberate mutation, for the tests that show it would be caught).
    """
    p = prefix
    dtype = config.scale_dtype
    scale_t = "double" if dtype == "float64" else "float"
    narrow = "" if dtype == "float64" else "ampscale_narrow"
    finite_fn = "ampscale_finite_f64" if dtype == "float64" else "ampscale_finite_f32"
    pad = "" if dtype == "float64" else " float _pad_{0};"
    lines = [
        f"struct {p}State {{",
        f"    {scale_t} scale;{pad.format(0)}",
        f"    {scale_t} last_scale;{pad.format(1)}",
        *(f"    int {f};" for f in ScalerState._fields if f not in ("scale", "last_scale")),
        "    float inv_scale;",
        "    unsigned char floor_event, finite, loss_finite, _pad_2;",
        "    float found_inf, loss_found_inf;",
        "    unsigned int ticket, _pad_3;",
        "};",
        f"typedef char {p}layout_check[(sizeof(struct {p}State) == {STATE_BYTES}) ? 1 : -1];",
        "",
    ]

    # grow and shrink: HostOps._grow and HostOps._shrink, in double, rounded once
    maximum = None if config.max_value is None else _c_float(config.max_value, dtype)
    minimum = None if config.min_value is None else _c_float(config.min_value, dtype)
    lines += [
        f"AMPSCALE_FN {scale_t} {p}grow({scale_t} scale) {{",
        f"    {scale_t} candidate = {narrow}((double)scale * {_c_double(config.growth_value)});",
    ]
    if config.ceiling == "skip":
        too_big = "" if maximum is None else f" || candidate > {maximum}"
        lines.append(f"    if (!{finite_fn}(candidate){too_big}) return scale;")
    elif maximum is not None:
        lines.append(f"    if (candidate > {maximum}) candidate = {maximum};")
    lines += ["    return candidate;", "}", ""]
    backoff = _c_double(config.backoff_value)
    product = f"(double)scale / {backoff}" if config.backoff_rule == "divide" else f"(double)scale * {backoff}"
    lines += [f"AMPSCALE_FN {scale_t} {p}shrink({scale_t} scale) {{", f"    {scale_t} candidate = {narrow}({product});"]
    if minimum is not None:
        lines.append(f"    if (candidate < {minimum}) candidate = {minimum};")
    lines += ["    return candidate;", "}", ""]

    _inputs, outputs = _trace(config)

    def render(node: _Node, args: list[str]) -> str:
        op = node.op
        if op == "literal":
            node.name = _c_int(int(node.value))  # bools as 0 and 1
            return node.name
        if op == "constant":
            node.name = _c_float(node.value, dtype)
            return node.name
        if op in _COMPARISONS:
            return f"({args[0]} {_COMPARISONS[op]} {args[1]})"
        if op == "mod":
            return f"ampscale_floormod({args[0]}, {args[1]})" if floor_mod else f"({args[0]} % {args[1]})"
        templates = {**C_TEMPLATES, "grow": f"{p}grow({{0}})", "shrink": f"{p}shrink({{0}})"}
        return templates[op].format(*args)

    bound, returned = _emit(outputs, render)
    c_type = {"bool": "int", "int": "int", "scale": scale_t}
    fields = ScalerState._fields
    signature = f"const struct {p}State* in, struct {p}State* out, int finite, int loss_finite"
    lines += [
        f"AMPSCALE_FN int {p}transition({signature}) {{",
        *(f"    const {c_type['scale' if f in ('scale', 'last_scale') else 'int']} {f} = in->{f};" for f in fields),
        *(f"    (void){name};" for name in (*fields, *_FLAG_INPUTS)),
        *(f"    const {c_type[kind]} {name} = {code};" for name, kind, code in bound),
        # every output computed before the first store: out may alias in
        *(
            f"    const {c_type['scale' if f in ('scale', 'last_scale') else 'int']} next_{f} = {expression};"
            for f, expression in zip(fields, returned[:-1], strict=True)
        ),
        f"    const int floor_event = {returned[-1]};",
        *(f"    out->{f} = next_{f};" for f in fields),
        "    /* the next step's inverse scale, as torch computes it: 1 / double(scale), rounded once */",
        "    out->inv_scale = ampscale_narrow(1.0 / (double)next_scale);",
        "    out->floor_event = (unsigned char)(floor_event != 0);",
        "    return floor_event != 0;",
        "}",
        "",
    ]
    return "\n".join(lines)
