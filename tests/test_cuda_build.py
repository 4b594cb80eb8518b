"""The CuPy kernel, checked on a machine without a GPU.

* The CUDA source compiles with nvcc to PTX for sm_80 and sm_90.
* The kernel's element and chunk code is ``__host__ __device__``: built with
  ``-DAMPSCALE_HOST_TEST`` it runs on the CPU through a harness that emulates the grid, and
  its results are compared bit for bit with NumPy, for every dtype and every float16/bfloat16
  value, across chunk and alignment boundaries.
* The chunk table (the host side of the launch) is checked against its definition.
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from ampscale.backends import _cupy_plan as plan
from tests.conftest import BF16

SOURCE = pathlib.Path(plan.__file__).with_name("cupy_kernels.cu")
NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_to_ptx(tmp_path: pathlib.Path, arch: str) -> None:
    out = tmp_path / f"kernel_{arch}.ptx"
    subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-std=c++14", "-o", str(out), str(SOURCE)], check=True, timeout=300)
    ptx = out.read_text()
    assert ".entry ampscale_check_and_unscale" in ptx
    assert f".target {arch}" in ptx


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory: pytest.TempPathFactory):
    if NVCC is None:
        pytest.skip("nvcc is not installed")
    lib = tmp_path_factory.mktemp("cuda") / "libampscale_host.so"
    subprocess.run(
        [
            NVCC,
            "-DAMPSCALE_HOST_TEST",
            "-std=c++14",
            "-O2",
            "-Xcompiler",
            "-fPIC,-fno-strict-aliasing",
            "-shared",
            "-cudart",
            "static",
            "-o",
            str(lib),
            str(SOURCE),
        ],
        check=True,
        timeout=300,
    )
    so = ctypes.CDLL(str(lib))
    so.ampscale_host_check_and_unscale.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    so.ampscale_host_check_and_unscale.restype = ctypes.c_int

    def run(
        arrays: list[np.ndarray], inv: float, multiply: bool = True, chunk: int = plan.CHUNK, lanes: int = 7
    ) -> bool:
        kinds = [plan.KINDS["bfloat16" if a.dtype == BF16 else a.dtype.name] for a in arrays]
        table = plan.chunk_table([a.ctypes.data for a in arrays], [a.size for a in arrays], kinds, chunk=chunk)
        bad = so.ampscale_host_check_and_unscale(
            table.ctypes.data, len(table), float(np.float32(inv)), int(multiply), lanes
        )
        return not bad

    return run


def reference(x: np.ndarray, inv: float) -> np.ndarray:
    inv32 = np.float32(inv)
    if x.dtype == np.float64:
        return x * np.float64(inv32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(np.float32) * inv32).astype(x.dtype)


@pytest.mark.parametrize("inv", [2.0**-16, 1 / 3, 2.0**-30, 8.0, 1.0])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_half_precision_value_on_the_host(host_kernel, dtype: str, inv: float) -> None:
    np_dtype = BF16 if dtype == "bfloat16" else np.float16
    values = np.arange(65536, dtype=np.uint16).view(np_dtype)
    finite = values[np.isfinite(values.astype(np.float32))].copy()
    expected = reference(finite, inv)
    assert host_kernel([finite], inv) is True
    np.testing.assert_array_equal(finite.view(np.uint16), expected.view(np.uint16))
    for bad in values[~np.isfinite(values.astype(np.float32))][::101]:
        probe = finite.copy()
        probe[4321] = bad
        assert host_kernel([probe], inv) is False


@pytest.mark.parametrize("offset", range(8))  # where the chunk start falls in a 16-byte word
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_dtype_across_chunks_lanes_and_alignment(host_kernel, dtype: str, offset: int) -> None:
    rng = np.random.default_rng(offset)
    np_dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    for chunk, lanes in ((256, 5), (1000, 3), (plan.CHUNK, 512)):
        buffers = [(rng.standard_normal(n + offset) * 100).astype(np_dtype) for n in (1, 7, 1000, 5003, 70_001)]
        arrays = [b[offset:] for b in buffers]  # views whose start is shifted off the 16-byte grid
        expected = [reference(a, 2.0**-5) for a in arrays]
        assert host_kernel(arrays, 2.0**-5, chunk=chunk, lanes=lanes) is True
        for a, e in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
        unchanged = [a.copy() for a in arrays]
        assert host_kernel(arrays, 0.5, multiply=False, chunk=chunk, lanes=lanes) is True
        for a, e in zip(arrays, unchanged, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
        for bad in (np.inf, -np.inf, np.nan):
            for position in (0, 2500, 5002):
                probe = [a.copy() for a in arrays]
                probe[3][position] = bad
                assert host_kernel(probe, 1.0, chunk=chunk, lanes=lanes) is False
                assert host_kernel(probe, 0.5, multiply=False, chunk=chunk, lanes=lanes) is False


def test_check_only_leaves_values_untouched(host_kernel) -> None:
    x = np.full(1000, 3.0, np.float32)
    assert host_kernel([x], 0.5, multiply=False) is True
    assert (x == 3.0).all()
    assert host_kernel([x], 1.0) is True  # a multiply by exactly 1 is skipped too
    assert (x == 3.0).all()


def test_chunk_table_covers_every_element_once() -> None:
    sizes = [0, 1, 65536, 65537, 131072, 5]
    table = plan.chunk_table([1000 * (i + 1) for i in range(len(sizes))], sizes, [2, 0, 1, 3, 2, 2])
    assert table.dtype.itemsize == 32
    for index, size in enumerate(sizes):
        rows = table[table["data"] == 1000 * (index + 1)]
        covered = sorted((int(r["start"]), int(r["start"] + r["length"])) for r in rows)
        assert sum(e - s for s, e in covered) == size
        assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1))
        assert all(r["length"] <= plan.CHUNK for r in rows)
    assert plan.chunk_table([], [], []).size == 0
    w2 = plan.chunk_table(list(range(2000)), [4096] * 2000, [2] * 2000)
    assert len(w2) == 2000  # one block per W2 array, all in one launch


def test_chunk_table_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one entry per array"):
        plan.chunk_table([1, 2], [3], [2, 2])
    with pytest.raises(ValueError, match="kinds"):
        plan.chunk_table([1], [3], [9])
    with pytest.raises(ValueError, match="sizes"):
        plan.chunk_table([1], [-3], [2])
    with pytest.raises(ValueError, match="chunk"):
        plan.chunk_table([1], [3], [2], chunk=0)


def test_kernel_source_is_packaged() -> None:
    source = plan.kernel_source()
    assert 'extern "C" __global__ void ampscale_check_and_unscale' in source
    assert set(plan.KINDS.values()) == {0, 1, 2, 3}
