"""The FP8 slot transition, traced once per configuration and emitted as Python or as C.

The loss scaler's tracer (:mod:`ampscale._codegen`) records :func:`slot_transition` run on
symbolic values: :class:`Fp8TraceOps` adds the FP8 operations (float32 arithmetic, the
history's ``push`` and ``window_max``, the power-of-two rules) to its operations, and the same
``_emit`` orders and binds the graph. Two emitters write it out:

* :func:`python_slot_transition`: one straight-line Python function over one slot, on Python
  floats rounded to float32 after every operation (a float32 quotient or product computed in
  double and rounded once is the correctly rounded float32 result: 53 >= 2*24 + 2), with the
  history a tuple, oldest first.
* :func:`c_transition`: C functions over one slot and over ``N`` slots (``[N, L]`` history,
  row-major), for the host compiler and for CUDA kernels alike (no header; NVRTC needs none).
  Compile it without contraction to FMA and without flush-to-zero (``-ffp-contract=off``;
  ``--fmad=false --ftz=false`` for NVRTC): the transition's subnormal amaxes and scales must
  keep their bits unless the preset flushes them on purpose (``subnormals="flush"``).

The tests compile the C with the host's compiler and compare it bit for bit with the Python
transition and with the array backends, on every preset.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

from ampscale._codegen import (
    C_PRELUDE,
    C_TEMPLATES,
    PYTHON_TEMPLATES,
    _c_float,
    _c_int,
    _emit,
    _literal,
    _Node,
    _TraceOps,
)
from ampscale._config import FLOAT32_TINY, _round_to
from ampscale.fp8._ops import floor_log2_thresholds
from ampscale.fp8._transition import Fp8Slot, slot_transition

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale.fp8._config import Fp8Config

__all__ = ["C_PRELUDE", "FP8_C_PRELUDE", "c_transition", "python_slot_transition"]

_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_INPUTS = ("amax", "fp8_max", "step_ok")


class Fp8TraceOps(_TraceOps):
    """The operations of :class:`~ampscale.fp8._ops.Fp8ArrayOps`, recorded instead of computed."""

    def __init__(self) -> None:
        super().__init__(fold=True)

    def f32(self, value: float) -> _Node:
        return _Node("f32const", "f32", value=_round_to(float(value), "float32"))

    def true(self) -> _Node:
        return _literal(True)

    def isfinite(self, x: _Node) -> _Node:
        return _Node("isfinite", "bool", x)

    def isinf(self, x: _Node) -> _Node:
        return _Node("isinf", "bool", x)

    def isnan(self, x: _Node) -> _Node:
        return _Node("isnan", "bool", x)

    def div(self, a: _Node, b: _Node) -> _Node:
        return _Node("div", "f32", a, b)

    def mul(self, a: _Node, b: _Node) -> _Node:
        return _Node("mul", "f32", a, b)

    def flush(self, x: _Node) -> _Node:
        return _Node("flush", "f32", x, repeats=True)

    def div_wide(self, numerator: _Node, denominator: _Node, eps: float) -> _Node:
        return _Node("div_wide", "f32", numerator, denominator, value=float(eps))

    def pow2_mask(self, x: _Node) -> _Node:
        return _Node("pow2_mask", "f32", x)

    def pow2_floor_log2(self, x: _Node) -> _Node:
        return _Node("pow2_floor_log2", "f32", x)

    def push(self, history: _Node, value: _Node, write: _Node) -> _Node:
        return _Node("push", "hist", history, value, write)

    def window_max(self, history: _Node, nan_rule: str) -> _Node:
        return _Node("window_max", "f32", history, value=nan_rule)


def _trace(config: Fp8Config) -> tuple[list[_Node], list[_Node]]:
    """The slot transition as nodes: the inputs (slot fields, then amax, fp8_max, step_ok) and
    the outputs (the next slot's fields, then ``updated``)."""
    kinds = {"scale": "f32", "scale_inv": "f32", "history": "hist", "filled": "int", "zero_amax": "int"}
    slot = Fp8Slot(*(_Node("input", kinds.get(f, "int")) for f in Fp8Slot._fields))
    for node, name in zip(slot, Fp8Slot._fields, strict=True):
        node.name = name
    amax, fp8_max, step_ok = _Node("input", "f32"), _Node("input", "f32"), _Node("input", "bool")
    amax.name, fp8_max.name, step_ok.name = _INPUTS
    next_slot, updated = slot_transition(config, slot, amax, fp8_max, step_ok, Fp8TraceOps())
    outputs = [node if isinstance(node, _Node) else _literal(node) for node in (*next_slot, updated)]
    return [*slot, amax, fp8_max, step_ok], outputs


# ------------------------------------------------------------------------------ Python


def _f32(value: float) -> float:
    return _round_to(value, "float32")


def _div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return _f32(a / b)


def _bits(x: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])


def _pow2_mask(x: float) -> float:
    return _from_bits(_bits(x) & 0xFF800000)


def _pow2_floor_log2(x: float) -> float:
    bits = _bits(x)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if biased == 0:
        return _from_bits(0)
    if biased == 255:
        return x
    return _from_bits((biased + (mantissa >= floor_log2_thresholds()[biased])) << 23)


def _div_wide(numerator: float, denominator: float, eps: float) -> float:
    if denominator != denominator:
        return denominator
    return _f32(numerator / max(denominator, eps))


def _window_max(history: tuple[float, ...], propagate: bool) -> float:
    top = 0.0
    for value in history:
        if value != value:
            if propagate:
                return math.nan
            continue
        top = value if value > top else top
    return top


def _flush(x: float) -> float:
    return 0.0 if abs(x) < FLOAT32_TINY else x


_PY_HELPERS: dict[str, Any] = {
    "_div": _div,
    "_f32": _f32,
    "_div_wide": _div_wide,
    "_pow2_mask": _pow2_mask,
    "_pow2_floor_log2": _pow2_floor_log2,
    "_window_max": _window_max,
    "_flush": _flush,
    "_isfinite": math.isfinite,
    "_isinf": math.isinf,
    "_isnan": math.isnan,
}


def python_slot_transition(config: Fp8Config) -> Callable[..., tuple[tuple[Any, ...], bool]]:
    """Return ``f(scale, scale_inv, history, filled, zero_amax, nonfinite, amax, fp8_max,
    step_ok) -> (next_slot_fields, updated)`` for one slot.

    ``history`` is a tuple of Python floats (float32 values), oldest first; the function is
    :func:`slot_transition` on exact float32 arithmetic. Its source is kept as ``f.source``.
    """
    floats: dict[float, str] = {}

    def constant(value: float) -> str:
        key = float(value)
        if key != key:
            return "_nan"
        return floats.setdefault(key, f"_k{len(floats)}")

    def render(node: _Node, args: list[str]) -> str:
        op = node.op
        if op == "literal":
            node.name = repr(node.value)
            return node.name
        if op == "f32const":
            node.name = constant(node.value)
            return node.name
        if op in _COMPARISONS:
            return f"({args[0]} {_COMPARISONS[op]} {args[1]})"
        own = {
            "isfinite": "_isfinite({0})",
            "isinf": "_isinf({0})",
            "isnan": "_isnan({0})",
            "div": "_div({0}, {1})",
            "mul": "_f32({0} * {1})",
            "flush": "_flush({0})",
            "pow2_mask": "_pow2_mask({0})",
            "pow2_floor_log2": "_pow2_floor_log2({0})",
            "push": "(({0}[1:] + ({1},)) if {2} else {0})",
            "window_max": "_window_max({0}, " + str(node.value == "propagate") + ")",
        }
        if op == "div_wide":
            return f"_div_wide({args[0]}, {args[1]}, {constant(node.value)})"
        return {**PYTHON_TEMPLATES, **own}[op].format(*args)

    _inputs, outputs = _trace(config)
    bound, returned = _emit(outputs, render)
    fields = Fp8Slot._fields
    source = "\n".join(
        [
            f"def _slot({', '.join((*fields, *_INPUTS))}):",
            *(f"    {name} = {code}" for name, _kind, code in bound),
            f"    return ({', '.join(returned[:-1])},), {returned[-1]}",
            "",
        ]
    )
    namespace: dict[str, Any] = {**_PY_HELPERS, "_nan": math.nan, **{name: value for value, name in floats.items()}}
    exec(compile(source, f"<ampscale fp8 transition, preset {config.preset}>", "exec"), namespace)
    function = namespace["_slot"]
    function.source = source
    return function  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ C

#: helpers of the FP8 transitions (after :data:`ampscale._codegen.C_PRELUDE`)
FP8_C_PRELUDE = r"""
#ifndef AMPSCALE_FP8_PRELUDE
#define AMPSCALE_FP8_PRELUDE
AMPSCALE_FN unsigned int ampscale_fp8_bits(float x) {
    union { unsigned int u; float f; } v;
    v.f = x;
    return v.u;
}

AMPSCALE_FN int ampscale_fp8_isnan(float x) { return (ampscale_fp8_bits(x) & 0x7fffffffu) > 0x7f800000u; }

AMPSCALE_FN int ampscale_fp8_isinf(float x) { return (ampscale_fp8_bits(x) & 0x7fffffffu) == 0x7f800000u; }

/* |x| subnormal -> +0 (as XLA computes on the CPU, with flush-to-zero) */
AMPSCALE_FN float ampscale_fp8_flush(float x) {
    return ((ampscale_fp8_bits(x) & 0x7f800000u) == 0u) ? 0.0f : x;
}

AMPSCALE_FN float ampscale_fp8_pow2_mask(float x) {
    return ampscale_f32_from_bits(ampscale_fp8_bits(x) & 0xff800000u);
}

/* float32(double(n) / max(double(d), eps)), nan kept (torch.clamp keeps nan) */
AMPSCALE_FN float ampscale_fp8_div_wide(float n, float d, double eps) {
    if (d != d) return d;
    const double wide = ((double)d < eps) ? eps : (double)d;
    return ampscale_narrow((double)n / wide);
}

/* the largest value of a window: nan dropped (fmaxf from 0) or propagated */
AMPSCALE_FN float ampscale_fp8_window_max(const float* h, int length, int propagate) {
    float top = 0.0f;
    for (int i = 0; i < length; i++) {
        const float v = h[i];
        if (v != v) {
            if (propagate) return v;
            continue;
        }
        top = v > top ? v : top;
    }
    return top;
}

/* the window of h after push(h, a, write), without writing it */
AMPSCALE_FN float ampscale_fp8_window_max_pushed(const float* h, int length, float a, int write, int propagate) {
    if (!write) return ampscale_fp8_window_max(h, length, propagate);
    const float top = ampscale_fp8_window_max(h + 1, length - 1, propagate);
    if (top != top) return top;
    if (a != a) return propagate ? a : top;
    return a > top ? a : top;
}

/* out = h[1:] + [a] if write else h; out may be h */
AMPSCALE_FN void ampscale_fp8_push(const float* h, float* out, int length, float a, int write) {
    if (write) {
        for (int i = 0; i + 1 < length; i++) out[i] = h[i + 1];
        out[length - 1] = a;
    } else if (out != h) {
        for (int i = 0; i < length; i++) out[i] = h[i];
    }
}
#endif
"""


def _floor_log2_c(prefix: str) -> str:
    table = ", ".join(f"{t}u" for t in floor_log2_thresholds())
    return (
        f"AMPSCALE_FN float {prefix}pow2_floor_log2(float x) {{\n"
        f"    const unsigned int thresholds[256] = {{{table}}};\n"
        "    const unsigned int bits = ampscale_fp8_bits(x);\n"
        "    const unsigned int biased = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;\n"
        "    if (biased == 0u) return 0.0f;\n"
        "    if (biased == 255u) return x;\n"
        "    return ampscale_f32_from_bits((biased + (mantissa >= thresholds[biased] ? 1u : 0u)) << 23);\n"
        "}\n"
    )


def c_transition(config: Fp8Config, prefix: str = "ampscale_fp8_") -> str:
    """The C source of one configuration's FP8 transition.

    Defines ``struct {prefix}Slot {float scale, scale_inv; int filled, zero_amax, nonfinite;}``,
    ``int {prefix}slot(const struct {prefix}Slot* in, struct {prefix}Slot* out, const float*
    hist_in, float* hist_out, float amax, float fp8_max, int step_ok)`` (returns ``updated``;
    ``out`` may be ``in`` and ``hist_out`` may be ``hist_in``), and ``void {prefix}transition(
    ..., const float* amax, const float* fp8_max, int step_ok, int* updated, int n)`` over
    ``n`` slots with a row-major ``[n, history_len]`` history. Needs :data:`C_PRELUDE` and
    :data:`FP8_C_PRELUDE` before it.
    """
    p = prefix
    length = config.history_len
    pushed: dict[int, list[str]] = {}

    def render(node: _Node, args: list[str]) -> str:
        op = node.op
        if op == "literal":
            node.name = _c_int(int(node.value))
            return node.name
        if op == "f32const":
            node.name = _c_float(node.value, "float32")
            return node.name
        if op in _COMPARISONS:
            return f"({args[0]} {_COMPARISONS[op]} {args[1]})"
        if op == "push":
            if node.operands[0].op != "input":
                raise AssertionError("the FP8 transition pushes once, onto its input history")
            pushed[id(node)] = args
            node.name = "/* pushed history */"
            return node.name
        if op == "window_max":
            propagate = int(node.value == "propagate")
            source = node.operands[0]
            if id(source) in pushed:
                _h, value, write = pushed[id(source)]
                return f"ampscale_fp8_window_max_pushed(hist_in, {length}, {value}, {write}, {propagate})"
            return f"ampscale_fp8_window_max(hist_in, {length}, {propagate})"
        if op == "div_wide":
            eps = node.value
            return f"ampscale_fp8_div_wide({args[0]}, {args[1]}, {eps.hex()})"
        own = {
            "isfinite": "ampscale_finite_f32({0})",
            "isinf": "ampscale_fp8_isinf({0})",
            "isnan": "ampscale_fp8_isnan({0})",
            "div": "({0} / {1})",
            "mul": "({0} * {1})",
            "flush": "ampscale_fp8_flush({0})",
            "pow2_mask": "ampscale_fp8_pow2_mask({0})",
            "pow2_floor_log2": f"{p}pow2_floor_log2({{0}})",
        }
        return {**C_TEMPLATES, **own}[op].format(*args)

    _inputs, outputs = _trace(config)
    history_out = outputs[Fp8Slot._fields.index("history")]
    bound, returned = _emit(outputs, render)
    c_type = {"bool": "int", "int": "int", "f32": "float"}
    lines = [
        f"struct {p}Slot {{",
        "    float scale;",
        "    float scale_inv;",
        "    int filled;",
        "    int zero_amax;",
        "    int nonfinite;",
        "};",
        "",
    ]
    if config.pow2 == "floor_log2":
        lines.append(_floor_log2_c(p))
    signature = (
        f"const struct {p}Slot* in, struct {p}Slot* out, const float* hist_in, float* hist_out, "
        "float amax, float fp8_max, int step_ok"
    )
    scalar_fields = [f for f in Fp8Slot._fields if f != "history"]
    index = {f: i for i, f in enumerate(Fp8Slot._fields)}
    if id(history_out) in pushed:
        _h, value, write = pushed[id(history_out)]
        store_history = f"    ampscale_fp8_push(hist_in, hist_out, {length}, {value}, {write});"
    else:
        store_history = f"    ampscale_fp8_push(hist_in, hist_out, {length}, 0.0f, 0);"
    lines += [
        f"AMPSCALE_FN int {p}slot({signature}) {{",
        *(f"    const {c_type['f32' if f.startswith('scale') else 'int']} {f} = in->{f};" for f in scalar_fields),
        *(f"    (void){name};" for name in (*scalar_fields, *_INPUTS)),
        *(f"    const {c_type[kind]} {name} = {code};" for name, kind, code in bound),
        # every output computed before the first store: out may alias in
        *(
            f"    const {c_type['f32' if f.startswith('scale') else 'int']} next_{f} = {returned[index[f]]};"
            for f in scalar_fields
        ),
        f"    const int updated = {returned[-1]};",
        store_history,
        *(f"    out->{f} = next_{f};" for f in scalar_fields),
        "    return updated != 0;",
        "}",
        "",
        f"AMPSCALE_FN void {p}transition(const struct {p}Slot* in, struct {p}Slot* out, const float* hist_in,",
        "        float* hist_out, const float* amax, const float* fp8_max, int step_ok, int* updated, int n) {",
        "    for (int k = 0; k < n; k++) {",
        f"        const long long row = (long long)k * {length};",
        f"        const int u = {p}slot(in + k, out + k, hist_in + row, hist_out + row, amax[k], fp8_max[k], step_ok);",
        "        if (updated) updated[k] = u;",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)
