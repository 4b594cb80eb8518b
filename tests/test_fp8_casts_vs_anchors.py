"""Each preset quantizes and dequantizes as its anchor does, bit for bit, in the anchor's dtypes.

torchao dequantizes ``q / scale`` (``_FromFloat8ConstrFunc``), TE ``f32(q) * scale_inv``;
flax divides by the inverse scale cast to its ``compute_dtype`` and dequantizes in the input's
dtype (``fp8_ops.quantize`` / ``dequantize``); Keras does the same division and dequantizes in
the compute dtype (``quantizers.quantize_and_dequantize``). Inputs: 4096 values spread over the
format's range (ties of the FP8 grid included), zeros, inf, nan and huge values, as float32 and
bfloat16, on every backend that installs; the anchors are the installed libraries.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import ampscale.fp8 as fp8

os.environ.setdefault("KERAS_BACKEND", "jax")
BF16 = ml_dtypes.bfloat16


# the scales' amax: 448 / 60 is not a power of two, and q / s differs from q * (1 / s) for 92 of
# the 254 finite E4M3 values (with 37, for none)
AMAX = 60.0


def inputs(dtype) -> np.ndarray:
    """4096 values as a tensor whose amax gave the scale: magnitudes log-uniform from
    ``AMAX * 2**-16`` to ``AMAX``, a few above it (saturating), the FP8 grid's ties, specials."""
    rng = np.random.default_rng(27)
    magnitude = np.float32(AMAX) * np.float32(2.0) ** rng.uniform(-16, 0, 3900).astype(np.float32)
    above = np.float32(AMAX) * rng.uniform(1, 4, 100).astype(np.float32)
    ties = np.float32([1.0625, 1.1875, 3.25, 448.0, 464.0, 480.0, 57344.0, 61440.0]) / np.float32(12.0)
    values = np.concatenate([magnitude, above, ties, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38])])
    values = values * np.where(rng.random(values.size) < 0.5, -1, 1).astype(np.float32)
    return np.resize(values, 4096).astype(dtype)


def scaler(preset: str, backend: str):
    """The preset's scaler after two updates with an amax of ``AMAX``."""
    f8 = fp8.create_fp8_scaler(preset, {"x": "forward"}, history_len=2)
    f8 = f8.update(np.float32([AMAX])).update(np.float32([AMAX]))
    if backend == "numpy":
        return f8
    pytest.importorskip(backend)  # the sdist's own tests run with no framework
    restored = fp8.create_fp8_scaler(preset, {"x": "forward"}, backend=backend, history_len=2)
    return restored.load_state_dict(f8.state_dict())


def on(backend: str, x: np.ndarray):
    if backend == "torch":
        torch = pytest.importorskip("torch")
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    if backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(x)
    return x


def host(y) -> np.ndarray:
    if hasattr(y, "detach"):
        import torch

        if y.dtype == torch.bfloat16:
            return y.view(torch.int16).numpy().view(np.uint16)
        return y.numpy().view(np.uint32 if y.dtype == torch.float32 else np.uint16)
    array = np.asarray(y)
    return array.view(np.uint32 if array.dtype == np.float32 else np.uint16)


def assert_same_bits(got, expected, what):
    got, expected = host(got), host(expected)
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    nan_bits = {np.uint32: 0x7F800000, np.uint16: 0x7F80}[got.dtype.type]
    mask = {np.uint32: 0x7FFFFFFF, np.uint16: 0x7FFF}[got.dtype.type]
    got_nan, expected_nan = (got & mask) > nan_bits, (expected & mask) > nan_bits
    wrong = np.flatnonzero((got != expected) & ~(got_nan & expected_nan))
    assert wrong.size == 0, f"{what}: {wrong.size} of {got.size} differ, e.g. at {wrong[:5]}"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["torchao_tensorwise", "torchao_rowwise", "torchao_delayed"])
def test_torchao_qdq_is_q_over_scale(preset, dtype, backend):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    f8 = scaler(preset, backend)
    x = inputs(dtype)
    scale = torch.tensor(float(np.asarray(f8.scales_sync()["x"])), dtype=torch.float32)
    x_torch = on("torch", x)
    if preset == "torchao_rowwise":  # one row, its [1, 1] scale: torchao's dequantize is float32
        expected = hp_tensor_and_scale_to_float8(x_torch[None], scale.view(1, 1), torch.float8_e4m3fn, axiswise_dim=-1)
        expected = expected.to_original_precision()[0]
    else:
        expected = hp_tensor_and_scale_to_float8(x_torch, scale, torch.float8_e4m3fn).to_original_precision()
    assert_same_bits(f8.qdq(on(backend, x), "x"), expected, f"{preset} qdq on {backend}")
    if backend == "jax":  # under jit too, where XLA would turn q / scale into q * (1 / scale)
        import jax

        jitted = jax.jit(lambda scaler, values: scaler.qdq(values, "x"))(f8, on(backend, x))
        assert_same_bits(jitted, expected, f"{preset} qdq under jax.jit")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("compute", [np.float32, BF16], ids=["compute_f32", "compute_bf16"])
def test_flax_qdq_follows_compute_dtype(compute, dtype, backend):
    pytest.importorskip("flax")
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    f8 = scaler("flax", backend)
    x = inputs(dtype)
    scale = jnp.asarray(host_scale_inv(f8))  # flax's variable: the dequantization scale
    expected = fp8_ops.qdq(jnp.asarray(x), jnp.float8_e4m3fn, scale, jnp.dtype(compute))
    got = f8.qdq(on(backend, x), "x", compute_dtype=compute_name(compute))
    assert_same_bits(got, np.asarray(expected), f"flax qdq on {backend}")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("compute", [np.float32, BF16], ids=["compute_f32", "compute_bf16"])
def test_keras_qdq_follows_compute_dtype(compute, backend):
    pytest.importorskip("keras")
    from keras import ops, quantizers

    f8 = scaler("keras", backend)
    x = inputs(compute)  # Keras's layer casts its inputs to the compute dtype
    scale = ops.convert_to_tensor(host_scale_inv(f8))  # Keras's variable: the dequantization scale
    expected = quantizers.quantize_and_dequantize(
        ops.convert_to_tensor(x), scale, "float8_e4m3fn", compute_name(compute)
    )
    got = f8.qdq(on(backend, x), "x", compute_dtype=compute_name(compute))
    assert_same_bits(got, np.asarray(expected), f"keras qdq on {backend}")


def host_scale_inv(f8) -> np.ndarray:
    value = f8.state.scale_inv
    return value.detach().numpy() if hasattr(value, "detach") else np.asarray(value)


def compute_name(dtype) -> str:
    return "bfloat16" if dtype == BF16 else "float32"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_te_qdq_multiplies_by_scale_inv_in_float32(dtype, backend):
    """TE (torch ``Float8Tensor.dequantize``, JAX ``TensorScaleDequantizer``): ``f32(q) *
    scale_inv``, rounded once to the input's dtype; the cast ``sat(f32(x) * scale)``."""
    f8 = scaler("te_delayed", backend)
    x = inputs(dtype)
    scale, scale_inv = (np.float32(np.asarray(host_value(v))) for v in (f8.state.scale[0], f8.state.scale_inv[0]))
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.clip(x.astype(np.float32) * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    expected = (q.astype(np.float32) * scale_inv).astype(dtype)
    assert_same_bits(f8.qdq(on(backend, x), "x"), expected, f"te qdq on {backend}")


def host_value(value):
    return value.detach().numpy() if hasattr(value, "detach") else value
