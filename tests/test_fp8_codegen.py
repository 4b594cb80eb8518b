"""The FP8 transition traced and emitted: Python and host-compiled C against the NumPy backend.

Every preset, every margin 0 to 3 and history lengths 1, 2, 16 and 1024, both roles: one C file
holds all of these configurations (compiled once with the host's ``cc -ffp-contract=off``), and
each runs a fixed, seeded stream of amaxes (normal values, 0, subnormals, float32's smallest
normal, FLT_MAX / 2, inf, nan, runs of zeros) and skipped steps, long enough for the short rings
to wrap. The emitted Python (one slot at a time), the emitted C (all slots in one call, its
history updated in place and out of place on alternate steps) and the vectorised NumPy
transition must agree bit for bit on every field, the ring buffer and its head included. The
CUDA build of the same source is compiled by NVRTC where it is installed.
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import numpy as np
import pytest

import ampscale.fp8 as fp8
from ampscale._codegen import C_PRELUDE
from ampscale.fp8._codegen import FP8_C_PRELUDE, c_transition, python_slot_transition
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
PRESETS = sorted(FP8_PRESETS)
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}
MARGINS = (0, 1, 2, 3)
LENGTHS = (1, 2, 16, 1024)
CONFIGS = list(itertools.product(PRESETS, MARGINS, LENGTHS))
STEPS = 40
F32 = np.float32
SPECIAL = F32([0.0, 1e-45, 1e-40, np.finfo(F32).tiny, 3e-38, np.finfo(F32).max / 2, 3e38, np.inf, np.nan])


class _Slot(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("scale_inv", ctypes.c_float),
        ("filled", ctypes.c_int),
        ("zero_amax", ctypes.c_int),
        ("nonfinite", ctypes.c_int),
        ("head", ctypes.c_int),
    ]


def stream(seed: int) -> list[tuple[np.ndarray, bool]]:
    """A fixed stream of ``STEPS`` amax vectors (3 slots) and step flags."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(STEPS):
        kind = rng.random(3)
        normal = F32(2.0) ** rng.integers(-10, 14, 3).astype(F32) * rng.uniform(1, 2, 3).astype(F32)
        special = SPECIAL[rng.integers(0, len(SPECIAL), 3)]
        amax = np.where(kind < 0.55, normal, np.where(kind < 0.75, F32(0.0), special)).astype(F32)
        steps.append((amax, bool(rng.random() < 0.8)))
    return steps


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler")
    parts = [C_PRELUDE, FP8_C_PRELUDE]
    for k, (preset, margin, length) in enumerate(CONFIGS):
        parts.append(c_transition(make_fp8_config(preset, SLOTS, margin=margin, history_len=length), prefix=f"c{k}_"))
        parts.append(
            f"void run{k}(const void* in, void* out, const float* h, float* ho, const float* a, const float* m,"
            f" int ok, int* u, int n) {{ c{k}_transition(in, out, h, ho, a, m, ok, u, n); }}"
        )
    return compile_library(tmp_path_factory.mktemp("fp8c"), "\n".join(parts))


def compile_library(folder, source: str):
    path = folder / "fp8.c"
    path.write_text(source)
    lib = folder / "fp8.so"
    flags = ["-std=c11", "-O1", "-Wall", "-Werror", "-Wno-unused-function", "-ffp-contract=off", "-fPIC", "-shared"]
    subprocess.run([CC, *flags, "-o", str(lib), str(path)], check=True, timeout=600)
    return ctypes.CDLL(str(lib))


def run_c(function, config, state, amax, ok, in_place):
    n = config.size
    slots = (_Slot * n)(
        *[
            _Slot(
                float(state.scale[i]),
                float(state.scale_inv[i]),
                int(state.filled[i]),
                int(state.zero_amax[i]),
                int(state.nonfinite[i]),
                int(state.head[i]),
            )
            for i in range(n)
        ]
    )
    history = np.array(state.history, np.float32, order="C")
    out_history = history if in_place else np.empty_like(history)
    amax = np.ascontiguousarray(amax, np.float32)
    fmax = np.asarray(config.slot_max, np.float32)
    updated = np.zeros(n, np.int32)
    out = slots if in_place else (_Slot * n)()
    ptr = ctypes.c_void_p
    function(
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
    fields = {f: np.asarray([getattr(s, f) for s in out]) for f, _ in _Slot._fields_}
    return fields, out_history, updated.astype(bool)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def compare_step(config, state, amax, ok, c_result, python, where):
    """Step the NumPy transition and check C's and Python's results against it; the next state."""
    c_fields, c_history, c_updated = c_result
    py = [
        python(
            float(state.scale[i]),
            float(state.scale_inv[i]),
            tuple(state.history[i].tolist()),
            int(state.filled[i]),
            int(state.zero_amax[i]),
            int(state.nonfinite[i]),
            int(state.head[i]),
            float(amax[i]),
            float(config.slot_max[i]),
            ok,
        )
        for i in range(config.size)
    ]
    state, updated = fp8.update_state(config, state, amax, ok)
    for field in ("scale", "scale_inv"):
        assert (bits(c_fields[field]) == bits(getattr(state, field))).all(), (
            f"C {field} {c_fields[field]} != {getattr(state, field)} ({where})"
        )
    for field in ("filled", "zero_amax", "nonfinite", "head"):
        assert (c_fields[field] == getattr(state, field)).all(), f"C {field} ({where})"
    assert (bits(c_history) == bits(state.history)).all(), f"C history ({where})"
    assert (c_updated == np.asarray(updated)).all(), f"C updated ({where})"
    for i, (fields, up) in enumerate(py):
        assert bits(fields[0]) == bits(state.scale[i]), f"Python scale {fields[0]} != {state.scale[i]} ({where})"
        assert bits(fields[1]) == bits(state.scale_inv[i]), f"Python scale_inv ({where})"
        assert (bits(np.asarray(fields[2], np.float32)) == bits(state.history[i])).all(), f"Python history ({where})"
        counters = (state.filled[i], state.zero_amax[i], state.nonfinite[i], state.head[i])
        assert tuple(fields[3:]) == counters, f"Python counters ({where})"
        assert bool(up) == bool(np.asarray(updated)[i]), f"Python updated ({where})"
    return state


@pytest.mark.parametrize("preset", PRESETS)
def test_emitted_c_and_python_equal_the_numpy_transition(library, preset):
    checked = 0
    for k, (name, margin, length) in enumerate(CONFIGS):
        if name != preset:
            continue
        config = make_fp8_config(preset, SLOTS, margin=margin, history_len=length)
        python = python_slot_transition(config)
        function = getattr(library, f"run{k}")
        state = fp8.init_state(config, "numpy")
        for t, (amax, ok) in enumerate(stream(k)):
            result = run_c(function, config, state, amax, ok, in_place=t % 2 == 0)
            where = f"{preset} margin={margin} L={length} step {t} amax={amax.tolist()} ok={ok}"
            state = compare_step(config, state, amax, ok, result, python, where)
        if length <= 16:
            assert int(state.filled.max()) >= length or preset in ("msamp",), "the ring never wrapped"
        checked += 1
    assert checked == len(MARGINS) * len(LENGTHS)


def test_the_trace_has_no_value_branch_and_every_preset_emits():
    for preset in PRESETS:
        config = make_fp8_config(preset, SLOTS, history_len=4)
        assert "def _slot(" in python_slot_transition(config).source
        source = c_transition(config)
        assert " if (" not in source.split("_slot(")[1].split("AMPSCALE_FN void")[0]


def test_a_broken_c_rule_is_caught(tmp_path):
    """The comparison can fail: TE's fused update emitted in C with the unfused rounding (two
    roundings, ``reciprocal(m) * fp8_max``), compiled and run against the NumPy fused update."""
    if CC is None:
        pytest.skip("no C compiler")
    fused = make_fp8_config("te_delayed", SLOTS, history_len=3)
    wrapper = (
        "void run(const void* in, void* out, const float* h, float* ho, const float* a, const float* m, int ok,"
        " int* u, int n) { r_transition(in, out, h, ho, a, m, ok, u, n); }"
    )
    amax = np.float32([3.0, 7.0, 0.43750003])
    results = {}
    for label, config in (("broken", fused.replace(scale_rule="reciprocal")), ("good", fused)):
        folder = tmp_path / label
        folder.mkdir()
        library = compile_library(folder, "\n".join([C_PRELUDE, FP8_C_PRELUDE, c_transition(config, "r_"), wrapper]))
        results[label] = run_c(library.run, fused, fp8.init_state(fused, "numpy"), amax, True, in_place=True)
    python = python_slot_transition(fused)
    with pytest.raises(AssertionError, match="C scale"):
        compare_step(fused, fp8.init_state(fused, "numpy"), amax, True, results["broken"], python, "broken")
    compare_step(fused, fp8.init_state(fused, "numpy"), amax, True, results["good"], python, "good")


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


def test_the_stream_reaches_every_kind_of_amax():
    """The fixed streams hold what the comparison must see: 0, subnormals, inf, nan, huge values."""
    values = np.concatenate([a for k in range(len(CONFIGS)) for a, _ in stream(k)])
    for kind in (values == 0, np.isnan(values), np.isinf(values), (values > 0) & (values < np.finfo(F32).tiny)):
        assert kind.any()
    assert (values >= F32(1e38)).any()
    assert len(CONFIGS) == len(PRESETS) * len(MARGINS) * len(LENGTHS)
