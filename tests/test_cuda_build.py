"""The CUDA module, checked on a machine without a GPU.

* The module of a configuration (the emitted transition + ``kernels.cu``) compiles with NVRTC
  (pip's ``nvidia-cuda-nvrtc`` wheel runs on a CPU-only machine) and with nvcc, to PTX for
  sm_80 and sm_90, with no ``fma`` and no ``.ftz`` in the PTX.
* The kernel's element, chunk, last-block and update code is ``__host__ __device__``: built by
  the host's C++ compiler with ``-DAMPSCALE_HOST_TEST`` it runs on the CPU through a harness
  that emulates the grid, and its results are compared bit for bit with NumPy (every
  float16/bfloat16 value, across chunk and alignment boundaries) and with the host transition.
* The chunk table (the host side of the launch) is checked against its definition.
* Where NVRTC or the driver cannot be loaded, the eager path runs with one warning.
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest

import ampscale
from ampscale._codegen import state_dtype
from ampscale._core import ScalerState, initial_values
from ampscale._native.cuda import _plan, driver, nvrtc
from ampscale._native.cuda._packed import decode, encode
from ampscale._ops import HostOps
from tests.conftest import BF16

NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
try:
    nvrtc.load()
    NVRTC_MISSING = None
except OSError as exc:
    NVRTC_MISSING = str(exc)

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
needs_nvrtc = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be loaded: {NVRTC_MISSING}")
CONFIGS = {
    "torch": ampscale.create_scaler(preset="torch").config,  # float32 scale, no floor
    "jmp": ampscale.create_scaler(preset="jmp").config,  # the floor-mod
    "deepspeed": ampscale.create_scaler(preset="deepspeed").config,  # float64 scale
}
BUILT = ("jmp", "deepspeed")  # compiled for the GPU: a float32 and a float64 transition


def check_ptx(ptx: str, arch: str) -> None:
    assert ".entry ampscale_step" in ptx
    assert ".entry ampscale_update" in ptx
    assert f".target {arch}" in ptx
    assert not re.search(r"\bfma\.", ptx), "contracted to FMA"
    assert ".ftz" not in ptx, "flush-to-zero"


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("preset", BUILT)
def test_module_compiles_with_nvcc(tmp_path: pathlib.Path, arch: str, preset: str) -> None:
    source = tmp_path / "module.cu"
    source.write_text(_plan.module_source(CONFIGS[preset]))
    out = tmp_path / "module.ptx"
    command = [NVCC, "--ptx", f"-arch={arch}", *_plan.COMPILE_OPTIONS, "-o", str(out), str(source)]
    subprocess.run(command, check=True, timeout=300)
    check_ptx(out.read_text(), arch)


@needs_nvrtc
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("preset", BUILT)
def test_module_compiles_with_nvrtc(arch: int, preset: str) -> None:
    ptx, kind = nvrtc.compile_source(_plan.module_source(CONFIGS[preset]), arch, _plan.COMPILE_OPTIONS, ptx=True)
    assert kind == "ptx"
    check_ptx(ptx.decode(errors="replace").rstrip("\0"), f"sm_{arch}")


def _entry(ptx: str, name: str) -> str:
    """The PTX of one kernel (``.entry name`` up to the next entry or the end)."""
    start = ptx.index(f".entry {name}")
    end = ptx.find(".entry", start + 1)
    return ptx[start : end if end != -1 else len(ptx)]


@needs_nvrtc
@pytest.mark.parametrize("arch", [75, 80, 90])
def test_bfloat16_is_narrowed_as_torch_does_on_the_device(arch: int) -> None:
    """On sm_80 and later the kernel narrows float32 to bfloat16 with the device's own
    ``cvt.rn.bf16.f32`` (what torch's c10::BFloat16 and XLA use there, so a NaN gets torch's
    bits, 0x7fff); below sm_80, where that instruction does not exist, the software rounding."""
    source = _plan.module_source(CONFIGS["torch"])
    ptx = nvrtc.compile_source(source, arch, _plan.COMPILE_OPTIONS, ptx=True)[0].decode(errors="replace")
    step = _entry(ptx, "ampscale_step")
    assert ("cvt.rn.bf16.f32" in step) is (arch >= 80)
    assert ".ftz" not in ptx


@needs_nvrtc
def test_nvrtc_builds_a_cubin_and_caches_it(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    source = _plan.module_source(CONFIGS["torch"])
    image, kind = nvrtc.compiled(source, 90, _plan.COMPILE_OPTIONS)
    assert kind == "cubin"
    assert image[:4] == b"\x7fELF"
    (cached,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # beside its lock file
    assert cached.suffix == ".cubin"
    assert cached.read_bytes().startswith(image)  # then the cache's trailer (ampscale._native._cache)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(nvrtc, "compile_source", refuse)
    assert nvrtc.compiled(source, 90, _plan.COMPILE_OPTIONS) == (image, "cubin")


@needs_nvrtc
def test_the_ptx_check_sees_contraction_and_flushing() -> None:
    """The PTX checks are not vacuous: a multiply-add compiled with NVRTC's defaults contracts
    to ``fma`` and ``--ftz=true`` marks float instructions ``.ftz``; with ampscale's options
    neither appears."""
    probe = 'extern "C" __global__ void probe(float* x, float a, float b) { x[0] = x[0] * a + b; }'
    contracted = nvrtc.compile_source(probe, 90, ("--fmad=true", "--ftz=true"), ptx=True)[0].decode()
    assert re.search(r"\bfma\.rn\.ftz\.f32", contracted)
    kept = nvrtc.compile_source(probe, 90, _plan.COMPILE_OPTIONS, ptx=True)[0].decode()
    assert not re.search(r"\bfma\.", kept)
    assert ".ftz" not in kept


@needs_nvrtc
def test_nvrtc_errors_carry_the_log() -> None:
    with pytest.raises(nvrtc.NvrtcError, match=r"undeclared|identifier"):
        nvrtc.compile_source('extern "C" __global__ void k() { undeclared_name(); }', 90)


# ------------------------------------------------------------------------------ host harness


def build_harness(config, directory: pathlib.Path) -> ctypes.CDLL:
    """The module of ``config``, built for the CPU with the grid-emulating harness."""
    if CXX is None:
        pytest.skip("no C++ compiler on PATH")
    source = directory / "module.cpp"
    source.write_text(_plan.module_source(config))
    lib = directory / "libampscale_host.so"
    command = [CXX, "-DAMPSCALE_HOST_TEST", "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
    subprocess.run([*command, "-o", str(lib), str(source)], check=True, timeout=300)
    so = ctypes.CDLL(str(lib))
    p, q = ctypes.c_void_p, ctypes.c_longlong
    so.ampscale_host_step.argtypes = [p, q, ctypes.c_ulonglong, q, q, q, ctypes.c_float, p, p, p, q, ctypes.c_int]
    so.ampscale_host_step.restype = ctypes.c_int
    so.ampscale_host_update.argtypes = [p, p, p, q, p, q, p]
    so.ampscale_host_update_fields.argtypes = [p, p, p, p, q, p, q]
    so.ampscale_host_word_count.restype = ctypes.c_longlong
    return so


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_harness(CONFIGS["torch"], tmp_path_factory.mktemp("cuda"))


def kinds_of(arrays: list[np.ndarray]) -> list[int]:
    return [_plan.KINDS["bfloat16" if a.dtype == BF16 else a.dtype.name] for a in arrays]


class Step:
    """One emulated launch of ``ampscale_step`` on host arrays."""

    def __init__(self, so, config=CONFIGS["torch"]) -> None:
        self.so = so
        self.config = config
        self.state = encode(initial_values(config), config.scale_dtype).copy().view(state_dtype("float32"))
        self.scratch = np.zeros(1, state_dtype("float32"))
        self.out = np.zeros(1, state_dtype("float32"))

    def __call__(
        self,
        arrays: list[np.ndarray],
        inv: float,
        multiply: bool = True,
        chunk: int = _plan.CHUNK,
        lanes: int = 7,
        loss: np.ndarray | None = None,
        tail: bool = False,
    ) -> tuple[bool, int]:
        """Returns ``(finite, block that ran the transition)``; with ``tail`` the flags are read
        from the next state, else from the scratch."""
        table = _plan.chunk_table([a.ctypes.data for a in arrays], [a.size for a in arrays], kinds_of(arrays), chunk)
        loss_ptr, meta, loss_chunks = 0, 0, 0
        if loss is not None:
            loss_ptr, meta = loss.ctypes.data, _plan.loss_meta(loss.size, kinds_of([loss])[0])
            loss_chunks = -(-loss.size // chunk)
        options = (_plan.MULTIPLY if multiply else 0) | (_plan.TAIL if tail else 0)
        ran = self.so.ampscale_host_step(
            table.ctypes.data,
            len(table),
            loss_ptr,
            meta,
            len(table) + loss_chunks,
            chunk,
            float(np.float32(inv)),
            self.scratch.ctypes.data,
            self.state.ctypes.data,
            self.out.ctypes.data,
            options,
            lanes,
        )
        if tail:
            return bool(self.out["finite"][0]), ran
        finite = self.scratch["found_inf"][0] == 0 and self.scratch["loss_found_inf"][0] == 0
        self.scratch[...] = 0
        return bool(finite), ran


def reference(x: np.ndarray, inv: float) -> np.ndarray:
    inv32 = np.float32(inv)
    if x.dtype == np.float64:
        return x * np.float64(inv32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(np.float32) * inv32).astype(x.dtype)


@pytest.mark.parametrize("inv", [2.0**-16, 1 / 3, 2.0**-30, 8.0, 1.0])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_half_precision_value_on_the_host(harness, dtype: str, inv: float) -> None:
    step = Step(harness)
    np_dtype = BF16 if dtype == "bfloat16" else np.float16
    values = np.arange(65536, dtype=np.uint16).view(np_dtype)
    finite = values[np.isfinite(values.astype(np.float32))].copy()
    expected = reference(finite, inv)
    ok, _ = step([finite], inv)
    np.testing.assert_array_equal(finite.view(np.uint16), expected.view(np.uint16))
    # the stored values are checked: with an inverse scale above 1 some overflow to inf
    assert ok is bool(np.isfinite(expected.astype(np.float32)).all())
    for bad in values[~np.isfinite(values.astype(np.float32))][::101]:
        probe = values[np.isfinite(values.astype(np.float32))].copy()
        probe[4321] = bad
        assert step([probe], inv)[0] is False


@pytest.mark.parametrize("offset", range(8))  # where the chunk start falls in a 16-byte word
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_dtype_across_chunks_lanes_and_alignment(harness, dtype: str, offset: int) -> None:
    step = Step(harness)
    rng = np.random.default_rng(offset)
    np_dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    for chunk, lanes in ((256, 5), (1000, 3), (_plan.CHUNK, 512)):
        buffers = [(rng.standard_normal(n + offset) * 100).astype(np_dtype) for n in (1, 7, 1000, 5003, 70_001)]
        arrays = [b[offset:] for b in buffers]  # views whose start is shifted off the 16-byte grid
        expected = [reference(a, 2.0**-5) for a in arrays]
        assert step(arrays, 2.0**-5, chunk=chunk, lanes=lanes)[0] is True
        for a, e in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
        unchanged = [a.copy() for a in arrays]
        assert step(arrays, 0.5, multiply=False, chunk=chunk, lanes=lanes)[0] is True
        for a, e in zip(arrays, unchanged, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
        for bad in (np.inf, -np.inf, np.nan):
            for position in (0, 2500, 5002):
                probe = [a.copy() for a in arrays]
                probe[3][position] = bad
                assert step(probe, 1.0, chunk=chunk, lanes=lanes)[0] is False
                assert step(probe, 0.5, multiply=False, chunk=chunk, lanes=lanes)[0] is False


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_views_at_any_element_offset_take_the_vector_path(harness, dtype: str) -> None:
    """A view into a flat buffer (Megatron/DeepSpeed gradient buffers, FSDP flat parameters,
    ``split``/``narrow``) starts off the 16-byte grid: the kernel does the elements up to the
    next 16-byte boundary one by one, then whole 16-byte words, so nearly every element goes
    through the vector path (the host build counts the words), with the same bits."""
    np_dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    size = np.dtype(np_dtype).itemsize
    per_word = 16 // size
    rng = np.random.default_rng(3)
    n = 3 * _plan.CHUNK + 123
    for offset in range(per_word):
        buffer = (rng.standard_normal(n + per_word) * 100).astype(np_dtype)
        assert buffer.ctypes.data % 16 == 0
        view = buffer[offset : offset + n]
        expected = reference(view, 2.0**-3)
        before = harness.ampscale_host_word_count()
        assert Step(harness)([view], 2.0**-3, lanes=5)[0] is True
        words = harness.ampscale_host_word_count() - before
        np.testing.assert_array_equal(view.view(np.uint8), expected.view(np.uint8))
        chunks = -(-n // _plan.CHUNK)
        # at most one partial word at each end of each chunk goes element by element
        assert words * per_word >= n - chunks * 2 * per_word, (offset, words)
    if size > 1:  # a base that is not even element-aligned: element by element, still exact
        raw = np.zeros(n * size + 1, np.uint8)
        odd = raw[1:].view(np_dtype)
        odd[...] = (rng.standard_normal(n) * 100).astype(np_dtype)
        expected = reference(odd, 0.5)
        before = harness.ampscale_host_word_count()
        assert Step(harness)([odd], 0.5, lanes=3)[0] is True
        assert harness.ampscale_host_word_count() == before
        np.testing.assert_array_equal(odd.view(np.uint8), expected.view(np.uint8))


def test_a_finite_value_that_overflows_when_unscaled_is_flagged(harness) -> None:
    """With a scale below 1 (inverse above 1) the product of a finite value can overflow; the
    kernel checks what it stores, so the step is not finite. A check alone tests the inputs."""
    step = Step(harness)
    x = np.asarray([60000.0, 1.0], np.float16)
    assert step([x.copy()], 2.0)[0] is False
    assert step([x.copy()], 0.5)[0] is True
    assert step([x.copy()], 2.0, multiply=False)[0] is True


def test_check_only_leaves_values_untouched(harness) -> None:
    step = Step(harness)
    x = np.full(1000, 3.0, np.float32)
    assert step([x], 0.5, multiply=False)[0] is True
    assert (x == 3.0).all()
    assert step([x], 1.0)[0] is True  # a multiply by exactly 1 is skipped too
    assert (x == 3.0).all()


@pytest.mark.parametrize("bad_at", ["none", "first", "middle", "last", "loss"])
def test_last_block_runs_the_transition_with_the_step_flags(harness, bad_at: str) -> None:
    """The tail: every block takes a ticket, the one that draws the last runs the emitted
    transition, writes the next state (equal to the host transition's, with the flags the
    blocks found), and resets the scratch for the next launch."""
    config = CONFIGS["torch"]
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (3000, 1, 2500, 4097)]
    loss = np.asarray([1.5, 2.5, 3.5], np.float32)
    if bad_at == "first":
        arrays[0][5] = np.inf
    elif bad_at == "middle":
        arrays[2][2400] = np.nan
    elif bad_at == "last":
        arrays[3][-1] = -np.inf
    elif bad_at == "loss":
        loss[2] = np.nan
    step = Step(harness, config)
    before = decode(step.state.view(np.uint8), "float32")
    finite, ran = step(arrays, 0.5, chunk=1024, loss=loss, tail=True)
    table = _plan.chunk_table([a.ctypes.data for a in arrays], [a.size for a in arrays], kinds_of(arrays), 1024)
    blocks = len(table) + 1  # the loss: ceil(3 / 1024) blocks
    assert ran == blocks - 1
    grads_ok, loss_ok = bad_at in ("none", "loss"), bad_at != "loss"
    want, event = HostOps(config).run(before, grads_ok and loss_ok, loss_ok)
    got = decode(step.out.view(np.uint8), "float32")
    assert got == want
    assert finite is (grads_ok and loss_ok)
    assert bool(step.out["loss_finite"][0]) is loss_ok
    assert bool(step.out["floor_event"][0]) is bool(event)
    assert step.out["inv_scale"][0] == np.float32(1.0 / np.float64(want.scale))
    assert (step.scratch["found_inf"][0], step.scratch["loss_found_inf"][0], step.scratch["ticket"][0]) == (0, 0, 0)
    assert loss[0] == 1.5  # the loss is only checked, never written


def test_update_kernel_reads_every_kind_of_flag(harness) -> None:
    config = CONFIGS["torch"]
    ops = HostOps(config)
    values = initial_values(config)._replace(growth_tracker=5)
    state = encode(values, "float32").copy().view(state_dtype("float32"))
    true_byte, false_byte = np.ones(1, np.uint8), np.zeros(1, np.uint8)
    no_inf, found_inf = np.zeros(1, np.float32), np.ones(1, np.float32)
    cases = [
        ((None, 0), (None, 0), True, True),
        ((None, 3), (None, 0), False, True),
        ((true_byte, 1), (None, 0), True, True),
        ((false_byte, 1), (None, 0), False, True),
        ((no_inf, 2), (None, 0), True, True),
        ((found_inf, 2), (None, 0), False, True),
        ((true_byte, 1), (false_byte, 1), False, False),
    ]
    for (flag, kind), (loss_flag, loss_kind), finite, loss_ok in cases:
        out = np.zeros(1, state_dtype("float32"))
        harness.ampscale_host_update(
            state.ctypes.data,
            out.ctypes.data,
            None if flag is None else flag.ctypes.data,
            kind,
            None if loss_flag is None else loss_flag.ctypes.data,
            loss_kind,
            None,
        )
        want, _ = ops.run(values, finite, loss_ok)
        assert decode(out.view(np.uint8), "float32") == want
        assert bool(out["finite"][0]) is finite
        assert bool(out["loss_finite"][0]) is loss_ok


def test_record_encoding_round_trips() -> None:
    for preset, config in CONFIGS.items():
        values = initial_values(config)._replace(growth_tracker=-5, steps=2**31 - 1, last_reason=2)
        raw = encode(values, config.scale_dtype)
        assert raw.nbytes == 80
        assert decode(raw, config.scale_dtype) == values, preset
        record = raw.view(state_dtype(config.scale_dtype))[0]
        assert record["inv_scale"] == np.float32(1.0 / values.scale)
        assert (record["finite"], record["loss_finite"], record["found_inf"], record["ticket"]) == (1, 1, 0, 0)
    zero = initial_values(CONFIGS["torch"])._replace(scale=0.0)
    assert np.isinf(encode(zero, "float32").view(state_dtype("float32"))[0]["inv_scale"])


# ------------------------------------------------------------------------------ the table


def test_chunk_table_covers_every_element_once() -> None:
    sizes = [0, 1, 65536, 65537, 131072, 5]
    table = _plan.chunk_table([1000 * (i + 1) for i in range(len(sizes))], sizes, [2, 0, 1, 3, 2, 2])
    assert table.dtype.itemsize == 32
    for index, size in enumerate(sizes):
        rows = table[table["data"] == 1000 * (index + 1)]
        covered = sorted((int(r["start"]), int(r["start"] + r["length"])) for r in rows)
        assert sum(e - s for s, e in covered) == size
        assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1))
        assert all(r["length"] <= _plan.CHUNK for r in rows)
    assert _plan.chunk_table([], [], []).size == 0
    w2 = _plan.chunk_table(list(range(2000)), [4096] * 2000, [2] * 2000)
    assert len(w2) == 2000  # one block per W2 array, all in one launch


def test_chunk_table_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one entry per array"):
        _plan.chunk_table([1, 2], [3], [2, 2])
    with pytest.raises(ValueError, match="kinds"):
        _plan.chunk_table([1], [3], [9])
    with pytest.raises(ValueError, match="sizes"):
        _plan.chunk_table([1], [-3], [2])
    with pytest.raises(ValueError, match="chunk"):
        _plan.chunk_table([1], [3], [2], chunk=0)


def test_module_source_is_packaged_and_header_free() -> None:
    source = _plan.module_source(CONFIGS["jmp"])
    assert 'extern "C" __global__ void ampscale_step' in source
    assert 'extern "C" __global__ void ampscale_update' in source
    assert "#include" not in source
    assert "ampscale_floormod" in source
    assert set(_plan.KINDS.values()) == {0, 1, 2, 3}


# ------------------------------------------------------------------------------ fallback


def test_without_the_driver_the_eager_path_runs_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libcuda.so.1, NVRTC or the C extension cannot be loaded (this machine has no GPU
    driver), no module is made, and one PerformanceWarning per framework says why."""
    monkeypatch.setattr(driver, "_reason", [])
    monkeypatch.setattr(driver, "_warned", set())
    reason = driver.unavailable_reason()
    if reason is None:
        pytest.skip("the CUDA driver and NVRTC load here")
    config = ampscale.create_scaler().config
    with pytest.warns(ampscale.PerformanceWarning, match=re.escape(reason)) as caught:
        assert driver.module_for(config, 0, "torch") is None
    assert len(caught) == 1
    assert "eager" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert driver.module_for(ampscale.create_scaler(preset="jmp").config, 0, "torch") is None


@pytest.mark.parametrize("missing", ["driver", "nvrtc"])
def test_the_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setattr(driver, "_reason", [])

    def no_driver():
        raise OSError("the CUDA driver libcuda.so.1 could not be loaded: gone")

    def no_nvrtc():
        raise OSError("the NVRTC library (libnvrtc) was not found; tried nowhere")

    monkeypatch.setattr(driver, "launcher", no_driver if missing == "driver" else lambda: None)
    monkeypatch.setattr(nvrtc, "load", no_nvrtc)
    reason = driver.unavailable_reason()
    assert reason is not None
    assert ("libcuda.so.1" if missing == "driver" else "NVRTC") in reason


def test_scaler_state_round_trips_through_the_record() -> None:
    """A state dict loaded into a record and read back is unchanged, for every preset."""
    for preset in ampscale.PRESETS:
        config = ampscale.create_scaler(preset=preset).config
        values = ScalerState(*initial_values(config))
        assert decode(encode(values, config.scale_dtype), config.scale_dtype) == values
