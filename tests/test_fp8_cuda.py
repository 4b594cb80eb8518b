"""The FP8 update as one CUDA launch (CuPy, torch): its source, its host build, its launches.

No GPU here, so:

* the module of every preset is compiled to PTX by NVRTC (ampscale's own call, with the
  options the backends use) and by nvcc where installed: the kernel is there, nothing is
  flushed to zero (no ``.ftz``) and nothing is contracted (no ``fma``);
* the same source built for the host (``-DAMPSCALE_HOST_TEST``, every thread of the launch in
  turn) equals the transition emitted as Python and the NumPy backend, bit for bit, over drawn
  amax streams, skipped steps, both flag kinds and more slots than one block holds;
* the CuPy path over the fake CuPy (``tests/fake_cuda.py``: the image ampscale's NVRTC call
  made, loaded with ``Module().load``, run as the host build) and the torch path over the
  driver launcher's stand-in launch exactly one kernel per update, on the current stream,
  with the same bits as NumPy; where the kernel cannot be built, the eager path runs and says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale
import ampscale.fp8 as fp8
from ampscale._native.cuda import _plan, nvrtc
from ampscale.fp8 import _cuda
from ampscale.fp8._codegen import python_slot_transition
from ampscale.fp8._config import FP8_PRESETS, make_fp8_config
from tests.fake_cuda import HostModule, Launches, cupy_on_host, harness_for_source, run_kernel, torch_on_host
from tests.test_fp8_presets import amax_value

PRESETS = sorted(FP8_PRESETS)
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}

try:
    nvrtc.load()
    NVRTC_MISSING = None
except OSError as exc:
    NVRTC_MISSING = str(exc)


def transition_lines(ptx: str) -> str:
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be loaded: {NVRTC_MISSING}")
def test_every_presets_module_compiles_to_ptx_with_nvrtc_without_ftz_or_fma() -> None:
    for preset in PRESETS:
        source = _cuda.module_source(make_fp8_config(preset, SLOTS, history_len=16))
        image, kind = nvrtc.compile_source(source, 90, _plan.COMPILE_OPTIONS, "ampscale_fp8.cu", ptx=True)
        text = transition_lines(image.decode(errors="replace"))
        assert kind == "ptx"
        assert f".entry {_cuda.KERNEL}(" in text, preset
        assert ".ftz" not in text, preset  # subnormal amaxes and scales keep their bits
        assert not re.search(r"\bfma\.", text), preset  # every product and quotient rounds once
        assert re.search(r"(div|rcp)\.rn\.f32", text), preset  # IEEE division and reciprocal
        assert not re.search(r"(div|rcp)\.(approx|full)", text), preset  # never the approximate ones


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_the_module_compiles_with_nvcc_too(tmp_path) -> None:
    source = tmp_path / "fp8.cu"
    source.write_text(_cuda.module_source(make_fp8_config("torchao_rowwise", SLOTS, history_len=4)))
    out = tmp_path / "fp8.ptx"
    subprocess.run(
        ["nvcc", "-ptx", "-arch=sm_90", *_plan.COMPILE_OPTIONS, "-o", str(out), str(source)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    text = transition_lines(out.read_text())
    assert f".entry {_cuda.KERNEL}(" in text
    assert ".ftz" not in text
    assert not re.search(r"\bfma\.", text)


# ------------------------------------------------------------------------------ the host build


def run_host(config, state, amax, flag):
    """One launch of the host build on NumPy arrays: ``(next state, updated)``."""
    so = harness_for_source(_cuda.module_source(config))
    nxt = fp8.Fp8State(*(np.empty_like(field) for field in state))
    updated = np.zeros(config.size, np.uint8)
    fp8_max = np.asarray(config.slot_max, np.float32)
    amax = np.ascontiguousarray(amax, np.float32)
    if isinstance(flag, bool):
        flag_argument, keep = (0, _cuda.FLAG_TRUE if flag else _cuda.FLAG_FALSE), None
    else:
        keep = np.asarray(flag, np.bool_).reshape(())
        flag_argument = (keep.ctypes.data, _cuda.FLAG_BOOL)
    params = _cuda.launch_arguments(
        fp8.Fp8State(*(np.ascontiguousarray(f).ctypes.data for f in state)),
        fp8.Fp8State(*(f.ctypes.data for f in nxt)),
        amax.ctypes.data,
        fp8_max.ctypes.data,
        flag_argument,
        updated.ctypes.data,
        config.size,
    )
    run_kernel(so, _cuda.KERNEL, _cuda.grid_for(config.size), params)
    return nxt, updated.astype(bool)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    preset=st.sampled_from(PRESETS),
    length=st.sampled_from([1, 3]),
    steps=st.lists(st.tuples(st.lists(amax_value, min_size=3, max_size=3), st.booleans()), min_size=1, max_size=5),
    array_flag=st.booleans(),
)
def test_the_host_build_equals_the_python_transition_bit_for_bit(preset, length, steps, array_flag) -> None:
    config = make_fp8_config(preset, SLOTS, history_len=length)
    python = python_slot_transition(config)
    state = reference = fp8.init_state(config, "numpy")
    for amax, ok in steps:
        amax32 = np.float32(amax)
        expected = [
            python(
                float(reference.scale[i]),
                float(reference.scale_inv[i]),
                tuple(reference.history[i].tolist()),
                int(reference.filled[i]),
                int(reference.zero_amax[i]),
                int(reference.nonfinite[i]),
                int(reference.head[i]),
                float(amax32[i]),
                config.slot_max[i],
                ok,
            )
            for i in range(config.size)
        ]
        reference, reference_updated = fp8.update_state(config, reference, amax32, ok)
        state, updated = run_host(config, state, amax32, np.bool_(ok) if array_flag else ok)
        where = f"{preset} L={length} amax={amax} ok={ok}"
        for name, got, want in zip(fp8.Fp8State._fields, state, reference, strict=True):
            assert (bits(got) == bits(want)).all(), f"{name}: {got} != {want} ({where})"
        assert (updated == np.asarray(reference_updated)).all(), where
        for i, (fields, up) in enumerate(expected):
            assert bits(np.float32(fields[0])) == bits(state.scale[i]), where
            assert bits(np.float32(fields[1])) == bits(state.scale_inv[i]), where
            assert (bits(np.asarray(fields[2], np.float32)) == bits(state.history[i])).all(), where
            assert bool(up) == bool(updated[i]), where


def test_more_slots_than_a_block_and_a_broken_rule_is_caught() -> None:
    """300 slots: three blocks; every slot equals NumPy. The comparison can fail: the kernel of
    TE's unfused rounding gives other scales than the fused rule on the same amaxes."""
    config = make_fp8_config("te_delayed", 300, history_len=2)
    rng = np.random.default_rng(1)
    amax = rng.uniform(1e-3, 1e3, 300).astype(np.float32)
    state, _ = run_host(config, fp8.init_state(config, "numpy"), amax, True)
    want, _ = fp8.update_state(config, fp8.init_state(config, "numpy"), amax, True)
    assert _cuda.grid_for(300) == 3
    assert (bits(state.scale) == bits(want.scale)).all()
    assert state.steps == 1
    other, _ = run_host(config.replace(scale_rule="reciprocal"), fp8.init_state(config, "numpy"), amax, True)
    assert (bits(other.scale) != bits(want.scale)).any()


# ------------------------------------------------------------------------------ CuPy and torch


@pytest.fixture
def fresh_modules(monkeypatch):
    from ampscale._native.cuda import driver

    monkeypatch.setattr(_cuda, "_cupy_functions", {})
    monkeypatch.setattr(_cuda, "_torch_modules", {})
    monkeypatch.setattr(driver, "_warned", set())
    _cuda._cupy_fp8_max.cache_clear()
    _cuda._torch_fp8_max.cache_clear()
    yield
    _cuda._cupy_fp8_max.cache_clear()
    _cuda._torch_fp8_max.cache_clear()


# skipped steps with a device flag (step 1) and with a Python one (step 2)
STREAM = [
    ([2.0, 0.5, 40.0], True),
    ([np.inf, 0.25, 30.0], False),
    ([5.0, 0.75, 60.0], False),
    ([3.0, 0.0, np.nan], True),
    ([1e-40, 1.0, 7.0], True),
]


# torchao_delayed writes its first amax twice into the ring; msamp scales in time while warming up
@pytest.mark.parametrize("preset", ["ampscale", "te_delayed", "torchao_rowwise", "keras", "torchao_delayed", "msamp"])
def test_cupy_launches_one_kernel_per_update_built_by_ampscales_nvrtc_call(monkeypatch, fresh_modules, preset) -> None:
    with cupy_on_host(monkeypatch) as (cp, _module):
        f8 = fp8.create_fp8_scaler(preset, SLOTS, backend="cupy", history_len=3)
        reference = fp8.create_fp8_scaler(preset, SLOTS, history_len=3)
        for k, (amax, ok) in enumerate(STREAM):
            before = len(Launches.log)
            flag = cp.asarray(ok) if k % 2 else ok  # a device flag and a Python one
            f8 = f8.update(cp.asarray(np.float32(amax)), step_ok=flag)
            reference = reference.update(np.float32(amax), step_ok=ok)
            assert [name for name, _, _ in Launches.log[before:]] == [_cuda.KERNEL]
            for name, got, want in zip(fp8.Fp8State._fields, f8.state, reference.state, strict=True):
                assert (bits(np.asarray(got)) == bits(want)).all(), f"{name} at step {k}"
        source, _arch, options, name = cp._fake_state.compiled
        assert source == _cuda.module_source(f8.config)
        assert "--ftz=false" in options
        assert "--fmad=false" in options
        assert name == "ampscale_fp8.cu"
        assert type(f8.state.scale).__module__ == "cupy"


def test_cupy_donated_writes_the_ring_in_place_and_a_canonical_state_starts_at_head_0(
    monkeypatch, fresh_modules
) -> None:
    """``donate=True``: the kernel's outputs are the old arrays (one store per written amax);
    a state built by hand in canonical order (``head=None``) reads as head 0, as on NumPy."""
    with cupy_on_host(monkeypatch) as (cp, _module):
        f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="cupy", history_len=3)
        reference = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=3)
        for k, (amax, ok) in enumerate(STREAM):
            buffers = [id(field) for field in f8.state]
            before = len(Launches.log)
            f8 = f8.update(cp.asarray(np.float32(amax)), step_ok=ok, donate=True)
            reference = reference.update(np.float32(amax), step_ok=ok)
            assert [name for name, _, _ in Launches.log[before:]] == [_cuda.KERNEL]
            assert [id(field) for field in f8.state] == buffers, f"step {k}: new arrays"
            for name, got, want in zip(fp8.Fp8State._fields, f8.state, reference.state, strict=True):
                assert (bits(np.asarray(got)) == bits(want)).all(), f"{name} at step {k}"
        assert np.asarray(f8.state.head).tolist() != [0, 0, 0]  # the ring has moved on

        config = make_fp8_config("ampscale", SLOTS, history_len=3)
        canonical = fp8.init_state(config, "numpy")._replace(
            history=np.float32([[1.0, 2.0, 3.0], [0.5, 0.25, 0.0], [9.0, 8.0, 7.0]]), head=None
        )
        want, _ = fp8.update_state(config, canonical, np.float32([4.0, 0.75, 1.0]))
        on_device = fp8.Fp8State(*(None if f is None else cp.asarray(f) for f in canonical))
        got, _ = fp8.update_state(config, on_device, cp.asarray(np.float32([4.0, 0.75, 1.0])))
        assert np.asarray(got.head).tolist() == [1, 1, 1]
        for name, a, b in zip(fp8.Fp8State._fields, got, want, strict=True):
            assert (bits(np.asarray(a)) == bits(b)).all(), name


def test_cupy_without_the_kernel_runs_the_eager_path_and_warns_once(monkeypatch, fresh_modules) -> None:
    with cupy_on_host(monkeypatch) as (cp, _module):

        def refused(*args, **kwargs):
            raise nvrtc.NvrtcError("refused for the test")

        monkeypatch.setattr(nvrtc, "compiled", refused)
        amax = cp.asarray(np.float32([2.0, 4.0, 8.0]))
        # (the fake CuPy's non-ufunc functions return NumPy arrays: one eager update per scaler)
        f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="cupy", history_len=3)
        with pytest.warns(ampscale.PerformanceWarning, match="FP8 update.*refused for the test"):
            f8 = f8.update(amax)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            again = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="cupy", history_len=3).update(amax)
        assert not [name for name, _, _ in Launches.log if name == _cuda.KERNEL]
        assert np.asarray(f8.state.scale).tolist() == [224.0, 112.0, 7168.0]
        assert np.asarray(again.state.scale).tolist() == [224.0, 112.0, 7168.0]


@pytest.mark.parametrize("preset", ["ampscale", "te_delayed", "torchao_delayed"])
def test_torch_cuda_launches_one_kernel_per_update_through_the_driver_launcher(
    monkeypatch, fresh_modules, preset
) -> None:
    torch = pytest.importorskip("torch")
    built = {}

    def host_module(config, device):
        module = built.get(config)
        if module is None:
            module = built[config] = HostModule(_cuda.module_source(config))
            module.function = _cuda.KERNEL
        return module

    with torch_on_host(monkeypatch, packed_on_cpu=False) as fake:
        monkeypatch.setattr(_cuda, "is_torch_cuda", lambda tensor: True)
        monkeypatch.setattr(_cuda, "torch_module", host_module)
        fake.stream = 77
        f8 = fp8.create_fp8_scaler(preset, SLOTS, backend="torch", history_len=3)
        reference = fp8.create_fp8_scaler(preset, SLOTS, history_len=3)
        for k, (amax, ok) in enumerate(STREAM):
            before = len(Launches.log)
            flag = torch.tensor(ok) if k % 2 else ok
            f8 = f8.update(torch.tensor(amax, dtype=torch.float32), step_ok=flag)
            reference = reference.update(np.float32(amax), step_ok=ok)
            assert Launches.log[before:] == [(_cuda.KERNEL, 1, 77)]  # one launch, on torch's stream
            for name, got, want in zip(fp8.Fp8State._fields, f8.state, reference.state, strict=True):
                assert (bits(got.numpy()) == bits(want)).all(), f"{name} at step {k}"
        # every input of a launch is recorded on the stream that read it
        assert {stream for _, stream in fake.recorded} == {77}
        assert len(fake.recorded) >= len(STREAM) * (len(fp8.Fp8State._fields) + 2)
