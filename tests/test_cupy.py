"""The CuPy backend on a GPU (skipped without one; run by scripts/gpu-check.sh).

The shared contract tests also run on CuPy through ``tests/conftest.py`` when a device exists.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:
    pytest.skip("no CUDA device", allow_module_level=True)

import ampscale  # noqa: E402
from ampscale.backends import cupy as cupy_backend  # noqa: E402

pytestmark = pytest.mark.gpu


def test_one_launch_for_thousands_of_arrays_of_mixed_dtypes() -> None:
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal(4096).astype(dt) for dt in (np.float32, np.float16, np.float64) for _ in range(700)]
    arrays = [cupy.asarray(h) for h in hosts]
    scaler = ampscale.create_scaler(backend="cupy", init_scale=8.0)
    out, finite = scaler.unscale(arrays)
    rows, strided = cupy_backend.BACKEND._rows(arrays)
    assert not strided
    assert len(rows[arrays[0].data.device_id]) == 2100  # one table row (one block) per array
    assert bool(finite)
    for h, a in zip(hosts, out, strict=True):
        expected = (
            h * np.float64(np.float32(1 / 8))
            if h.dtype == np.float64
            else (h.astype(np.float32) * np.float32(1 / 8)).astype(h.dtype)
        )
        np.testing.assert_array_equal(cupy.asnumpy(a), expected)
    arrays[1234][17] = cupy.nan
    assert not bool(scaler.unscale(arrays)[1])


def test_every_half_value_matches_numpy_on_the_gpu() -> None:
    for np_dtype in (np.float16,):
        values = np.arange(65536, dtype=np.uint16).view(np_dtype)
        finite = values[np.isfinite(values.astype(np.float32))]
        for inv_scale in (2.0**16, 3.0, 2.0**-5):
            x = cupy.asarray(finite)
            scaler = ampscale.create_scaler(backend="cupy", init_scale=inv_scale)
            (y,), ok = scaler.unscale([x])
            expected = (finite.astype(np.float32) * np.float32(1 / inv_scale)).astype(np_dtype)
            assert bool(ok)
            np.testing.assert_array_equal(cupy.asnumpy(y).view(np.uint16), expected.view(np.uint16))


def test_no_host_read_in_unscale_update_and_step(monkeypatch) -> None:
    scaler = ampscale.create_scaler(backend="cupy", growth_interval=2)
    grads = [cupy.ones(1000, cupy.float32) * 2.0**16]
    params = [cupy.zeros(1000, cupy.float32)]
    scaler = scaler.update(scaler.unscale(grads)[1])  # compile and create the state

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a device value")

    with monkeypatch.context() as m:
        m.setattr(cupy.ndarray, "get", forbidden)
        m.setattr(cupy.ndarray, "item", forbidden)
        m.setattr(cupy.ndarray, "__bool__", forbidden)
        for _ in range(3):
            grads = [cupy.ones(1000, cupy.float32) * scaler.state.scale]
            params, _, scaler = scaler.step(
                lambda p, g, s: ([a - 0.1 * b for a, b in zip(p, g, strict=False)], s), params, grads, ()
            )
    assert scaler.get_scale() == 2.0**18  # four finite steps, growth_interval=2: two growths


def test_strided_arrays_are_exact_and_warn_once() -> None:
    base = cupy.arange(64, dtype=cupy.float32).reshape(8, 8) * 4
    view = base[:, ::2]
    scaler = ampscale.create_scaler(backend="cupy", init_scale=4.0)
    with pytest.warns(ampscale.PerformanceWarning, match="strided"):
        (_out,), finite = scaler.unscale([view])
    assert bool(finite)
    np.testing.assert_array_equal(cupy.asnumpy(base[:, ::2]), np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2])


def test_nccl_agreement_with_one_rank() -> None:
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    scaler = ampscale.create_scaler(backend="cupy", axis_name=comm)
    _, finite = scaler.unscale([cupy.asarray([1.0, cupy.inf])])
    assert not bool(finite)
