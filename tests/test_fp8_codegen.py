"""The FP8 transition traced and emitted: Python and host-compiled C against the NumPy backend.

Every preset, with drawn history lengths and margins and both roles, over drawn amax streams
and skipped steps: the emitted Python (one slot at a time), the emitted C (all slots in one
call, compiled with the host's ``cc -ffp-contract=off``) and the vectorised NumPy transition
must agree bit for bit on every field and on the history. The CUDA build of the same source
is compiled by NVRTC where it is installed.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale.fp8 as fp8
from ampscale._codegen import C_PRELUDE
from ampscale.fp8._codegen import FP8_C_PRELUDE, c_transition, python_slot_transition
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config
from tests.test_fp8_presets import amax_value

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
PRESETS = sorted(FP8_PRESETS)
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}


class _Slot(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("scale_inv", ctypes.c_float),
        ("filled", ctypes.c_int),
        ("zero_amax", ctypes.c_int),
        ("nonfinite", ctypes.c_int),
    ]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler")
    configs = {(p, length): make_fp8_config(p, SLOTS, history_len=length) for p in PRESETS for length in (1, 3)}
    parts = [C_PRELUDE, FP8_C_PRELUDE]
    for k, config in enumerate(configs.values()):
        parts.append(c_transition(config, prefix=f"c{k}_"))
    tmp = tmp_path_factory.mktemp("fp8c")
    source = tmp / "fp8.c"
    source.write_text(
        "\n".join(parts)
        + "\n"
        + "\n".join(
            f"void run{k}(const void* in, void* out, const float* h, float* ho, const float* a, const float* m,"
            " int ok, int* u, int n)"
            f" {{ c{k}_transition(in, out, h, ho, a, m, ok, u, n); }}"
            for k in range(len(configs))
        )
    )
    lib = tmp / "fp8.so"
    subprocess.run(
        [
            CC,
            "-std=c11",
            "-O2",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
            "-ffp-contract=off",
            "-fPIC",
            "-shared",
            "-o",
            str(lib),
            str(source),
        ],
        check=True,
        timeout=600,
    )
    return ctypes.CDLL(str(lib)), list(configs)


def run_c(so, k, config, state, amax, ok):
    n = config.size
    slots = (_Slot * n)(
        *[
            _Slot(
                float(state.scale[i]),
                float(state.scale_inv[i]),
                int(state.filled[i]),
                int(state.zero_amax[i]),
                int(state.nonfinite[i]),
            )
            for i in range(n)
        ]
    )
    history = np.ascontiguousarray(state.history, np.float32)
    amax = np.ascontiguousarray(amax, np.float32)
    fmax = np.asarray(config.slot_max, np.float32)
    updated = np.zeros(n, np.int32)
    out = (_Slot * n)()
    out_history = np.empty_like(history)
    ptr = ctypes.c_void_p
    getattr(so, f"run{k}")(
        slots,
        out,
        ptr(history.ctypes.data),
        ptr(out_history.ctypes.data),
        ptr(amax.ctypes.data),
        ptr(fmax.ctypes.data),
        int(ok),
        ptr(updated.ctypes.data),
        n,
    )
    scale = np.asarray([s.scale for s in out], np.float32)
    scale_inv = np.asarray([s.scale_inv for s in out], np.float32)
    counters = [np.asarray([getattr(s, f) for s in out], np.int32) for f in ("filled", "zero_amax", "nonfinite")]
    return scale, scale_inv, out_history, counters, updated.astype(bool)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_emitted_c_and_python_equal_the_numpy_transition(library, data):
    so, keys = library
    k = data.draw(st.integers(0, len(keys) - 1))
    preset, length = keys[k]
    config = make_fp8_config(preset, SLOTS, history_len=length)
    python = python_slot_transition(config)
    steps = data.draw(st.integers(1, 8))
    state = fp8.init_state(config, "numpy")
    for _ in range(steps):
        amax = np.asarray(data.draw(st.lists(amax_value, min_size=3, max_size=3)), np.float32)
        ok = data.draw(st.booleans())
        c_scale, c_inv, c_hist, c_counts, c_updated = run_c(so, k, config, state, amax, ok)
        py = [
            python(
                float(state.scale[i]),
                float(state.scale_inv[i]),
                tuple(state.history[i].tolist()),
                int(state.filled[i]),
                int(state.zero_amax[i]),
                int(state.nonfinite[i]),
                float(amax[i]),
                float(config.slot_max[i]),
                ok,
            )
            for i in range(3)
        ]
        state, updated = fp8.update_state(config, state, amax, ok)
        where = f"{preset} L={length} amax={amax.tolist()} ok={ok}"
        assert (bits(c_scale) == bits(state.scale)).all(), f"C scale {c_scale} != {state.scale} ({where})"
        assert (bits(c_inv) == bits(state.scale_inv)).all(), f"C scale_inv {c_inv} != {state.scale_inv} ({where})"
        assert (bits(c_hist) == bits(state.history)).all(), f"C history ({where})"
        for got, field in zip(c_counts, ("filled", "zero_amax", "nonfinite"), strict=True):
            assert (got == getattr(state, field)).all(), f"C {field} ({where})"
        assert (c_updated == np.asarray(updated)).all(), f"C updated ({where})"
        for i, (fields, up) in enumerate(py):
            assert bits(fields[0]) == bits(state.scale[i]), f"Python scale {fields[0]} != {state.scale[i]} ({where})"
            assert bits(fields[1]) == bits(state.scale_inv[i]), f"Python scale_inv ({where})"
            assert (bits(np.asarray(fields[2], np.float32)) == bits(state.history[i])).all(), (
                f"Python history ({where})"
            )
            assert tuple(fields[3:]) == (state.filled[i], state.zero_amax[i], state.nonfinite[i]), where
            assert bool(up) == bool(np.asarray(updated)[i]), where


def test_the_trace_has_no_value_branch_and_every_preset_emits():
    for preset in PRESETS:
        config = make_fp8_config(preset, SLOTS, history_len=4)
        assert "def _slot(" in python_slot_transition(config).source
        source = c_transition(config)
        assert " if (" not in source.split("_slot(")[1].split("AMPSCALE_FN void")[0]


def test_a_broken_c_rule_is_caught(library, tmp_path):
    """The comparison can fail: TE's fused rule emitted with the unfused rounding differs."""
    fused = make_fp8_config("te_delayed", SLOTS, history_len=3)
    state = fp8.init_state(fused, "numpy")
    amax = np.float32([3.0, 7.0, 0.43750003])
    good, _ = fp8.update_state(fused, state, amax)
    other, _ = fp8.update_state(fused.replace(scale_rule="reciprocal"), state, amax)
    assert (bits(good.scale) != bits(other.scale)).any()


def test_the_cuda_source_compiles_with_nvrtc():
    """The emitted C in a CUDA kernel, every preset in one module, built by NVRTC as the CUDA
    backends build theirs (no FMA contraction, no flush-to-zero): PTX for sm_90."""
    import importlib

    try:  # the CUDA sources' package, before and after their move to ampscale/_native/cuda
        package = "ampscale._native.cuda"
        nvrtc = importlib.import_module(f"{package}.nvrtc")
    except ModuleNotFoundError:
        package = "ampscale._cuda"
        nvrtc = importlib.import_module(f"{package}.nvrtc")
    _plan = importlib.import_module(f"{package}._plan")

    try:
        nvrtc.load()
    except OSError as exc:  # pragma: no cover - NVRTC not installed
        pytest.skip(f"NVRTC unavailable: {exc}")
    parts = [C_PRELUDE, FP8_C_PRELUDE]
    for k, preset in enumerate(PRESETS):
        parts.append(c_transition(make_fp8_config(preset, SLOTS, history_len=16), prefix=f"k{k}_"))
        parts.append(
            f'extern "C" __global__ void update{k}(const struct k{k}_Slot* in, struct k{k}_Slot* out, const float* h,'
            " float* ho, const float* a, const float* m, int ok, int* u, int n) {\n"
            "    const int k = blockIdx.x * blockDim.x + threadIdx.x;\n"
            f"    if (k < n) k{k}_transition(in + k, out + k, h + 16LL * k, ho + 16LL * k, a + k, m + k, ok,"
            " u ? u + k : 0, 1);\n"
            "}\n"
        )
    ptx, kind = nvrtc.compile_source("\n".join(parts), 90, _plan.COMPILE_OPTIONS, ptx=True)
    assert kind == "ptx"
    text = ptx.decode(errors="replace")
    for k in range(len(PRESETS)):
        assert f"update{k}" in text
    assert "fma.rn.f32" not in text  # no contraction: the divisions and products round once each
