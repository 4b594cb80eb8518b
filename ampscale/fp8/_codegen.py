"""The FP8 slot transition, traced once per configuration and emitted as Python or as C.

The loss scaler's tracer (:mod:`ampscale._codegen`) records :func:`slot_transition` run on
symbolic values: :class:`Fp8TraceOps` adds the FP8 operations (float32 arithmetic, the
history's ``push`` and ``window_max``, the power-of-two rules) to its operations, and the same
``_emit`` orders and binds the graph. Two emitters write it out:

* :func:`python_slot_transition`: one straight-line Python function over one slot, on Python
  floats rounded to float32 after every operation (a float32 quotient or product computed in
  double and rounded once is the correctly rounded float32 result: 53 >= 2*24 + 2), with the
  history a tuple holding the ring buffer (its oldest value at ``head``).
* :func:`c_transition`: C functions over one slot and over ``N`` slots (``[N, L]`` ring-buffer
  history, row-major), for the host compiler and for CUDA kernels alike (no header; NVRTC needs
  none). Given the same buffer as input and output history, a slot writes one float (two on
  torchao's first update), never a shifted copy.
* :func:`c_state_update`: one slot's update read from and written to the arrays of an
  :class:`~ampscale.fp8.Fp8State` (every field, the step count included), the body both CUDA
  kernels run per thread: the one-launch update (:mod:`ampscale.fp8._cuda`) and the fused
  pass's last block (``ampscale_fp8_pass_step`` in ``ampscale/_native/cuda/fp8_kernels.cu``).
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
from ampscale.fp8._ops import floor_log2_thresholds, subnormal_floor_log2_thresholds
from ampscale.fp8._transition import SLOT_INT_FIELDS, Fp8Slot, Fp8State, slot_transition

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampscale.fp8._config import Fp8Config

__all__ = [
    "C_PRELUDE",
    "FLAG_BOOL",
    "FLAG_FALSE",
    "FLAG_TRUE",
    "FP8_C_PRELUDE",
    "c_state_update",
    "c_transition",
    "python_slot_transition",
]

#: how a step's flag is passed to a kernel (the codes of the loss scaler's kernels): true / a
#: bool in memory / false
FLAG_TRUE, FLAG_BOOL, FLAG_FALSE = 0, 1, 3

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

    def is_zero(self, x: _Node) -> _Node:
        return x == self.f32(0.0)

    def positive(self, x: _Node) -> _Node:
        return x > self.f32(0.0)

    def less(self, a: _Node, b: _Node) -> _Node:
        return a < b

    def div(self, a: _Node, b: _Node) -> _Node:
        return _Node("div", "f32", a, b)

    def mul(self, a: _Node, b: _Node) -> _Node:
        return _Node("mul", "f32", a, b)

    def sub(self, a: _Node, b: _Node) -> _Node:
        return _Node("sub", "f32", a, b)

    def floor_log2(self, x: _Node) -> _Node:
        return _Node("floor_log2", "f32", x)

    def exp2_abs(self, x: _Node) -> _Node:
        return _Node("exp2_abs", "f32", x)

    def ring_next(self, head: _Node, length: int) -> _Node:
        return _Node("ring_next", "int", head, value=int(length), repeats=True)

    def flush(self, x: _Node) -> _Node:
        return _Node("flush", "f32", x, repeats=True)

    def div_wide(self, numerator: _Node, denominator: _Node, eps: float) -> _Node:
        return _Node("div_wide", "f32", numerator, denominator, value=float(eps))

    def pow2_mask(self, x: _Node) -> _Node:
        return _Node("pow2_mask", "f32", x)

    def pow2_floor_log2(self, x: _Node) -> _Node:
        return _Node("pow2_floor_log2", "f32", x)

    def push(self, history: _Node, head: _Node, value: _Node, write: Any, twice: Any = False) -> _Node:
        return _Node("push", "hist", history, head, value, _lift_flag(write), _lift_flag(twice))

    def window_max(self, history: _Node, nan_rule: str) -> _Node:
        return _Node("window_max", "f32", history, value=nan_rule)


def _lift_flag(flag: Any) -> _Node:
    return flag if isinstance(flag, _Node) else _literal(bool(flag))


def _trace(config: Fp8Config) -> tuple[list[_Node], list[_Node]]:
    """The slot transition as nodes: the inputs (slot fields, then amax, fp8_max, step_ok) and
    the outputs (the next slot's fields, then ``updated``)."""
    kinds = {"scale": "f32", "scale_inv": "f32", "history": "hist"}
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


def _floor_log2(x: float) -> float:
    """``floor(log2(x))`` with a float32 ``log2`` (see :meth:`Fp8ArrayOps.floor_log2`)."""
    if x != x or x < 0.0:
        return math.nan
    if x == 0.0:
        return -math.inf
    if math.isinf(x):
        return math.inf
    bits = _bits(x)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if biased == 0:
        lead = mantissa.bit_length() - 1
        return float(lead - 149 + (mantissa >= subnormal_floor_log2_thresholds()[lead]))
    return float(biased - 127 + (mantissa >= floor_log2_thresholds()[biased]))


def _exp2_abs(e: float) -> float:
    if e != e:
        return math.nan
    magnitude = abs(e)
    return 2.0 ** int(magnitude) if magnitude < 128.0 else math.inf


def _push(history: tuple[float, ...], head: int, value: float, write: bool, twice: bool) -> tuple[float, ...]:
    if not write:
        return history
    ring = list(history)
    ring[head] = value
    if twice:
        ring[(head - 1) % len(ring)] = value
    return tuple(ring)


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
    top = 0.0  # from 0, as TE's fmaxf: negatives and -0 count as 0
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
    "_floor_log2": _floor_log2,
    "_exp2_abs": _exp2_abs,
    "_push": _push,
    "_window_max": _window_max,
    "_flush": _flush,
    "_isfinite": math.isfinite,
    "_isinf": math.isinf,
    "_isnan": math.isnan,
}


def python_slot_transition(config: Fp8Config) -> Callable[..., tuple[tuple[Any, ...], bool]]:
    """Return ``f(scale, scale_inv, history, filled, zero_amax, nonfinite, head, amax, fp8_max,
    step_ok) -> (next_slot_fields, updated)`` for one slot.

    ``history`` is a tuple of Python floats (float32 values) holding the ring buffer, its oldest
    value at ``head``; the function is :func:`slot_transition` on exact float32 arithmetic. Its
    source is kept as ``f.source``.
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
            "sub": "_f32({0} - {1})",
            "flush": "_flush({0})",
            "pow2_mask": "_pow2_mask({0})",
            "pow2_floor_log2": "_pow2_floor_log2({0})",
            "floor_log2": "_floor_log2({0})",
            "exp2_abs": "_exp2_abs({0})",
            "push": "_push({0}, {1}, {2}, {3}, {4})",
            "ring_next": f"(0 if {{0}} + 1 == {node.value} else {{0}} + 1)",
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

/* the window of the ring h after push(h, head, a, write, twice), without writing it */
AMPSCALE_FN float ampscale_fp8_window_max_ring(const float* h, int length, int head, float a, int write, int twice,
                                               int propagate) {
    const int previous = head == 0 ? length - 1 : head - 1;
    float top = 0.0f;
    for (int i = 0; i < length; i++) {
        const float v = (write && i == head) || (twice && i == previous) ? a : h[i];
        if (v != v) {
            if (propagate) return v;
            continue;
        }
        top = v > top ? v : top;
    }
    return top;
}

/* out = h with a written at head (and at head - 1 when twice) if write; out may be h, and then
   this is one store (two on torchao's first update): the ring is never shifted */
AMPSCALE_FN void ampscale_fp8_ring_push(const float* h, float* out, int length, int head, float a, int write,
                                        int twice) {
    if (out != h) {
        for (int i = 0; i < length; i++) out[i] = h[i];
    }
    if (write) {
        out[head] = a;
        if (twice) out[head == 0 ? length - 1 : head - 1] = a;
    }
}

/* round(pow(2, |e|)) for an integral float e (MS-AMP): inf past 2**127, nan kept */
AMPSCALE_FN float ampscale_fp8_exp2_abs(float e) {
    if (e != e) return e;
    const float m = e < 0.0f ? -e : e;
    if (!(m < 128.0f)) return ampscale_f32_from_bits(0x7f800000u);
    return ampscale_f32_from_bits((unsigned int)((int)m + 127) << 23);
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


def _exponent_c(prefix: str) -> str:
    """``floor(log2(x))`` with a float32 ``log2``, as :func:`_floor_log2` (MS-AMP's rule)."""
    table = ", ".join(f"{t}u" for t in floor_log2_thresholds())
    small = ", ".join(f"{t}u" for t in subnormal_floor_log2_thresholds())
    return (
        f"AMPSCALE_FN float {prefix}floor_log2(float x) {{\n"
        f"    const unsigned int thresholds[256] = {{{table}}};\n"
        f"    const unsigned int small[23] = {{{small}}};\n"
        "    const unsigned int bits = ampscale_fp8_bits(x);\n"
        "    const unsigned int magnitude = bits & 0x7fffffffu;\n"
        "    const unsigned int biased = magnitude >> 23, mantissa = bits & 0x7fffffu;\n"
        "    const int negative = (bits >> 31) != 0u && magnitude != 0u;\n"
        "    if (magnitude > 0x7f800000u || negative) return ampscale_f32_from_bits(0x7fc00000u);\n"
        "    if (magnitude == 0u) return ampscale_f32_from_bits(0xff800000u);\n"
        "    if (magnitude == 0x7f800000u) return x;\n"
        "    if (biased == 0u) {\n"
        "        int lead = 0;\n"
        "        while ((mantissa >> (lead + 1)) != 0u) lead++;\n"
        "        return (float)(lead - 149 + (mantissa >= small[lead] ? 1 : 0));\n"
        "    }\n"
        "    return (float)((int)biased - 127 + (mantissa >= thresholds[biased] ? 1 : 0));\n"
        "}\n"
    )


def c_transition(config: Fp8Config, prefix: str = "ampscale_fp8_") -> str:
    """The C source of one configuration's FP8 transition.

    Defines ``struct {prefix}Slot {float scale, scale_inv; int filled, zero_amax, nonfinite,
    head;}``, ``int {prefix}slot(const struct {prefix}Slot* in, struct {prefix}Slot* out, const
    float* hist_in, float* hist_out, float amax, float fp8_max, int step_ok)`` (returns
    ``updated``; ``out`` may be ``in`` and ``hist_out`` may be ``hist_in``, which makes the
    history update one store), and ``void {prefix}transition(..., const float* amax, const
    float* fp8_max, int step_ok, int* updated, int n)`` over ``n`` slots with a row-major
    ``[n, history_len]`` ring-buffer history. Needs :data:`C_PRELUDE` and
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
                _h, head, value, write, twice = pushed[id(source)]
                return (
                    f"ampscale_fp8_window_max_ring(hist_in, {length}, {head}, {value}, {write}, {twice}, {propagate})"
                )
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
            "sub": "({0} - {1})",
            "flush": "ampscale_fp8_flush({0})",
            "pow2_mask": "ampscale_fp8_pow2_mask({0})",
            "pow2_floor_log2": f"{p}pow2_floor_log2({{0}})",
            "floor_log2": f"{p}floor_log2({{0}})",
            "exp2_abs": "ampscale_fp8_exp2_abs({0})",
            "ring_next": f"({{0}} + 1 == {node.value} ? 0 : {{0}} + 1)",
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
        "    int head;",
        "};",
        "",
    ]
    if config.pow2 == "floor_log2":
        lines.append(_floor_log2_c(p))
    if config.scale_rule == "msamp":
        lines.append(_exponent_c(p))
    signature = (
        f"const struct {p}Slot* in, struct {p}Slot* out, const float* hist_in, float* hist_out, "
        "float amax, float fp8_max, int step_ok"
    )
    scalar_fields = [f for f in Fp8Slot._fields if f != "history"]
    index = {f: i for i, f in enumerate(Fp8Slot._fields)}
    if id(history_out) in pushed:
        _h, head, value, write, twice = pushed[id(history_out)]
        store_history = f"    ampscale_fp8_ring_push(hist_in, hist_out, {length}, {head}, {value}, {write}, {twice});"
    else:
        store_history = f"    ampscale_fp8_ring_push(hist_in, hist_out, {length}, 0, 0.0f, 0, 0);"
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


def _state_c_type(field: str) -> str:
    return "int" if field in SLOT_INT_FIELDS or field == "steps" else "float"


def c_state_update(config: Fp8Config, prefix: str = "ampscale_fp8_") -> str:
    """The C of one slot's update on the arrays of an :class:`~ampscale.fp8.Fp8State`.

    Defines ``AMPSCALE_FP8_STATE_PARAMS`` (``const T* {field}`` for every field of the state,
    then ``T* out_{field}`` for every field: 16 pointers) and ``AMPSCALE_FP8_STATE_ARGS`` (their
    names), ``{prefix}read_flag(const void* flag, long long kind)`` (:data:`FLAG_TRUE`,
    :data:`FLAG_BOOL`: a bool byte at ``flag``, :data:`FLAG_FALSE`), and ``void
    {prefix}thread(long long k, AMPSCALE_FP8_STATE_PARAMS, const float* amax, const float*
    fp8_max, const void* step_ok, long long step_ok_kind, unsigned char* updated, long long
    n)``: slot ``k``'s fields and history row (at ``k * history_len``) through
    ``{prefix}slot`` into the output arrays, ``updated[k]`` (when not null), and on ``k == 0``
    the saturating step count, so that one call per slot is the whole update. Every field the
    transition updates is written, ``head`` and ``steps`` included; the outputs may be the
    inputs (the transition writes its output after reading its input). Needs
    :func:`c_transition` with the same ``prefix`` before it.
    """
    fields = Fp8State._fields
    scalars = [f for f in Fp8Slot._fields if f != "history"]
    params = ", ".join(
        [*(f"const {_state_c_type(f)}* {f}" for f in fields), *(f"{_state_c_type(f)}* out_{f}" for f in fields)]
    )
    names = ", ".join([*fields, *(f"out_{f}" for f in fields)])
    load = "\n".join(f"    in.{f} = {f}[k];" for f in scalars)
    store = "\n".join(f"    out_{f}[k] = next.{f};" for f in scalars)
    length = config.history_len
    return f"""
#define AMPSCALE_FP8_STATE_PARAMS {params}
#define AMPSCALE_FP8_STATE_ARGS {names}

/* the loss scaler's flag codes: {FLAG_TRUE} true, {FLAG_BOOL} a bool in memory, {FLAG_FALSE} false */
AMPSCALE_FN int {prefix}read_flag(const void* flag, long long kind) {{
    if (kind == {FLAG_BOOL}) return *(const unsigned char*)flag != 0;
    return kind == {FLAG_TRUE};
}}

/* slot k's update, and the step count on k == 0 */
AMPSCALE_FN void {prefix}thread(long long k, AMPSCALE_FP8_STATE_PARAMS, const float* amax, const float* fp8_max,
                                const void* step_ok, long long step_ok_kind, unsigned char* updated, long long n) {{
    if (k == 0) *out_steps = ampscale_increment(*steps);
    if (k >= n) return;
    struct {prefix}Slot in, next;
{load}
    const long long row = k * {length}LL;
    const int u = {prefix}slot(&in, &next, history + row, out_history + row, amax[k], fp8_max[k],
                               {prefix}read_flag(step_ok, step_ok_kind));
{store}
    if (updated) updated[k] = (unsigned char)(u != 0);
}}
"""
