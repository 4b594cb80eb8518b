"""FP8 casts: every encode against ml_dtypes + clip, over a stratified sample of float32 bit
patterns (every exponent, both signs, the mantissas next to each rounding boundary, inf, nan);
torch's and jnp's casts through ampscale give the same bytes. ``AMPSCALE_FP8_ALL_BITS=1`` runs
all 2**32 patterns (minutes; not in CI)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import ampscale.fp8 as fp8

FORMATS = sorted(fp8.FORMATS)


def sample() -> np.ndarray:
    if os.environ.get("AMPSCALE_FP8_ALL_BITS") == "1":  # pragma: no cover - manual run
        return np.arange(2**32, dtype=np.uint64).astype(np.uint32).view(np.float32)
    exponents = np.arange(256, dtype=np.uint32)
    low = np.arange(64, dtype=np.uint32)
    # FP8 keeps 2 or 3 mantissa bits: the patterns at and next to every tie of every kept bit
    ties = (np.arange(1, 1 << 4, dtype=np.uint32) << 19)[:, None] + np.array([-1, 0, 1], np.int64)[None, :]
    mantissas = np.concatenate(
        [low, (1 << 23) - 1 - low, np.arange(0, 1 << 23, 4099, dtype=np.uint32), ties.reshape(-1).astype(np.uint32)]
    )
    grid = (exponents[:, None] << 23) | mantissas[None, :]
    bits = np.concatenate([grid.reshape(-1), grid.reshape(-1) | np.uint32(1 << 31)])
    random = np.random.default_rng(27).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, random]).view(np.float32)


def reference(x: np.ndarray, fmt: str) -> np.ndarray:
    bound = np.float32(fp8.FORMATS[fmt])
    with np.errstate(invalid="ignore"):
        return np.clip(x, -bound, bound).astype(getattr(ml_dtypes, f"float8_{fmt}")).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_numpy_encode_is_ml_dtypes_with_clip(fmt):
    x = sample()
    got = fp8.quantize(x, np.float32(1.0), fmt).view(np.uint8)
    assert (got == reference(x, fmt)).all()
    # the raw cast does not saturate: the clip is what makes 500 the format's max
    assert np.isnan(np.float32(500.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    top = fp8.FORMATS[fmt]
    assert fp8.quantize(np.float32([-1e6, np.inf]), np.float32(1.0), fmt).astype(np.float32).tolist() == [-top, top]


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_encode_equals_numpy(fmt):
    torch = pytest.importorskip("torch")
    x = sample()
    got = fp8.quantize(torch.from_numpy(x), torch.tensor(1.0), fmt).view(torch.uint8).numpy()
    expected = reference(x, fmt)
    nan = np.isnan(x)
    # the nan byte differs across libraries in sign for some formats; both must be nan
    assert (got[~nan] == expected[~nan]).all()
    assert np.isnan(fp8.quantize(torch.from_numpy(x[nan]), torch.tensor(1.0), fmt).float().numpy()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_jax_encode_equals_numpy(fmt):
    jnp = pytest.importorskip("jax.numpy")
    x = sample()
    got = np.asarray(fp8.quantize(jnp.asarray(x), jnp.float32(1.0), fmt)).view(np.uint8)
    normal = ~np.isnan(x) & ((np.abs(x) >= np.finfo(np.float32).tiny) | (x == 0))  # XLA's CPU flushes subnormals
    assert (got[normal] == reference(x, fmt)[normal]).all()


def test_qdq_and_scaler_casts():
    f8 = fp8.create_fp8_scaler("te_delayed", {"x": "forward"}, history_len=2)
    f8 = f8.update(np.float32([2.0]))
    x = np.float32([1.0, -2.0, 3.0, np.nan])
    q, scale_inv, amax = f8.quantize(x, "x")
    assert np.isnan(amax)
    assert fp8.dequantize(q, scale_inv).tolist()[:3] == [1.0, -2.0, 2.0]  # 3 * 224 saturates at 448
    assert np.isnan(f8.qdq(x, "x")[3])
