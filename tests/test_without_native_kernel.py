"""The native NumPy kernel is optional (a wheel or sdist install without a C compiler has none):
the pure-NumPy path gives the same bits, flags and underflow counts, and says once that it is
slower. Also exercised by strided views, which take that path even where the kernel is built."""

from __future__ import annotations

import numpy as np
import pytest

import ampscale
from ampscale.backends import numpy as numpy_backend
from tests.conftest import BF16

DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if BF16 is not None else [])


def _values(dtype: str, rng: np.random.Generator, size: int = 1000) -> np.ndarray:
    kind = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    values = (rng.standard_normal(size) * 1e3).astype(np.float32).astype(kind)
    tiny = {"float16": 2.0**-20, "bfloat16": 1e-39, "float32": 1e-40, "float64": 1e-310}[dtype]
    values[rng.random(size) < 0.2] = 0.0
    values[rng.random(size) < 0.2] = tiny
    return values


def _unscale(arrays: list[np.ndarray], scale: float) -> tuple[list[np.ndarray], bool, float]:
    scaler = ampscale.create_scaler(backend="numpy", init_scale=scale)
    out, finite, fraction = scaler.unscale([a.copy() for a in arrays], underflow=True)
    return out, bool(finite), float(fraction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plant", [None, np.inf, np.nan])
def test_pure_numpy_path_equals_the_kernel(dtype: str, plant: float | None, monkeypatch) -> None:
    if not numpy_backend.NATIVE:
        pytest.skip("the native kernel is not built here: nothing to compare with")
    rng = np.random.default_rng(5)
    arrays = [_values(dtype, rng, size) for size in (1, 63, 1000, 4099)]
    if plant is not None:
        arrays[2][500] = plant
    kernel = _unscale(arrays, 2.0**10)
    monkeypatch.setattr(numpy_backend, "NATIVE", False)
    monkeypatch.setattr(numpy_backend, "_warned_no_native", False)
    with pytest.warns(ampscale.PerformanceWarning, match="native NumPy kernel is not built"):
        pure = _unscale(arrays, 2.0**10)
    assert pure[1] is kernel[1] is (plant is None)
    assert pure[2] == kernel[2] > 0
    if plant is None:
        for got, want in zip(pure[0], kernel[0], strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_underflow_count_of_strided_views(dtype: str) -> None:
    """Strided views take the pure path: their count must work for every dtype (bfloat16's
    smallest normal comes from ml_dtypes, which NumPy's finfo does not know)."""
    values = _values(dtype, np.random.default_rng(6))
    view = values[::2]
    smallest_normal = 2.0**-126 if dtype == "bfloat16" else float(np.finfo(view.dtype).smallest_normal)
    expected = int(np.count_nonzero(np.abs(view.astype(np.float64)) < smallest_normal))
    _, finite, fraction = ampscale.create_scaler(backend="numpy").unscale([view], underflow=True)
    assert bool(finite)
    assert round(float(fraction) * view.size) == expected
