"""The CUDA FP8 pass (``fp8_kernels.cu``), checked on a machine without a GPU.

* The module compiles with NVRTC and with nvcc to PTX for sm_80 and sm_90, with no ``.ftz`` and
  no ``fma`` (the product x * scale must be the IEEE one), with and without the FP8 transition
  in the last block (``ampscale_fp8_pass_step``).
* The kernel's element, chunk and last-block code is ``__host__ __device__``: built by the host
  compiler (``-DAMPSCALE_HOST_TEST``) it runs on the CPU through a harness that emulates the grid
  (blocks, lanes, the ticket), and gives the NumPy references' bits: amaxes (NaN canonical),
  payloads in every format with NumPy's and torch's NaN bytes, clipped counts, the finite flag,
  on every dtype, inf and NaN anywhere, empty tensors, views at odd offsets (the scalar path)
  and aligned buffers (16-byte words), and leaves its scratch zeroed for the next launch.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ampscale.fp8 as fp8
from ampscale._native.cuda import _fp8, _plan, nvrtc
from ampscale.fp8 import _fused
from tests.fake_cuda import harness_for_source

NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
try:
    nvrtc.load()
    NVRTC_MISSING = None
except OSError as exc:
    NVRTC_MISSING = str(exc)

DTYPES = ["float16", "bfloat16", "float32", "float64"]
FORMATS = sorted(fp8.FORMATS)
CONFIG = fp8.create_fp8_scaler("te_delayed", slots=3, history_len=4).config


def _check_ptx(ptx: str, arch: str, step: bool) -> None:
    assert ".entry ampscale_fp8_pass(" in ptx
    assert ".entry ampscale_fp8_jax_pass(" in ptx  # the JAX CUDA handler's
    assert (".entry ampscale_fp8_pass_step(" in ptx) is step
    for name in ("ampscale_fp8_pass", "ampscale_fp8_jax_pass"):
        start = ptx.index(f".entry {name}(")
        end = ptx.find(".entry", start + 1)
        # no stack: the unpacked words stay in registers, the JAX table is read from the parameters
        assert "__local_depot" not in ptx[start : end if end != -1 else len(ptx)], name
    assert f".target {arch}" in ptx
    assert not re.search(r"\bfma\.", ptx), "contracted to FMA"
    assert ".ftz" not in ptx, "flush-to-zero"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("step", [False, True])
def test_the_module_compiles_with_nvcc(tmp_path: Path, arch: str, step: bool) -> None:
    source = tmp_path / "fp8.cu"
    source.write_text(_fp8.module_source(CONFIG if step else None))
    out = tmp_path / "fp8.ptx"
    command = [NVCC, "--ptx", f"-arch={arch}", *_plan.COMPILE_OPTIONS, "-o", str(out), str(source)]
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    _check_ptx(out.read_text(), arch, step)


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be loaded: {NVRTC_MISSING}")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("step", [False, True])
def test_the_module_compiles_with_nvrtc(arch: int, step: bool) -> None:
    source = _fp8.module_source(CONFIG if step else None)
    ptx, kind = nvrtc.compile_source(source, arch, _plan.COMPILE_OPTIONS, ptx=True)
    assert kind == "ptx"
    _check_ptx(ptx.decode(errors="replace").rstrip("\0"), f"sm_{arch}", step)


# ------------------------------------------------------------------------------ the host harness


@pytest.fixture(scope="module")
def harness() -> Any:
    so = harness_for_source(_fp8.module_source(CONFIG))
    p, q = ctypes.c_void_p, ctypes.c_longlong
    so.ampscale_fp8_host_pass.argtypes = [p, q, q, p, p, q, q, p, p, p, p, p, p, ctypes.c_int]
    so.ampscale_fp8_host_pass.restype = ctypes.c_int
    # the kernel's parameters after the emulated grid and lanes: 12 of the pass, 16 state arrays, 4 more
    so.ampscale_fp8_host_pass_step.argtypes = [q, ctypes.c_int, *[ctypes.c_ulonglong] * (12 + 16 + 4)]
    so.ampscale_fp8_host_pass_step.restype = ctypes.c_int
    return so


def _ptr(a: np.ndarray | None) -> int:
    return 0 if a is None else a.ctypes.data


class Pass:
    """One emulated launch over NumPy arrays, its scratch kept between launches (as on a stream)."""

    def __init__(self, so: Any, slots: int) -> None:
        self.so = so
        self.top = np.zeros(slots, np.uint32)
        self.clipped = np.zeros(slots, np.uint64)
        self.ticket = np.zeros(1, np.uint32)

    def run(
        self,
        arrays: list[np.ndarray],
        fmt: str | None = None,
        scales: list[float] | None = None,
        nan_byte: int | None = None,
        divide: bool = False,
        lanes: int = 4,
        chunk: int = 1000,
        step: list[int] | None = None,
        shift: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], bool]:
        n = len(arrays)
        # every payload in one buffer, as the glue allocates it; ``shift`` moves them all off
        # their 16-byte alignment (the kernel's scalar path)
        offsets, total = _fp8.payload_offsets([a.size for a in arrays])
        buffer = np.full(total + 64, 0xAA, np.uint8)
        base = buffer[(-buffer.ctypes.data) % 16 + shift :]
        outs = [base[o : o + a.size] for o, a in zip(offsets, arrays, strict=True)]
        table = _fp8.chunk_table(
            [a.ctypes.data for a in arrays],
            offsets,
            [a.size for a in arrays],
            [_fused.KINDS[a.dtype.name] for a in arrays],
            chunk=chunk,
        )
        code = None if fmt is None else _fused.FORMAT_CODES[fmt]
        options = _fp8.options(code, divide, 0 if nan_byte is None else nan_byte)
        amaxes = np.full(n, -1.0, np.float32)
        counts = np.full(n, -1, np.int64)
        finite = np.full(1, 7, np.uint8)
        scale_array = np.asarray(scales if scales is not None else [1.0] * n, np.float32)
        blocks = max(1, table.size)
        args = [
            _ptr(table),
            table.size,
            _ptr(base) if fmt else 0,
            _ptr(scale_array),
            n,
            options,
            _ptr(self.top),
            _ptr(self.clipped),
            _ptr(self.ticket),
            _ptr(amaxes),
            _ptr(counts),
            _ptr(finite),
        ]
        if step is None:
            finished = self.so.ampscale_fp8_host_pass(*args[:2], blocks, *args[2:], lanes)
        else:  # the state's arguments, in the kernel's order after the pass's
            finished = self.so.ampscale_fp8_host_pass_step(blocks, lanes, *args, *step)
        assert finished == blocks - 1  # the last block finished
        assert not self.top.any()  # the scratch is clean for the next launch
        assert not self.clipped.any()
        assert self.ticket[0] == 0
        return amaxes, counts, outs, bool(finite[0])


def _leaves(dtype: str, seed: int) -> list[np.ndarray]:
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(9000) * np.exp(rng.uniform(-6, 6, 9000))).astype(np_dtype)
    leaves = [base[k : k + n] for k, n in [(0, 3000), (1, 2999), (3, 1), (5, 17), (0, 0), (7, 4100)]]
    leaves = [leaf.copy() if k % 3 == 0 else leaf for k, leaf in enumerate(leaves)]  # aligned and not
    leaves[1][0] = np.nan  # a head
    leaves[5][2050] = -np.inf  # the middle of the words
    leaves[5][-1] = np.nan  # a tail
    leaves.append(np.array([ml_dtypes.finfo(np_dtype).smallest_subnormal, -0.0], np_dtype))
    return leaves


def _exact(a: np.ndarray) -> np.float32:
    return np.float32(_fused.bits_amax_numpy(a))


@pytest.mark.parametrize("lanes", [1, 4, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_is_the_exact_reference(harness: Any, dtype: str, lanes: int) -> None:
    leaves = _leaves(dtype, seed=lanes)
    launch = Pass(harness, len(leaves))
    amaxes, _, _, finite = launch.run(leaves, lanes=lanes)
    assert amaxes.view(np.uint32).tolist() == np.array([_exact(a) for a in leaves]).view(np.uint32).tolist()
    assert not finite
    for a in leaves:
        a[~np.isfinite(a.astype(np.float64))] = 1
    amaxes, _, _, finite = launch.run(leaves, lanes=lanes)  # the same scratch, reset by the last block
    assert finite
    assert amaxes.view(np.uint32).tolist() == np.array([_exact(a) for a in leaves]).view(np.uint32).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_is_the_reference_cast(harness: Any, dtype: str, fmt: str) -> None:
    leaves = _leaves(dtype, seed=11)
    scales = [2.0 ** (3 * k - 6) for k in range(len(leaves))]
    launch = Pass(harness, len(leaves))
    for framework, divide, shift in [("numpy", False, 0), ("torch", False, 1), ("numpy", True, 2), ("torch", True, 0)]:
        # the NaN byte of each framework's own cast; payloads aligned and not
        amaxes, counts, outs, _ = launch.run(
            leaves, fmt, scales, _fused.nan_byte(fmt, framework), divide=divide, lanes=8, shift=shift
        )
        for k, a in enumerate(leaves):
            with np.errstate(over="ignore"):
                expected, expected_count = _fused.reference_cast_numpy(a, scales[k], fmt, divide)
            want = expected.view(np.uint8).reshape(-1).copy()
            if framework == "torch" and fmt == "e5m2":
                want[np.isnan(expected.astype(np.float32)).reshape(-1)] |= 0x01  # torch's 0x7f
            assert (outs[k] == want).all(), (k, np.nonzero(outs[k] != want)[0][:5])
            assert counts[k] == expected_count
            assert amaxes[k].view(np.uint32) == _exact(a).view(np.uint32)


def test_cast_rounds_every_boundary(harness: Any) -> None:
    """The stratified float32 sample of the cast tests (every exponent, the mantissas next to
    each rounding boundary, inf, NaN), through the words and the scalar path."""
    from tests.test_fp8_cast import sample

    x = sample()
    launch = Pass(harness, 2)
    for fmt in FORMATS:
        _, counts, outs, _ = launch.run(
            [x, x[1:]], fmt, [1.0, 1.0], _fused.nan_byte(fmt, "numpy"), chunk=1 << 16, shift=len(fmt) % 3
        )
        for k, values in enumerate([x, x[1:]]):
            expected, count = _fused.reference_cast_numpy(values, 1.0, fmt, False)
            assert (outs[k] == expected.view(np.uint8)).all()
            assert counts[k] == count


def _step_arguments(
    state: Any, nxt: Any, fp8_max: np.ndarray, flag: bool | np.ndarray, updated: np.ndarray
) -> list[int]:
    """``ampscale_fp8_pass_step``'s arguments after the pass's: every field of the state in and
    out, each slot's format maximum, the step's flag (a value, or a bool byte) and ``updated``."""
    from ampscale.fp8 import _cuda

    if isinstance(flag, np.ndarray):
        kind, pointer = _cuda.FLAG_BOOL, flag.ctypes.data
    else:
        kind, pointer = (_cuda.FLAG_TRUE if flag else _cuda.FLAG_FALSE), 0
    return [
        *(f.ctypes.data for f in state),
        *(f.ctypes.data for f in nxt),
        fp8_max.ctypes.data,
        pointer,
        kind,
        updated.ctypes.data,
    ]


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("preset", ["te_delayed", "torchao_delayed", "msamp", "keras"])
def test_the_last_block_runs_the_whole_fp8_update(preset: str, donate: bool) -> None:
    """``ampscale_fp8_pass_step``: the update of every slot on the pass's own amaxes, every field
    as ``Fp8Scaler.update`` computes it on the host (the ring and its head, the counters, the
    step count), over more steps than the history holds, skipped steps with a bool byte and with
    a value; ``donate``: the state's own arrays as the outputs (one store per written amax)."""
    scaler = fp8.create_fp8_scaler(preset, slots=3, history_len=4)
    so = harness_for_source(_fp8.module_source(scaler.config))
    p, q = ctypes.c_void_p, ctypes.c_longlong
    so.ampscale_fp8_host_pass.argtypes = [p, q, q, p, p, q, q, p, p, p, p, p, p, ctypes.c_int]
    so.ampscale_fp8_host_pass.restype = ctypes.c_int
    so.ampscale_fp8_host_pass_step.argtypes = [q, ctypes.c_int, *[ctypes.c_ulonglong] * (12 + 16 + 4)]
    so.ampscale_fp8_host_pass_step.restype = ctypes.c_int
    launch = Pass(so, 3)
    rng = np.random.default_rng(2)
    fp8_max = np.asarray(scaler.config.slot_max, np.float32)
    state = fp8.Fp8State(*(np.array(f) for f in scaler.state))
    reference = scaler.state
    flags: list[Any] = [True, np.ones((), np.bool_), False, np.zeros((), np.bool_), True, True]
    for step, flag in enumerate(flags):
        leaves = [rng.standard_normal(n).astype(np.float32) * s for n, s in [(5000, 3.0 + step), (70, 1e-3), (0, 1.0)]]
        if step == 4:
            leaves[1][3] = np.inf
        nxt = state if donate else fp8.Fp8State(*(np.empty_like(f) for f in state))
        updated = np.full(3, 7, np.uint8)
        amaxes, _, _, finite = launch.run(leaves, step=_step_arguments(state, nxt, fp8_max, flag, updated))
        assert finite == (step != 4)
        reference, want_updated = fp8.update_state(scaler.config, reference, amaxes, bool(flag))
        for name, got, want in zip(fp8.Fp8State._fields, nxt, reference, strict=True):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (name, step)
        assert updated.tolist() == np.asarray(want_updated, np.uint8).tolist(), step
        state = nxt
    assert int(state.steps) == len(flags)


def test_the_table_rows_carry_each_tensors_slot() -> None:
    assert _fp8.payload_offsets([5, 0, 12, 16]) == ([0, 16, 16, 32], 48)
    table = _fp8.chunk_table([1000, 2000, 3000], [10, 0, 30], [5, 0, 12], [2, 0, 3], chunk=5)
    assert table["meta"].tolist() == [(0 << 8) | 2, (2 << 8) | 3, (2 << 8) | 3, (2 << 8) | 3]
    assert table["out"].tolist() == [10, 30, 30, 30]
    assert table["start"].tolist() == [0, 0, 5, 10]
    assert table["length"].tolist() == [5, 5, 5, 2]
    with pytest.raises(ValueError, match="one entry per tensor"):
        _fp8.chunk_table([1], [], [1], [2])


# ------------------------------------------------------------------------------ the glue, on stand-ins


class HostKernel:
    """``ampscale_fp8_pass`` as the torch glue launches it, run by the host build on CPU memory."""

    def __init__(self) -> None:
        self.so = harness_for_source(_fp8.module_source())
        self.launches = 0

    def launch(self, grid: int, block: int, stream: int, *params: int) -> None:
        from tests.fake_cuda import run_kernel

        assert block == _fp8.THREADS
        self.launches += 1
        run_kernel(self.so, "ampscale_fp8_pass", grid, list(params))


@pytest.fixture
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> Any:
    from collections import OrderedDict

    from ampscale.fp8 import _fused_cuda

    monkeypatch.setattr(_fused_cuda, "_kernels", {})
    monkeypatch.setattr(_fused_cuda, "_tables", OrderedDict())
    monkeypatch.setattr(_fused_cuda, "_scratch", {})
    return _fused_cuda


def _mixed_host_leaves() -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    leaves = [
        (rng.standard_normal(n) * 100).astype(d)
        for n, d in [(70_000, "float32"), (333, "float16"), (0, "float32"), (5000, "float64")]
    ]
    leaves[0][69_999] = np.nan
    leaves[3][7] = -np.inf
    return leaves


def test_torch_cuda_glue_runs_one_launch_with_the_references_bits(
    fresh_caches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch CUDA code path (table, scratch, one payload buffer, outputs), with CPU tensors
    and the kernel's host build standing in for the device."""
    torch = pytest.importorskip("torch")
    from ampscale.fp8 import _fused_torch

    kernel = HostKernel()
    monkeypatch.setattr(fresh_caches, "_torch_kernel", lambda device, source=None: kernel)
    monkeypatch.setattr(_fused_torch, "_kernel_path", lambda device: True)
    host = _mixed_host_leaves()
    leaves = [torch.from_numpy(a) for a in host] + [torch.randn(30, 20).t(), torch.ones(3, dtype=torch.bfloat16)]
    amaxes, finite = fp8.amax(leaves, with_finite=True)
    assert kernel.launches == 1
    assert finite.dtype == torch.bool
    assert finite.shape == ()
    assert not bool(finite)
    expected = [_exact(a) for a in host] + [_exact(t.numpy()) for t in leaves[4:5]] + [np.float32(1.0)]
    assert amaxes.numpy().view(np.uint32).tolist() == np.array(expected).view(np.uint32).tolist()
    fresh_caches._tables.clear()
    fp8.amax(leaves[:4])
    fp8.amax(leaves[:4])
    assert kernel.launches == 3
    assert len(fresh_caches._tables) == 1  # the same tensors: the table made once, then reused
    scales = torch.tensor([0.5, 4.0, 1.0, 1000.0, 2.0, 3.0])
    for fmt in FORMATS:
        payloads, cast_amaxes, clipped = fp8.amax_and_cast(leaves, scales, fmt)
        assert cast_amaxes.numpy().tobytes() == amaxes.numpy().tobytes()
        for k, t in enumerate(leaves):
            reference = fp8.quantize(t, scales[k], fmt)
            assert payloads[k].dtype == reference.dtype
            assert payloads[k].shape == t.shape
            assert torch.equal(payloads[k].view(torch.uint8), reference.view(torch.uint8)), (fmt, k)
            product = t.float() * scales[k]
            assert clipped[k].item() == int((product.abs() > fp8.FORMATS[fmt]).sum())


def test_torch_cuda_glue_steps_aside_for_modes_and_missing_kernels(
    fresh_caches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from ampscale.fp8 import _fused_torch

    kernel = HostKernel()
    monkeypatch.setattr(fresh_caches, "_torch_kernel", lambda device, source=None: kernel)
    monkeypatch.setattr(_fused_torch, "_kernel_path", lambda device: True)
    leaves = [torch.tensor([1.0, -5.0]), torch.tensor([float("nan")])]

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with Watch():  # a mode must see every operation: the torch operations run instead
        amaxes = fp8.amax(leaves)
    assert kernel.launches == 0
    assert amaxes.numpy().view(np.uint32).tolist() == [0x40A00000, 0x7FC00000]
    monkeypatch.setattr(fresh_caches, "_torch_kernel", lambda device, source=None: None)  # no driver / NVRTC
    assert fp8.amax(leaves).numpy().view(np.uint32).tolist() == [0x40A00000, 0x7FC00000]


def test_cupy_glue_on_the_fake_cupy(fresh_caches: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy's path: ampscale's NVRTC binary loaded into (the fake) CuPy, one launch, uint8
    payloads of the format's bytes; and the eager path (no kernel) with the same bytes."""
    from tests.fake_cuda import Launches, cupy_on_host

    with cupy_on_host(monkeypatch) as (cp, _backend):
        host = _mixed_host_leaves()
        leaves = [cp.asarray(a) for a in host]
        Launches.log.clear()
        amaxes, finite = fp8.amax(leaves, with_finite=True)
        assert Launches.names() == ["ampscale_fp8_pass"]
        assert (
            np.asarray(amaxes).view(np.uint32).tolist() == np.array([_exact(a) for a in host]).view(np.uint32).tolist()
        )
        assert not bool(finite)
        scales = cp.asarray(np.float32([0.5, 4.0, 1.0, 1000.0]))
        for fmt in FORMATS:
            payloads, _, clipped = fp8.amax_and_cast(leaves, scales, fmt, divide=fmt == "e5m2")
            for k, a in enumerate(host):
                expected, count = _fused.reference_cast_numpy(a, float(scales[k]), fmt, fmt == "e5m2")
                assert payloads[k].dtype == np.uint8
                assert payloads[k].shape == a.shape
                assert (np.asarray(payloads[k]) == expected.view(np.uint8)).all(), (fmt, k)
                assert int(clipped[k]) == count
        monkeypatch.setattr(fresh_caches, "_cupy_kernel", lambda device_id, source=None: None)
        Launches.log.clear()
        eager = fp8.amax_and_cast(leaves, scales, "e4m3fn")
        assert Launches.names() == []
        for k, a in enumerate(host):
            expected, count = _fused.reference_cast_numpy(a, float(scales[k]), "e4m3fn", False)
            assert (np.asarray(eager[0][k]) == expected.view(np.uint8)).all()
            assert int(eager[2][k]) == count


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_array_encoder_of_the_eager_cupy_path_is_the_reference(fmt: str) -> None:
    from tests.test_fp8_cast import sample

    x = sample()
    code, clipped = _fused.xp_encode(x, fmt, _fused.nan_byte(fmt, "cupy"), np)
    expected, count = _fused.reference_cast_numpy(x, 1.0, fmt, False)
    assert (code == expected.view(np.uint8)).all()
    assert int(clipped.sum()) == count


def test_the_array_amax_of_the_eager_cupy_path_is_exact() -> None:
    """The eager path's amax in array operations (NumPy standing in for CuPy), every dtype."""
    leaves = [a for dtype in DTYPES for a in _leaves(dtype, seed=3)]
    got = _fused._xp_amax(leaves)
    assert got.view(np.uint32).tolist() == np.array([_exact(a) for a in leaves]).view(np.uint32).tolist()
