"""Block and MX scaling against their anchors, bit for bit, on NumPy, torch and JAX.

torchao ``to_mx`` (installed) for the ``floor`` / ``ceil`` / ``even`` / ``rceil`` rules, its
``to_dtype`` for the dequantization; transcriptions where nothing installs on a CPU: TE's block
scaling and MXFP8 kernels, and microxcaling's ``_quantize_mx`` (its torch text, run on the CPU).
Inputs: blocks of every magnitude (subnormal to near FLT_MAX), zero blocks, blocks holding
nan or inf, amaxes just above and below the powers of two that the rules round at, the FP8
grid's ties; float32 and bfloat16. JAX's casts run on XLA's CPU, which flushes subnormal
elements: there the data is compared where neither the element nor its scaled value is
subnormal, the scales everywhere.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ampscale.fp8 as fp8
from tests import fp8_anchors as anchors

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def blocks_of_every_kind(rows: int, columns: int, dtype, seed: int = 0) -> np.ndarray:
    """``[rows, columns]`` values, each run of 32 with its own magnitude and its own trouble."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    runs = x.reshape(-1, 32)
    for k, run in enumerate(runs):
        kind = k % 12
        run *= F32(2.0) ** F32(rng.integers(-140, 120))
        if kind == 0:
            run[:] = 0.0
        elif kind == 1:
            run[rng.integers(32)] = np.nan
        elif kind == 2:
            run[rng.integers(32)] = np.inf * (-1) ** rng.integers(2)
        elif kind == 3:  # amax just below / at / above 448 * 2**k: where the log2 rules round
            top = F32(448.0) * F32(2.0) ** F32(rng.integers(-20, 20))
            run[:] = np.clip(run, -top / 2, top / 2)
            run[0] = (
                np.nextafter(top, F32(0), dtype=F32)
                if k % 3 == 0
                else top
                if k % 3 == 1
                else np.nextafter(top, F32(np.inf), dtype=F32)
            )
        elif kind == 4:  # amax just below / above a power of two
            top = F32(2.0) ** F32(rng.integers(-30, 30))
            run[:] = np.clip(run, -top / 2, top / 2)
            run[0] = np.nextafter(top, F32(0), dtype=F32) if k % 2 else np.nextafter(top, F32(np.inf), dtype=F32)
        elif kind == 5:  # subnormal elements
            run[:] = (rng.standard_normal(32) * 1e-39).astype(np.float32)
        elif kind == 6:  # the ties of the FP8 grid, after the block's scale
            run[:4] = F32([1.0625, 1.1875, 3.25, 2.5])
            run[4:] = np.clip(run[4:], -4, 4)
        elif kind == 7:
            run[:] = np.clip(run * F32(1e37), -3e38, 3e38)
    return x.astype(dtype)


def on(backend: str, x: np.ndarray):
    if backend == "torch":
        torch = pytest.importorskip("torch")
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x))
    if backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(x)
    return x


def numpy_of(y) -> np.ndarray:
    if hasattr(y, "detach"):
        import torch

        fp8_types = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}
        if y.dtype in fp8_types:
            return y.view(torch.uint8).numpy().view(fp8_types[y.dtype])
        if y.dtype == torch.bfloat16:
            return y.view(torch.int16).numpy().view(np.uint16).view(BF16)
        return y.numpy()
    return np.asarray(y)


def as_bytes(y) -> np.ndarray:
    array = numpy_of(y)
    return array.view(np.uint8) if array.dtype.itemsize == 1 else array.view(f"u{array.dtype.itemsize}")


def assert_same(got, expected, what, where=None):
    got, expected = numpy_of(got), numpy_of(expected)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    g, e = as_bytes(got), as_bytes(expected)
    differ = g != e
    if got.dtype != np.uint8:  # a nan's payload is not specified by the anchors: nan matches nan
        differ &= ~(np.isnan(got.astype(np.float32)) & np.isnan(expected.astype(np.float32)))
    if where is not None:
        # XLA's CPU flushes a subnormal result too
        result = np.abs(expected.astype(np.float32)).reshape(differ.shape)
        differ &= where.reshape(differ.shape) & ~((result > 0) & (result < np.finfo(np.float32).tiny))
    wrong = np.flatnonzero(differ)
    assert wrong.size == 0, f"{what}: {wrong.size} of {differ.size} differ, e.g. at {wrong[:5]}"


def normal_for_xla(x: np.ndarray, scaled: np.ndarray) -> np.ndarray:
    """Elements XLA's CPU computes as NumPy does: neither the input nor its scaled value subnormal."""
    tiny = np.finfo(np.float32).tiny
    x32 = np.abs(x.astype(np.float32))
    s32 = np.abs(scaled.astype(np.float32))
    return ~((x32 > 0) & (x32 < tiny)) & ~((s32 > 0) & (s32 < tiny))


# ------------------------------------------------------------------------------ TE block scaling


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("fmt", "pow2"), [("e4m3fn", True), ("e4m3fn", False), ("e5m2", True)])
def test_quantize_block_is_te_block_scaling(fmt, pow2, dtype, block, backend):
    x = blocks_of_every_kind(160, 288, dtype)  # tails in both dimensions
    if dtype == np.float16:
        with np.errstate(over="ignore"):
            x = x.astype(np.float32).clip(-65504, 65504).astype(np.float16)
    q_ref, s_ref = anchors.te_block_quantize(x, fmt, block, pow2)
    q, scale_inv = fp8.quantize_block(on(backend, x), fmt=fmt, block=block, pow2=pow2)
    assert_same(scale_inv, s_ref, f"scale_inv {fmt} {block} on {backend}")
    where = None
    if backend == "jax":
        per_block = np.repeat(np.repeat(1 / s_ref.reshape(-1, s_ref.shape[-1]), block[0], 0), block[1], 1)
        scaled = x.astype(np.float32) * per_block[: x.shape[0], : x.shape[1]].astype(np.float32)
        where = normal_for_xla(x, scaled)
    assert_same(q, q_ref, f"q {fmt} {block} on {backend}", where)
    back = fp8.dequantize_block(q, scale_inv, block=block, dtype=dtype)
    if backend == "jax":  # a subnormal scale_inv (a block of amax below ~5e-36) reads as 0 on XLA's CPU
        tiny = per_block[: x.shape[0], : x.shape[1]] > np.float32(2.0**126)
        where = where & ~tiny
    expected = (
        q_ref.astype(np.float32)
        * np.repeat(np.repeat(s_ref.reshape(-1, s_ref.shape[-1]), block[0], 0), block[1], 1)[: x.shape[0], : x.shape[1]]
    ).astype(dtype)
    assert_same(back, expected, f"dequantize {block} on {backend}", where)


def test_block_scale_is_the_input_dtype_max_when_it_overflows():
    """A block of subnormals: 448 / amax overflows; TE saturates at the *input* dtype's max."""
    x = np.full((1, 128), 1e-40, np.float32)
    _q, scale_inv = fp8.quantize_block(x, pow2=False)
    assert scale_inv[0, 0] == np.float32(1.0) / np.finfo(np.float32).max
    _q, scale_inv = fp8.quantize_block(x.astype(BF16), pow2=False)
    assert scale_inv[0, 0] == np.float32(1.0) / np.float32(float.fromhex("0x1.fep+127"))


# ------------------------------------------------------------------------------ MX: torchao


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil"])
def test_quantize_mx_is_torchao_to_mx(rule, fmt, dtype, backend):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    x = blocks_of_every_kind(8, 1024, dtype, seed=1)
    elem = getattr(torch, f"float8_{fmt}")
    mode = getattr(ScaleCalculationMode, rule.upper())
    scale_ref, q_ref = to_mx(on("torch", x), elem, 32, mode)
    q, scales = fp8.quantize_mx(on(backend, x), fmt=fmt, block=32, rule=rule)
    assert_same(scales, scale_ref.view(torch.uint8), f"{rule} scales on {backend}")
    where = None
    if backend == "jax":
        power = fp8.e8m0_decode(numpy_of(scale_ref.view(torch.uint8)))
        where = normal_for_xla(x, (x.astype(np.float32).reshape(8, -1, 32) / power[..., None]).reshape(x.shape))
    assert_same(q, q_ref, f"{rule} data on {backend}", where)
    target = torch.bfloat16 if dtype == BF16 else torch.float32
    expected = to_dtype(q_ref, scale_ref, elem, 32, target)
    back = fp8.dequantize_mx(q, scales, block=32, dtype="bfloat16" if dtype == BF16 else "float32", rule=rule)
    assert_same(back, expected, f"{rule} dequantize on {backend}", where)


# ------------------------------------------------------------------------------ MX: TE, microxcaling


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_quantize_mx_te_rule_is_te_mxfp8(fmt, dtype, backend):
    x = blocks_of_every_kind(8, 512, dtype, seed=2)
    q_ref, s_ref = anchors.te_mxfp8_quantize(x, fmt)
    q, scales = fp8.quantize_mx(on(backend, x), fmt=fmt, rule="te_mxfp8")
    assert_same(scales, s_ref, f"te_mxfp8 scales on {backend}")
    where = None
    if backend == "jax":
        inverse = np.float32(1.0) / fp8.e8m0_decode(s_ref)
        where = normal_for_xla(x, (x.astype(np.float32).reshape(8, -1, 32) * inverse[..., None]).reshape(x.shape))
    assert_same(q, q_ref, f"te_mxfp8 data on {backend}", where)
    back = fp8.dequantize_mx(q, scales, dtype="bfloat16" if dtype == BF16 else "float32", rule="te_mxfp8")
    assert_same(back, anchors.te_mxfp8_dequantize(q_ref, s_ref, dtype), f"te_mxfp8 dequantize on {backend}", where)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_quantize_mx_microxcaling_rule_is_the_ocp_reference(fmt, dtype, backend):
    torch = pytest.importorskip("torch")
    x = blocks_of_every_kind(8, 512, dtype, seed=3)
    expected = anchors.microxcaling_quantize_mx(on("torch", x).to(torch.float32), fmt)
    q, scales = fp8.quantize_mx(on(backend, x), fmt=fmt, rule="microxcaling")
    back = fp8.dequantize_mx(q, scales, rule="microxcaling")
    where = None
    if backend == "jax":
        power = fp8.e8m0_decode(numpy_of(scales))
        where = normal_for_xla(x, (x.astype(np.float32).reshape(8, -1, 32) / power[..., None]).reshape(x.shape))
    assert_same(back, expected, f"microxcaling fake quantization on {backend}", where)


def test_quantize_mx_rules_differ_where_their_anchors_do():
    """The rules are not one rule: an amax one ulp below 256 is floored to 2**7 by its bits
    (torchao FLOOR) and to 2**8 by microxcaling's float32 log2, which rounds up; TE's rceil
    rounds ``amax * rcp(448)`` up, torchao's RCEIL takes ``ceil(log2(amax / 448))``."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.nextafter(np.float32(256.0), np.float32(0))
    floor = fp8.quantize_mx(x, rule="floor")[1][0, 0]
    reference = fp8.quantize_mx(x, rule="microxcaling")[1][0, 0]
    assert (int(floor), int(reference)) == (127 + 7 - 8, 127 + 8 - 8)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda x: fp8.quantize_mx(x, rule="nearest"), ValueError, r"rule must be one of \['floor'"),
        (lambda x: fp8.quantize_mx(x[:, :30]), ValueError, r"last axis \(30\) must be a multiple of block \(32\)"),
        (lambda x: fp8.quantize_mx(x, fmt="e4m3fnuz"), ValueError, "fmt must be one of"),
        (lambda x: fp8.quantize_block(x, block=(1, 64)), ValueError, r"block must be one of \[\(1, 128\)"),
        (lambda x: fp8.quantize_block(x.astype(np.int32)), TypeError, "float32, bfloat16 or float16; got dtype int32"),
    ],
)
def test_bad_block_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call(np.ones((2, 64), np.float32))
