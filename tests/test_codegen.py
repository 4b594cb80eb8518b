"""The transition emitted as C, compiled by the host's C compiler, against the host transition.

``ampscale._codegen.c_transition`` writes the same traced graph that the host backends run as
Python (``HostOps.run``) as a C function over the packed device state; the CUDA kernels run
it on the GPU. Here it is compiled with the host's ``cc`` into a shared library (many
configurations in one translation unit, each under its own prefix) and compared with
``HostOps.run`` bit for bit on every field, the next ``inv_scale`` and the floor event: for
every preset and mode, hypothesis-drawn settings, edge states (int32 limits, negative trackers
as a checkpoint may hold, subnormal, largest-float, zero and infinite scales) and long
trajectories. Mutations of the C (C's truncating ``%``, flush-to-zero) must be caught, and are.
"""

from __future__ import annotations

import ctypes
import pathlib
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale
from ampscale._codegen import C_PRELUDE, STATE_BYTES, c_transition, state_dtype
from ampscale._config import INT32_MAX, INT32_MIN
from ampscale._core import ScalerState, initial_values
from ampscale._ops import HostOps
from tests.test_presets import SETTINGS, _valid

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc, gcc or clang) on PATH")

MODES = ("dynamic", "static", "guard")
X86 = platform.machine().lower() in ("x86_64", "amd64")

# Flush-to-zero and denormals-are-zero on x86 (the MXCSR bits), to show that FTZ would be caught.
_HARNESS = r"""
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
void harness_set_ftz(int on) {
    unsigned int csr = _mm_getcsr() & ~0x8040u;
    _mm_setcsr(on ? (csr | 0x8040u) : csr);
}
#else
void harness_set_ftz(int on) { (void)on; }
#endif
"""


def build(configs: list, tmp: pathlib.Path, *, floor_mod: bool = True, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile the transitions of ``configs`` into one library with ``run`` and ``chain`` entries."""
    parts = [C_PRELUDE, _HARNESS]
    cases = []
    for k, config in enumerate(configs):
        parts.append(c_transition(config, prefix=f"c{k}_", floor_mod=floor_mod))
        cases.append(
            f"    case {k}:\n"
            f"        return c{k}_transition((const struct c{k}_State*)in, (struct c{k}_State*)out, f, loss);"
        )
    parts.append(
        "int harness_run(int k, const void* in, void* out, int f, int loss) {\n    switch (k) {\n"
        + "\n".join(cases)
        + "\n    }\n    return -1;\n}\n"
        "void harness_batch(int k, const char* in, char* out, const int* f, const int* loss, int* events, int n) {\n"
        "    for (int i = 0; i < n; i++)\n"
        f"        events[i] = harness_run(k, in + {STATE_BYTES} * i, out + {STATE_BYTES} * i, f[i], loss[i]);\n"
        "}\n"
        "void harness_chain(int k, char* states, const int* f, const int* loss, int* events, int n) {\n"
        f"    const int b = {STATE_BYTES};\n"
        "    for (int i = 0; i < n; i++)\n"
        "        events[i] = harness_run(k, states + b * i, states + b * (i + 1), f[i], loss[i]);\n"
        "}\n"
    )
    source = tmp / "transitions.c"
    source.write_text("\n".join(parts))
    lib = tmp / f"transitions{len(list(tmp.glob('*.so')))}.so"
    command = [CC, "-std=c11", "-O2", "-Wall", "-Werror", "-fPIC", "-shared", *flags, "-o", str(lib), str(source)]
    subprocess.run(command, check=True, timeout=300)
    so = ctypes.CDLL(str(lib))
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    so.harness_batch.argtypes = [integer, pointer, pointer, pointer, pointer, pointer, integer]
    so.harness_chain.argtypes = [integer, pointer, pointer, pointer, pointer, integer]
    so.harness_set_ftz.argtypes = [integer]
    return so


def record(config, values: ScalerState) -> np.ndarray:
    out = np.zeros(1, state_dtype(config.scale_dtype))
    for field in ScalerState._fields:
        out[field] = getattr(values, field)
    return out


def bits(value: float, dtype: str) -> int:
    return int(np.asarray(value, dtype=dtype).view(np.uint64 if dtype == "float64" else np.uint32))


def mismatches(config, ops: HostOps, before: np.ndarray, after: np.ndarray, f, loss, events) -> list[str]:
    """Every difference, field by field and bit for bit, between C's results and the host's."""
    fields = ScalerState._fields
    names = before.dtype.names
    scale_bits = np.uint64 if config.scale_dtype == "float64" else np.uint32
    wrong = []
    expected = []
    for row, finite, loss_ok in zip(before.tolist(), f.tolist(), loss.tolist(), strict=True):
        values = dict(zip(names, row, strict=True))
        expected.append(ops.run(ScalerState(*(values[name] for name in fields)), bool(finite), bool(loss_ok)))
    want = np.zeros(len(before), before.dtype)
    for field in fields:
        want[field] = [getattr(state, field) for state, _ in expected]
    for field in fields:
        got, exp = after[field], want[field]
        if field in ("scale", "last_scale"):
            got, exp = got.view(scale_bits), exp.view(scale_bits)
        for i in np.flatnonzero(got != exp)[:3]:
            where = f"state {before[i]}, finite {f[i]}, loss finite {loss[i]}"
            wrong.append(f"{field}: C {after[i][field]!r} host {want[i][field]!r} ({where})")
    with np.errstate(divide="ignore", over="ignore"):
        inverse = (1.0 / want["scale"].astype(np.float64)).astype(np.float32)
    for i in np.flatnonzero(after["inv_scale"].view(np.uint32) != inverse.view(np.uint32))[:3]:
        wrong.append(f"inv_scale: C {after[i]['inv_scale']!r} for scale {want[i]['scale']!r}")
    want_events = np.asarray([bool(event) for _, event in expected])
    for i in np.flatnonzero((events != 0) != want_events)[:3]:
        wrong.append(f"floor event: C {events[i]} host {want_events[i]} (state {before[i]}, {f[i]}, {loss[i]})")
    for i in np.flatnonzero(after["floor_event"] != want_events)[:3]:
        wrong.append(f"floor event byte: C {after[i]['floor_event']} host {want_events[i]}")
    return wrong


def edge_states(config, rng: np.random.Generator, n: int) -> np.ndarray:
    """States a checkpoint may hold or a long run may reach, fields drawn independently."""
    dtype = config.scale_dtype
    scales = [
        config.initial_scale,
        config.floor_value,
        1.0,
        3.0,
        0.0,
        float("inf"),
        2.0**-149,  # the smallest float32 subnormal
        2.0**-126,  # the smallest float32 normal
        2.0**-127,
        float(np.finfo(np.float32).max),
        float(np.finfo(np.float32).max) / 2,
        2.0**127,
    ]
    if config.min_value is not None:
        scales += [config.min_value, config.min_value * 2]
    if config.max_value is not None:
        scales += [config.max_value, config.max_value / 2]
    if dtype == "float64":
        scales += [5e-324, float(np.finfo(np.float64).max), 1e300, 2.0**-1074 * 3, 1e-310]
    scales = [float(np.asarray(s, dtype)) for s in scales]  # float32 states hold float32 values
    interval = config.interval
    trackers = [INT32_MIN, INT32_MIN + 1, -2, -1, 0, 1, interval - 1, interval, interval + 1, INT32_MAX - 1, INT32_MAX]
    budgets = [INT32_MIN, INT32_MIN + 1, -1, 0, 1, 2, config.hysteresis, INT32_MAX - 1, INT32_MAX]
    counters = [0, 1, 7, INT32_MAX - 1, INT32_MAX]
    out = np.zeros(n, state_dtype(dtype))
    out["scale"] = rng.choice(scales, n)
    out["last_scale"] = rng.choice(scales, n)
    out["growth_tracker"] = rng.choice(trackers, n)
    out["hysteresis_tracker"] = rng.choice(budgets, n)
    for field in ("steps", "skipped_steps", "loss_overflows", "grad_overflows", "growths", "backoffs"):
        out[field] = rng.choice(counters, n)
    out["floor_overflows"] = rng.choice([*counters, 2, 3], n)
    out["last_reason"] = rng.choice([-1, 0, 1, 2], n)
    return out


def run_batch(so, k: int, before: np.ndarray, f: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    after = np.zeros_like(before)
    events = np.zeros(len(before), np.int32)
    so.harness_batch(
        k, before.ctypes.data, after.ctypes.data, f.ctypes.data, loss.ctypes.data, events.ctypes.data, len(before)
    )
    return after, events


def draw_configs(data: st.DataObject, per_case: int) -> list:
    configs = []
    for preset in sorted(SETTINGS):
        for mode in MODES:
            for _ in range(per_case):
                s = data.draw(SETTINGS[preset])
                if not _valid(preset, s):
                    continue
                if mode == "guard":
                    s = {k: v for k, v in s.items() if k != "init_scale"}
                configs.append(ampscale.create_scaler(preset=preset, mode=mode, on_floor="ignore", **s).config)
            # the preset's own defaults too
            configs.append(ampscale.create_scaler(preset=preset, mode=mode, on_floor="ignore").config)
    return configs


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_c_transition_equals_the_host_transition_bit_for_bit(tmp_path_factory, data: st.DataObject, seed: int) -> None:
    """Every preset x mode, drawn settings, edge states and both flags: C == HostOps.run."""
    configs = draw_configs(data, per_case=1)
    so = build(configs, tmp_path_factory.mktemp("c"))
    rng = np.random.default_rng(seed)
    for k, config in enumerate(configs):
        ops = HostOps(config)
        before = edge_states(config, rng, 400)
        f = rng.integers(0, 2, len(before), dtype=np.int32)
        loss = rng.integers(0, 2, len(before), dtype=np.int32)
        after, events = run_batch(so, k, before, f, loss)
        wrong = mismatches(config, ops, before, after, f, loss, events)
        assert not wrong, (config, wrong[:5])


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_c_trajectories_equal_the_host_trajectories(tmp_path_factory, data: st.DataObject, seed: int) -> None:
    """Long runs of finite and overflowing steps from the initial state (reaching ceilings,
    floors and scales of 0 where a preset has no floor): every state on the way, bit for bit."""
    configs = draw_configs(data, per_case=1)
    so = build(configs, tmp_path_factory.mktemp("c"))
    rng = np.random.default_rng(seed)
    for k, config in enumerate(configs):
        ops = HostOps(config)
        runs = [(bool(rng.integers(0, 2)), int(rng.integers(1, 200))) for _ in range(8)]
        flags = [value for value, length in runs for _ in range(length)][:600]
        f = np.asarray(flags, np.int32)
        loss = np.asarray(f | rng.integers(0, 2, len(f)), np.int32)
        states = np.zeros(len(f) + 1, state_dtype(config.scale_dtype))
        states[:1] = record(config, initial_values(config))
        events = np.zeros(len(f), np.int32)
        so.harness_chain(k, states.ctypes.data, f.ctypes.data, loss.ctypes.data, events.ctypes.data, len(f))
        wrong = mismatches(config, ops, states[:-1], states[1:], f, loss, events)
        assert not wrong, (config, wrong[:5])


def _negative_tracker_case() -> tuple:
    config = ampscale.create_scaler(preset="jmp", growth_interval=5).config
    states = np.zeros(4, state_dtype("float32"))
    states["scale"] = 1024.0
    states["growth_tracker"] = [-7, -3, INT32_MIN, INT32_MIN + 1]  # as load_state_dict accepts
    states["hysteresis_tracker"] = 1
    ones = np.ones(len(states), np.int32)
    return config, states, ones


def test_a_truncating_modulo_is_caught(tmp_path: pathlib.Path) -> None:
    """Mutation: C's ``%`` instead of the floor-mod diverges on the modulo presets (jmp,
    MindSpore) as soon as a tracker restored from a checkpoint is negative; the comparison
    above catches it, while the real emitter agrees."""
    config, states, ones = _negative_tracker_case()
    ops = HostOps(config)
    (tmp_path / "right").mkdir()
    right = build([config], tmp_path / "right")
    after, events = run_batch(right, 0, states, ones, ones)
    assert mismatches(config, ops, states, after, ones, ones, events) == []
    (tmp_path / "mutant").mkdir()
    mutant = build([config], tmp_path / "mutant", floor_mod=False)
    after, events = run_batch(mutant, 0, states, ones, ones)
    wrong = mismatches(config, ops, states, after, ones, ones, events)
    assert any(w.startswith("growth_tracker") for w in wrong)


@pytest.mark.skipif(not X86, reason="flush-to-zero is switched through x86's MXCSR")
def test_flush_to_zero_cannot_change_the_transition(tmp_path: pathlib.Path) -> None:
    """With flush-to-zero and denormals-are-zero (what ``--ftz=true`` or fast math does on a
    GPU) the emitted library still agrees with the host: the scale never goes subnormal (with no
    ``min_scale`` its floor is float32's smallest normal value), so nothing is flushed. Scales at
    and just above that floor, backing off and growing, with and without the flags."""
    config = ampscale.create_scaler(preset="torch", growth_interval=1).config  # no min_scale
    ops = HostOps(config)
    states = np.zeros(4, state_dtype("float32"))
    states["scale"] = [2.0**-126, 2.0**-125, 1.5 * 2.0**-126, 2.0**-124]
    states["hysteresis_tracker"] = 1
    ones = np.ones(len(states), np.int32)
    so = build([config], tmp_path)
    for finite in (np.zeros(len(states), np.int32), ones):
        for ftz in (0, 1):
            so.harness_set_ftz(ftz)
            try:
                after, events = run_batch(so, 0, states, finite, ones)
            finally:
                so.harness_set_ftz(0)
            assert mismatches(config, ops, states, after, finite, ones, events) == [], (ftz, finite[0])


def _has_fma() -> bool:
    try:
        return X86 and " fma " in pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_fma(), reason="needs an x86 CPU with FMA")
def test_contraction_finds_nothing_to_fuse(tmp_path: pathlib.Path) -> None:
    """FMA contraction (``-ffp-contract=fast -mfma``, NVRTC's default ``--fmad=true``) cannot
    change this transition: it has no multiply followed by an add to fuse (grow and shrink are
    one multiply or divide, then one rounding). Compiled that way it still agrees bit for bit;
    the CUDA build still turns contraction off (see test_cuda_build.py), so that no later
    change to the transition can be fused silently."""
    configs = [ampscale.create_scaler(preset=p, on_floor="ignore").config for p in sorted(ampscale.PRESETS)]
    so = build(configs, tmp_path, flags=("-ffp-contract=fast", "-mfma"))
    rng = np.random.default_rng(3)
    for k, config in enumerate(configs):
        before = edge_states(config, rng, 200)
        f = rng.integers(0, 2, len(before), dtype=np.int32)
        loss = rng.integers(0, 2, len(before), dtype=np.int32)
        after, events = run_batch(so, k, before, f, loss)
        assert mismatches(config, HostOps(config), before, after, f, loss, events) == []


def test_state_record_layout() -> None:
    """The record that Python views and the C struct share (checked by the C compiler too)."""
    for dtype in ("float32", "float64"):
        layout = state_dtype(dtype)
        assert layout.itemsize == STATE_BYTES
        assert layout.fields["scale"][1] == 0
        assert layout.fields["last_scale"][1] == 8
        assert layout.fields["inv_scale"][1] == 56
        assert layout.fields["found_inf"][1] % 4 == 0
        assert set(ScalerState._fields) <= set(layout.names)


def test_constants_are_exact_hex_literals() -> None:
    """Scale constants and factors are written as hex literals (no decimal round trip), and
    INT32_MIN never appears as the out-of-int literal ``-2147483648``."""
    config = ampscale.create_scaler(preset="flax").config  # floor: float32's smallest normal
    source = c_transition(config)
    assert "(0x1.0000000000000p-126f)" in source
    assert "-2147483648" not in C_PRELUDE + source
    assert "#include" not in C_PRELUDE + source


def test_tracing_emits_no_branch_and_calls_grow_once() -> None:
    config = ampscale.create_scaler(preset="megatron").config
    source = c_transition(config)
    body = source[source.index("ampscale_transition(") :]
    assert body.count("ampscale_grow(") == 1
    assert body.count("ampscale_shrink(") == 1
    assert " if " not in body
    assert "for (" not in body


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_the_split_python_transition_equals_the_whole_one(data: st.DataObject, seed: int) -> None:
    """``HostOps.run_split`` (the scale and the tracker apart, as the torch drop-in calls it)
    gives what ``HostOps.run`` gives, field by field and bit for bit, floor events included."""
    rng = np.random.default_rng(seed)
    for config in draw_configs(data, per_case=1):
        ops = HostOps(config)
        names = state_dtype(config.scale_dtype).names
        for row in edge_states(config, rng, 200).tolist():
            values = ScalerState(*(dict(zip(names, row, strict=True))[f] for f in ScalerState._fields))
            for finite in (True, False):
                for loss_ok in (True, False):
                    want, want_event = ops.run(values, finite and loss_ok, loss_ok)
                    scale, tracker, rest, event = ops.run_split(
                        values[0], values[1], values[2:], finite and loss_ok, loss_ok
                    )
                    got = ScalerState(scale, tracker, *rest)
                    case = (config.preset, values, finite, loss_ok)
                    assert bits(got.scale, config.scale_dtype) == bits(want.scale, config.scale_dtype), case
                    assert bits(got.last_scale, config.scale_dtype) == bits(want.last_scale, config.scale_dtype), case
                    assert got[1:-2] == want[1:-2], case  # the counters
                    assert got.last_reason == want.last_reason, case
                    assert type(rest) is tuple
                    assert bool(event) == bool(want_event), case


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_the_folded_finite_step_equals_the_general_one(data: st.DataObject, seed: int) -> None:
    """``HostOps.run_split_ok`` (the transition traced with both flags true and folded, which
    the torch drop-in runs on every finite step) gives what ``run_split(..., True, True)``
    gives, bit for bit, on the edge states (trackers at the interval and at the int32 limits,
    scales at the floor, the ceiling, inf and NaN); and its code holds no flag left to test."""
    rng = np.random.default_rng(seed)
    for config in draw_configs(data, per_case=1):
        ops = HostOps(config)
        assert "finite" not in ops.run.split_ok.source.split(":", 1)[1].replace("_rest", "")
        names = state_dtype(config.scale_dtype).names
        for row in edge_states(config, rng, 200).tolist():
            values = ScalerState(*(dict(zip(names, row, strict=True))[f] for f in ScalerState._fields))
            want_scale, want_tracker, want_rest, want_event = ops.run_split(
                values[0], values[1], values[2:], True, True
            )
            scale, tracker, rest, event = ops.run_split_ok(values[0], values[1], values[2:])
            case = (config.preset, values)
            assert bits(scale, config.scale_dtype) == bits(want_scale, config.scale_dtype), case
            assert tracker == want_tracker, case
            assert type(rest) is tuple, case
            assert len(rest) == len(want_rest), case
            assert bits(rest[-2], config.scale_dtype) == bits(want_rest[-2], config.scale_dtype), case
            assert rest[:-2] == want_rest[:-2], case  # the counters
            assert rest[-1] == want_rest[-1], case  # the reason
            assert bool(event) == bool(want_event), case


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
