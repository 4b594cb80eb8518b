"""FP8 casts: every encode against ml_dtypes + clip, over a stratified sample of float32 bit
patterns (every exponent, both signs, the mantissas next to each rounding boundary, inf, nan);
torch's and jnp's casts through ampscale give the same bytes. ``AMPSCALE_FP8_ALL_BITS=1`` runs
all 2**32 patterns instead, in chunks of 2**24 (minutes per format and backend; not in CI)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

import ampscale.fp8 as fp8

FORMATS = sorted(fp8.FORMATS)


CHUNK = 1 << 24  # 64 MiB of float32 at a time: all 2**32 patterns never sit in memory at once


def chunks() -> Iterator[np.ndarray]:
    """The float32 patterns to check: the stratified sample, or all 2**32 in chunks."""
    if os.environ.get("AMPSCALE_FP8_ALL_BITS") == "1":  # pragma: no cover - manual run
        for start in range(0, 1 << 32, CHUNK):
            yield np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        yield sample()


def sample() -> np.ndarray:
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
    for x in chunks():
        got = fp8.quantize(x, np.float32(1.0), fmt).view(np.uint8)
        wrong = np.flatnonzero(got != reference(x, fmt))
        assert wrong.size == 0, [(hex(int(x[i : i + 1].view(np.uint32)[0])), got[i]) for i in wrong[:5]]
    # the raw cast does not saturate: the clip is what makes 500 the format's max
    assert np.isnan(np.float32(500.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    top = fp8.FORMATS[fmt]
    assert fp8.quantize(np.float32([-1e6, np.inf]), np.float32(1.0), fmt).astype(np.float32).tolist() == [-top, top]


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_encode_equals_numpy(fmt):
    torch = pytest.importorskip("torch")
    for x in chunks():
        got = fp8.quantize(torch.from_numpy(x), torch.tensor(1.0), fmt).view(torch.uint8).numpy()
        expected = reference(x, fmt)
        nan = np.isnan(x)
        # the nan byte differs across libraries in sign for some formats; both must be nan
        assert (got[~nan] == expected[~nan]).all()
        assert np.isnan(fp8.quantize(torch.from_numpy(x[nan]), torch.tensor(1.0), fmt).float().numpy()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_jax_encode_equals_numpy(fmt):
    jnp = pytest.importorskip("jax.numpy")
    for x in chunks():
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


# ------------------------------------------------------------------------------ E8M0


def te_float_to_e8m0(x: np.ndarray) -> np.ndarray:
    """Transformer Engine's ``float_to_e8m0`` off Blackwell (transformer_engine/common/util/
    ptx_arch_spec.cuh), transcribed: nan 0xFF, inf 0xFE, 0 0x00, else the exponent, bumped when
    the mantissa is nonzero unless the exponent is 0xFE or the value is at most 2**-127."""
    bits = x.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint8)  # e8m0_t exponent = (val_u32 >> 23): the sign drops
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    out = exponent + bump.astype(np.uint8)
    out = np.where(np.abs(x) == 0, 0, out)
    out = np.where(np.isinf(x), 0xFE, out)
    return np.where(np.isnan(x), 0xFF, out).astype(np.uint8)


def test_e8m0_encode_up_is_te_float_to_e8m0():
    for x in chunks():
        got = fp8.e8m0_encode(x, "up")
        assert got.dtype == np.uint8
        assert (got == te_float_to_e8m0(x)).all()


def test_e8m0_encode_nearest_is_ml_dtypes():
    for x in chunks():
        expected = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
        got = fp8.e8m0_encode(x, "nearest")
        wrong = np.flatnonzero(got != expected)
        assert wrong.size == 0, [(x[i], got[i], expected[i]) for i in wrong[:5]]


def test_e8m0_encode_down_is_the_exponent_bits():
    """torchao's FLOOR reads the exponent bits (``to_mx``: ``max_abs_int32 >> MBITS_F32``)."""
    for x in chunks():
        bits = x.view(np.uint32)
        expected = np.where(np.isnan(x), 0xFF, np.where(np.isinf(x), 0xFE, (bits >> 23) & 0xFF)).astype(np.uint8)
        assert (fp8.e8m0_encode(x, "down") == expected).all()


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_e8m0_decode_is_ml_dtypes_and_torch(backend):
    every = np.arange(256, dtype=np.uint8)
    expected = every.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        assert torch.equal(
            torch.from_numpy(every).view(torch.float8_e8m0fnu).float().view(torch.int32),
            torch.from_numpy(expected).view(torch.int32),
        ) or np.isnan(expected[255])
        got = fp8.e8m0_decode(torch.from_numpy(every)).numpy()
        encoded = fp8.e8m0_encode(torch.from_numpy(sample()), "up").numpy()
    elif backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        got = np.asarray(fp8.e8m0_decode(jnp.asarray(every)))
        encoded = np.asarray(fp8.e8m0_encode(jnp.asarray(sample()), "up"))
    else:
        got = fp8.e8m0_decode(every)
        encoded = fp8.e8m0_encode(sample(), "up")
    assert got[:255].view(np.uint32).tolist() == expected[:255].view(np.uint32).tolist()
    assert np.isnan(got[255])
    # the other backends encode as NumPy does (JAX: the bits are read with a bitcast, so
    # subnormal inputs keep theirs)
    assert (encoded == te_float_to_e8m0(sample())).all()


def test_e8m0_rejects_an_unknown_rounding():
    with pytest.raises(ValueError, match=r"rounding must be one of \['up', 'down', 'nearest'\]; got 'even'"):
        fp8.e8m0_encode(np.float32([1.0]), "even")
