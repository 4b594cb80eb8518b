"""Overflow detection is exact and unscaling is ``x * float32(1 / scale)``, on every backend.

Exact means: any inf, -inf or nan anywhere (first, middle, last element; strided views; 0-d;
across block and thread boundaries) is found, and no finite input is ever flagged (float16 max,
subnormals, -0.0, values whose sum or norm would overflow).
"""

from __future__ import annotations

import numpy as np
import pytest

import ampscale
from tests.conftest import BF16, Framework

SIZES = [(), (1,), (7,), (1000,), (70_001,), (600_003,)]  # 0-d, blocks, and the threaded path
BAD = [np.inf, -np.inf, np.nan]


@pytest.fixture(params=["best", "avx2", "generic"])
def isa(request: pytest.FixtureRequest):
    """Run NumPy cases on every native kernel family this CPU has (SIMD and portable C)."""
    from ampscale.backends import numpy as backend

    if not backend.NATIVE:
        if request.param != "best":
            pytest.skip("native kernel not built")
        yield "pure-numpy"
        return
    native = backend._native
    try:
        native.use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param} kernels")
    yield request.param
    native.use_isa("best")


def finite_values(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    limit = {"float16": 60000.0, "bfloat16": 1e30, "float32": 1e30, "float64": 1e30}[dtype]
    values = rng.standard_normal(shape) * rng.choice([1e-6, 1.0, 1e3], size=shape)
    return np.clip(values, -limit, limit)


def expected_unscale(x: np.ndarray, scale: float) -> np.ndarray:
    """torch's arithmetic: multiply by float32(1 / float64(scale)) in float32, round back."""
    inv = np.float32(1.0 / scale)
    with np.errstate(over="ignore"):  # below a scale of 1 large values overflow on purpose
        if x.dtype == np.float64:
            return x * np.float64(inv)
        return (x.astype(np.float32) * inv).astype(x.dtype)


def run_unscale(fw: Framework, arrays: list, scale: float):
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=scale)
    grads, finite = scaler.unscale(arrays)
    return [fw.to_numpy(g) for g in grads], bool(finite)


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_every_position_of_every_non_finite_value_is_found(fw: Framework, isa: str, shape) -> None:
    rng = np.random.default_rng(0)
    for dtype in fw.dtypes:
        base = finite_values(shape, dtype, rng)
        n = int(np.prod(shape))
        positions = sorted({0, n // 2, n - 1})
        for bad in BAD:
            for position in positions:
                values = base.copy().reshape(-1)
                values[position] = bad
                x = fw.array(values.reshape(shape), dtype)
                other = fw.array(base, dtype)
                _, finite = run_unscale(fw, [other, x, other], 1024.0)
                assert finite is False, (dtype, bad, position)
                assert bool(ampscale.all_finite({"a": other, "b": [x]})) is False


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_finite_inputs_are_never_flagged_and_unscale_exactly(fw: Framework, isa: str, shape) -> None:
    rng = np.random.default_rng(1)
    for dtype in fw.dtypes:
        values = finite_values(shape, dtype, rng)
        x = fw.array(values, dtype)
        reference = fw.to_numpy(fw.array(values, dtype))
        for scale in (2.0**16, 2.0**-3, 3.0):
            out, finite = run_unscale(fw, [fw.array(values, dtype)], scale)
            expected = expected_unscale(reference, scale)
            # finite means every unscaled value is finite (below a scale of 1 some overflow)
            assert finite is bool(np.isfinite(expected.astype(np.float64)).all()), (dtype, scale)
            np.testing.assert_array_equal(out[0], expected, err_msg=f"{dtype} {scale}")
        assert bool(ampscale.all_finite(x)) is True


def test_extreme_finite_values_are_finite(fw: Framework, isa: str) -> None:
    extremes = {
        "float16": [65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, -0.0, 0.0],
        "bfloat16": [3.3895314e38, -3.3895314e38, 9.2e-41, -0.0],
        "float32": [3.4028235e38, -3.4028235e38, 1.4e-45, 1.1754944e-38, -0.0],
        "float64": [1.7976931348623157e308, -1.7976931348623157e308, 5e-324, -0.0],
    }
    for dtype in fw.dtypes:
        values = np.array(extremes[dtype] * 50, dtype=np.float64)
        _, finite = run_unscale(fw, [fw.array(values, dtype)], 1.0)
        if narrowed_to_float32(fw, dtype):
            assert finite is torch_cuda_verdict(fw.array(values, dtype)) is False
            values = values[np.abs(values) < 3.4e38]
            _, finite = run_unscale(fw, [fw.array(values, dtype)], 1.0)
        assert finite is True, dtype
    # a sum or a norm of these overflows; elementwise they are all finite
    big = {"float16": 60000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}
    for dtype in fw.dtypes:
        x = fw.array(np.full(4096, big[dtype]), dtype)
        if narrowed_to_float32(fw, dtype):
            assert bool(ampscale.all_finite([x])) is torch_cuda_verdict(x) is False
            x = fw.array(np.full(4096, 3e38), dtype)
        assert bool(ampscale.all_finite([x])) is True


def narrowed_to_float32(fw: Framework, dtype: str) -> bool:
    """torch's CUDA kernel (``isfinite_ensure_cuda_math(float)``) checks float64 values narrowed
    to float32, so torch.amp.GradScaler on CUDA counts a float64 gradient beyond float32's range
    as an overflow; the torch backend uses that kernel and gives the same verdict."""
    return fw.name == "torch-cuda" and dtype == "float64"


def torch_cuda_verdict(x) -> bool:
    """Whether torch's own fused kernel finds ``x`` (a CUDA tensor) finite."""
    import torch

    found_inf = torch.zeros((), device=x.device)
    torch._amp_foreach_non_finite_check_and_unscale_([x.clone()], found_inf, torch.ones((), device=x.device))
    return bool(found_inf.item() == 0)


def test_empty_arrays_and_empty_trees_are_finite(fw: Framework) -> None:
    scaler = ampscale.create_scaler(backend=fw.backend)
    _grads, finite = scaler.unscale([fw.array(np.zeros((0,)), "float32"), fw.array(np.zeros((3, 0)), "float32")])
    assert bool(finite) is True
    assert bool(ampscale.all_finite([], backend=fw.backend)) is True
    _, finite = scaler.unscale({})
    assert bool(finite) is True


def test_strided_and_transposed_views(isa: str) -> None:
    rng = np.random.default_rng(2)
    for dtype in ("float16", "float32", "float64", "bfloat16"):
        if dtype == "bfloat16" and BF16 is None:
            continue
        base = np.asarray(finite_values((64, 33), dtype, rng)).astype(BF16 if dtype == "bfloat16" else dtype)
        original = base.copy()
        views = [base[::2, ::3], base[1::4].T, base[3::4, 5::7]]  # strided, sharing no element
        scaler = ampscale.create_scaler(init_scale=4.0)
        grads, finite = scaler.unscale(views)
        assert bool(finite)
        for view in grads:
            assert view.base is base or view is base or np.shares_memory(view, base)
        expected = original.copy()
        expected[::2, ::3] = expected_unscale(expected[::2, ::3], 4.0)
        expected[1::4] = expected_unscale(expected[1::4], 4.0)
        expected[3::4, 5::7] = expected_unscale(expected[3::4, 5::7], 4.0)
        np.testing.assert_array_equal(base, expected)
        # views that share elements would unscale them twice: refused, nothing changed
        with pytest.raises(ampscale.AliasedGradientsError):
            scaler.unscale([base[::2, ::3], base.T])
        np.testing.assert_array_equal(base, expected)
        for bad in BAD:
            probe = original.copy()
            probe[10, 9] = bad
            assert not bool(ampscale.all_finite([probe[::2, ::3]]))  # (10, 9) is in that view
            assert bool(ampscale.all_finite([probe[1::2, ::3]]))  # and not in this one


def test_read_only_arrays_are_unscaled_out_of_place(isa: str) -> None:
    x = np.full(1000, 8.0, np.float32)
    x.setflags(write=False)
    scaler = ampscale.create_scaler(init_scale=8.0)
    (y,), finite = scaler.unscale([x])
    assert bool(finite)
    assert y is not x
    np.testing.assert_array_equal(y, np.ones(1000, np.float32))
    np.testing.assert_array_equal(x, np.full(1000, 8.0, np.float32))
    (s,), finite = scaler.unscale([np.float32(16.0)])
    assert float(s) == 2.0
    assert bool(finite)


def test_in_place_where_writable(fw: Framework) -> None:
    x = fw.array(np.full(10, 2.0), "float32")
    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=2.0)
    (y,), _ = scaler.unscale([x])
    if fw.in_place:
        assert y is x
    np.testing.assert_array_equal(fw.to_numpy(y), np.ones(10, np.float32))


def test_many_leaves_of_mixed_dtypes(fw: Framework, isa: str) -> None:
    rng = np.random.default_rng(3)
    values = [
        finite_values((int(n),), fw.dtypes[i % len(fw.dtypes)], rng) for i, n in enumerate(rng.integers(0, 300, 400))
    ]
    dtypes = [fw.dtypes[i % len(fw.dtypes)] for i in range(len(values))]
    arrays = [fw.array(v, d) for v, d in zip(values, dtypes, strict=False)]
    out, finite = run_unscale(fw, arrays, 2.0**10)
    assert finite
    for v, d, o in zip(values, dtypes, out, strict=False):
        np.testing.assert_array_equal(o, expected_unscale(fw.to_numpy(fw.array(v, d)), 2.0**10))
    values[250][-1] = np.nan if len(values[250]) else values[250]
    if len(values[250]):
        arrays = [fw.array(v, d) for v, d in zip(values, dtypes, strict=False)]
        assert run_unscale(fw, arrays, 2.0)[1] is False


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 2.0**-5, 2.0**30, 1 / 0.75])
def test_every_half_precision_bit_pattern(isa: str, dtype: str, scale: float) -> None:
    """All 65536 values: the flag and the float32-opmath, round-to-nearest-even result."""
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes not installed")
    np_dtype = BF16 if dtype == "bfloat16" else np.float16
    bits = np.arange(65536, dtype=np.uint16)
    values = bits.view(np_dtype)
    finite_mask = np.isfinite(values.astype(np.float32))
    finite_values = values[finite_mask].copy()
    out, finite = run_unscale(ampscale_framework(), [finite_values.copy()], scale)
    with np.errstate(over="ignore"):  # below a scale of 1 large values overflow on purpose
        expected = (finite_values.astype(np.float32) * np.float32(1.0 / scale)).astype(np_dtype)
    # finite means every value written is finite
    assert finite is bool(np.isfinite(expected.astype(np.float32)).all())
    assert finite is (scale >= 1)
    np.testing.assert_array_equal(out[0].view(np.uint16), expected.view(np.uint16))
    for bad in values[~finite_mask][::97]:
        probe = finite_values.copy()
        probe[12345] = bad
        assert run_unscale(ampscale_framework(), [probe], scale)[1] is False


def ampscale_framework() -> Framework:
    from tests.conftest import FRAMEWORKS

    return next(f for f in FRAMEWORKS if f.name == "numpy")
