"""The CuPy backend: on a GPU (``gpu``, run by scripts/gpu-check.sh) and on a NumPy-backed CuPy.

The ``cupy-host`` variant runs the same tests on the CPU through ``tests/fake_cuda.py`` (the
kernels' host build behind a fake ``cupy.cuda.function.Module``). The shared contract tests
also run on CuPy through ``tests/conftest.py`` when a device exists.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ampscale
from ampscale._native.cuda import _plan, nvrtc
from tests.fake_cuda import Launches, cupy_on_host


def _cupy_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


try:
    nvrtc.load()
    NVRTC_MISSING = None
except OSError as exc:
    NVRTC_MISSING = str(exc)

GPU = pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not _cupy_gpu(), reason="no CuPy GPU")])
BOTH = [GPU, "host"]


@pytest.fixture(params=BOTH)
def cp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, bool]]:
    """``(cupy, ampscale.backends.cupy, on the host)``."""
    if request.param == "gpu":
        import cupy

        from ampscale.backends import cupy as module

        yield cupy, module, False
        return
    with cupy_on_host(monkeypatch) as (fake, module):
        yield fake, module, True


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be loaded: {NVRTC_MISSING}")
def test_cupy_gets_ampscales_own_binary_and_compiles_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """CuPy's ``RawModule(code=...)`` appends ``-ftz=true`` after the caller's options (CuPy 14's
    ``_compile_with_cache_cuda``), which flushes subnormal scales, inverse scales and gradients
    to zero. So the module is compiled by ampscale's NVRTC call with its IEEE options, and CuPy
    only loads that binary (``cupy.cuda.function.Module().load``): what reaches CuPy is checked
    here (the fake CuPy refuses ``RawModule`` and records every image loaded)."""
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    real = nvrtc.compile_source

    def recording(source: str, arch: int, options: Any = (), name: str = "ampscale.cu", ptx: bool = False) -> Any:
        calls.append((source, arch, tuple(options)))
        return real(source, arch, options, name, ptx)

    monkeypatch.setattr(nvrtc, "compile_source", recording)
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))  # an empty cache: NVRTC compiles
    with cupy_on_host(monkeypatch, compile_for_real=True) as (fake, _module):
        scaler = ampscale.create_scaler(backend="cupy", preset="torch")
        scaler.unscale([fake.asarray(np.ones(4, np.float32))])
        state = fake._fake_state
    config = scaler.config
    assert len(calls) == 1
    source, arch, options = calls[0]
    assert source == _plan.module_source(config)
    assert arch == 90  # the device's compute capability
    assert options == _plan.COMPILE_OPTIONS
    assert "--ftz=false" in options
    assert not any(re.fullmatch(r"-?-ftz=true", o) for o in options)
    assert state.images
    assert state.images[0][:4] == b"\x7fELF"
    # that same source and those options give PTX with no flushing and no contraction
    ptx = real(source, arch, options, ptx=True)[0].decode(errors="replace")
    assert ".ftz" not in ptx
    assert not re.search(r"\bfma\.", ptx)


def test_without_nvrtc_no_module_is_made_and_one_warning_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ampscale's NVRTC call cannot run, CuPy does not compile instead (its compile would
    flush to zero): no module, the eager path, and one PerformanceWarning naming the reason."""
    from ampscale._native.cuda import driver

    monkeypatch.setattr(driver, "_warned", set())

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the NVRTC library (libnvrtc) was not found; tried nowhere")

    with cupy_on_host(monkeypatch) as (_fake, module):
        monkeypatch.setattr(nvrtc, "compiled", missing)
        config = ampscale.create_scaler(backend="cupy", preset="jmp").config
        with pytest.warns(ampscale.PerformanceWarning, match="NVRTC") as caught:
            assert module._kernels(config, 0) is None
        assert len(caught) == 1
        assert "eager" in str(caught[0].message)


def test_one_launch_for_thousands_of_arrays_of_mixed_dtypes(cp: tuple[Any, Any, bool]) -> None:
    cupy, module, host = cp
    rng = np.random.default_rng(0)
    count = 70 if host else 700
    hosts = [rng.standard_normal(4096).astype(dt) for dt in (np.float32, np.float16, np.float64) for _ in range(count)]
    arrays = [cupy.asarray(h) for h in hosts]
    scaler = ampscale.create_scaler(backend="cupy", init_scale=8.0)
    out, finite = scaler.unscale(arrays)
    rows, strided = module.BACKEND._rows(arrays)
    assert not strided
    assert len(rows[arrays[0].data.device_id]) == 3 * count  # one table row (one block) per array
    assert bool(finite)
    for h, a in zip(hosts, out, strict=True):
        expected = (
            h * np.float64(np.float32(1 / 8))
            if h.dtype == np.float64
            else (h.astype(np.float32) * np.float32(1 / 8)).astype(h.dtype)
        )
        np.testing.assert_array_equal(cupy.asnumpy(a), expected)
    arrays[count + 34][17] = cupy.nan
    assert not bool(scaler.unscale(arrays)[1])


def test_every_half_value_matches_numpy(cp: tuple[Any, Any, bool]) -> None:
    """Every finite float16 value, unscaled by 1/2**16, 1/3 and 32 (a scale below 1: some values
    overflow to inf, and then the step is not finite, as the values stored are checked)."""
    cupy, _, _ = cp
    values = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = values[np.isfinite(values.astype(np.float32))]
    for scale in (2.0**16, 3.0, 2.0**-5):
        x = cupy.asarray(finite)
        scaler = ampscale.create_scaler(backend="cupy", init_scale=scale)
        (y,), ok = scaler.unscale([x])
        with np.errstate(over="ignore"):
            expected = (finite.astype(np.float32) * np.float32(1 / scale)).astype(np.float16)
        assert bool(ok) is bool(np.isfinite(expected.astype(np.float32)).all())
        assert bool(ok) is (scale != 2.0**-5)
        np.testing.assert_array_equal(cupy.asnumpy(y).view(np.uint16), expected.view(np.uint16))


def test_no_host_read_in_unscale_update_and_step(cp: tuple[Any, Any, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    cupy, _, _ = cp
    scaler = ampscale.create_scaler(backend="cupy", growth_interval=2)
    grads = [cupy.ones(1000, cupy.float32) * 2.0**16]
    params = [cupy.zeros(1000, cupy.float32)]
    scaler = scaler.update(scaler.unscale(grads)[1])  # compile and create the state

    def sgd(p: Any, g: Any, s: Any) -> Any:
        return [a - 0.1 * b for a, b in zip(p, g, strict=False)], s

    # a new update_fn's first run, on copies compared on the host, comes before its first step
    params, _, scaler = scaler.step(sgd, params, [cupy.ones(1000, cupy.float32) * scaler.state.scale], ())

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host read of a device value")

    with monkeypatch.context() as m:
        m.setattr(cupy.ndarray, "get", forbidden)
        m.setattr(cupy.ndarray, "item", forbidden)
        m.setattr(cupy.ndarray, "__bool__", forbidden)
        for _ in range(2):
            grads = [cupy.ones(1000, cupy.float32) * scaler.state.scale]
            params, _, scaler = scaler.step(sgd, params, grads, ())
    assert scaler.get_scale() == 2.0**18  # four finite steps, growth_interval=2: two growths


def test_one_launch_per_step_and_none_for_nothing(cp: tuple[Any, Any, bool]) -> None:
    """The step is one launch; with no non-empty array and no loss (nothing to check) the update
    kernel runs instead (CuPy would launch one block for a grid of 0)."""
    cupy, _, host = cp
    if not host:
        pytest.skip("launches are counted by the profiler in test_cuda_gpu.py on the GPU")
    scaler = ampscale.create_scaler(backend="cupy")
    grads = [cupy.ones(10, cupy.float32)]
    scaler = scaler.update(scaler.unscale(grads)[1])
    Launches.log.clear()
    scaler = scaler.update(scaler.unscale(grads)[1])
    assert Launches.names() == ["ampscale_step"]
    scaler = scaler.update(scaler.unscale([cupy.zeros(0, cupy.float32)])[1])
    assert Launches.names() == ["ampscale_step", "ampscale_update"]


def test_strided_arrays_are_exact_and_warn_once(cp: tuple[Any, Any, bool]) -> None:
    cupy, module, _ = cp
    module._warned_strided = False
    base = cupy.arange(64, dtype=cupy.float32).reshape(8, 8) * 4
    view = base[:, ::2]
    scaler = ampscale.create_scaler(backend="cupy", init_scale=4.0)
    with pytest.warns(ampscale.PerformanceWarning, match="strided"):
        (_out,), finite = scaler.unscale([view])
    assert bool(finite)
    np.testing.assert_array_equal(cupy.asnumpy(base[:, ::2]), np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2])


#: CuPy kernels that compute with floats (CuPy compiles them with -ftz=true: float32 subnormals
#: are flushed); comparisons, copies and reductions of flags are not among them
_ARITHMETIC = frozenset({"multiply", "add", "subtract", "true_divide", "divide", "reciprocal", "power"})


def _float_arithmetic(ufuncs: list[tuple[str, str, tuple[str, ...]]]) -> list[tuple[str, str, tuple[str, ...]]]:
    return [u for u in ufuncs if u[0] in _ARITHMETIC and any(d in ("float32", "bfloat16") for d in u[2])]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gradients_go_through_ampscales_kernel_never_cupys_compiler(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Which compiler each operation's float arithmetic goes through (the fake CuPy logs every
    elementwise kernel of CuPy's own, which CuPy compiles with -ftz=true): the check and unscale
    of gradients, strided views included, is ampscale's NVRTC-built kernel alone, so float32
    subnormals are kept. ``scale()`` and ``masked_add_`` use CuPy's own multiply and add, which
    flush them, as the docs say (docs/backends.md, "What is exact on CuPy")."""
    with cupy_on_host(monkeypatch) as (cupy, module):
        state = cupy._fake_state
        module._warned_strided = True
        base = cupy.asarray((np.arange(64, dtype=np.float32).reshape(8, 8) + 1) * np.float32(2.0**-140))
        grads = [base[:, ::2]] if layout == "strided" else [base]
        scaler = ampscale.create_scaler(backend="cupy", init_scale=0.5)
        expected = cupy.asnumpy(grads[0]) * np.float32(2.0)  # subnormals, doubled exactly
        scaler = scaler.update(scaler.unscale([cupy.ones(4, cupy.float32)])[1])  # the state exists
        state.ufuncs.clear()
        Launches.log.clear()
        (out,), finite = scaler.unscale(grads)
        assert bool(finite)
        np.testing.assert_array_equal(cupy.asnumpy(out), expected)
        assert "ampscale_step" in Launches.names()
        assert _float_arithmetic(state.ufuncs) == []
        state.ufuncs.clear()
        scaler.scale(cupy.asarray(np.float32(3.0)))
        assert [u[0] for u in _float_arithmetic(state.ufuncs)] == ["multiply"]  # CuPy's: documented
        state.ufuncs.clear()
        ampscale.masked_add_(cupy.asarray(True), [cupy.ones(3, cupy.float32)], [cupy.ones(3, cupy.float32)])
        assert "add" in [u[0] for u in _float_arithmetic(state.ufuncs)]


def test_the_eager_fallback_says_it_flushes_subnormals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ampscale's kernels (no NVRTC or driver) CuPy's own operations do everything, and
    the warning says what that changes."""
    from ampscale._native.cuda import driver

    monkeypatch.setattr(driver, "_warned", set())
    with cupy_on_host(monkeypatch) as (cupy, module):

        def refused(source: str, device_id: int) -> Any:
            raise OSError("no NVRTC here")

        monkeypatch.setattr(module, "_load_module", refused)
        scaler = ampscale.create_scaler(backend="cupy")
        with pytest.warns(ampscale.PerformanceWarning, match=r"-ftz=true.*subnormals to zero"):
            scaler.unscale([cupy.ones(3, cupy.float32)])


@pytest.mark.gpu
@pytest.mark.skipif(not _cupy_gpu(), reason="no CuPy GPU")
def test_nccl_agreement_with_one_rank() -> None:
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    scaler = ampscale.create_scaler(backend="cupy", axis_name=comm)
    _, finite = scaler.unscale([cupy.asarray([1.0, cupy.inf])])
    assert not bool(finite)
