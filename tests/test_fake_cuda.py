"""The CPU stand-ins of ``tests/fake_cuda.py`` behave as CuPy does where the GPU tests rely on it.

The GPU-only tests run once against these stand-ins before a GPU run (``AMPSCALE_FAKE_CUPY=1
python -m pytest -m gpu -k cupy``), so a test that fails there must fail because of the code
under test, not because the stand-in differs from CuPy: in-place operators return the array
itself, 0-d results stay arrays, streams can begin and end a capture, and a one-rank NCCL
communicator exists.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.fake_cuda import cupy_namespace, cupy_on_host, fake_cupy

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_in_place_operators_return_the_array_itself() -> None:
    cp = fake_cupy()
    velocity = cp.asarray(np.array([0.5], np.float32))
    same = velocity
    velocity *= 0.9
    assert velocity is same
    assert type(velocity + 1) is cp.ndarray


def test_the_namespace_gives_cupy_arrays_and_no_scalars() -> None:
    cp = fake_cupy()
    xp = cupy_namespace(cp)
    count = xp.where(xp.asarray(True), cp.asarray(np.int32(8)), cp.asarray(np.int32(7)))
    assert type(count) is cp.ndarray
    assert count.shape == ()
    assert type(count + 1) is cp.ndarray  # a NumPy result would turn into a scalar here
    assert type(xp.sum(cp.asarray(np.ones(3, np.float32)))) is cp.ndarray
    assert xp.float32 is np.float32


def test_streams_capture_and_nccl_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    with cupy_on_host(monkeypatch) as (cp, _):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            assert cp.cuda.get_current_stream().is_capturing()
            stream.end_capture()
            assert not stream.is_capturing()
        from cupy.cuda import nccl

        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        send, receive = np.array([3.0, 1.0], np.float32), np.zeros(2, np.float32)
        comm.allReduce(send.ctypes.data, receive.ctypes.data, 2, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, 0)
        assert receive.tolist() == [3.0, 1.0]  # one rank: the maximum is its own value


def test_a_module_of_the_tests_own_runs_its_host_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    source = (
        "#if defined(__CUDACC__) || defined(__CUDACC_RTC__)\n"
        'extern "C" __global__ void twice(float* x, long long n) {}\n'
        "#else\n"
        'extern "C" void twice(float* x, long long n) { for (long long i = 0; i < n; i++) x[i] *= 2; }\n'
        "#endif\n"
    )
    with cupy_on_host(monkeypatch) as (cp, _):
        from ampscale._native.cuda import nvrtc

        image, _ = nvrtc.compiled(source, 90)
        module = cp.cuda.function.Module()
        module.load(image)
        x = cp.asarray(np.arange(4, dtype=np.float32))
        module.get_function("twice")((1,), (128,), (x, np.int64(4)))
        assert x.tolist() == [0.0, 2.0, 4.0, 6.0]


#: GPU tests that failed on the whole-session fake only because it differed from CuPy
FORMERLY_FAILING = [
    "tests/test_cuda_gpu.py::test_emitted_transitions_on_the_device_in_one_module[cupy]",
    "tests/test_cuda_gpu.py::test_graph_capture_is_refused_before_anything_changes[cupy]",
    "tests/test_cupy.py::test_nccl_agreement_with_one_rank",
    "tests/test_in_place.py::test_writes_into_the_optimizer_state_are_refused_too[cupy]",
    "tests/test_scaler.py::test_step_applies_or_skips_bitwise[cupy]",
]


def test_the_whole_session_fake_runs_gpu_tests_that_need_faithful_cupy(tmp_path: pathlib.Path) -> None:
    """``AMPSCALE_FAKE_CUPY=1`` (``tests/conftest.py``): the GPU tests that needed a capture, NCCL,
    0-d arrays or in-place operators pass on the stand-in (a subprocess: it replaces cupy)."""
    env = dict(os.environ, AMPSCALE_FAKE_CUPY="1", AMPSCALE_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "gpu", *FORMERLY_FAILING],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(FORMERLY_FAILING)} passed" in done.stdout
