"""Shared fixtures: one ``Framework`` per installed backend, so every test runs on each of them.

GPU backends (CuPy, torch CUDA, JAX GPU) join only when a device is present; their tests are
marked ``gpu`` and run by ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

if os.environ.get("AMPSCALE_FAKE_CUPY") == "1":  # a NumPy-backed CuPy over the kernels' host build
    from tests.fake_cuda import install_fake_cupy_for_the_session

    install_fake_cupy_for_the_session()
if os.environ.get("AMPSCALE_FAKE_TORCH_CUDA") == "1":  # CPU tensors down the torch CUDA code path
    from tests.fake_cuda import install_torch_cuda_path_for_the_session

    install_torch_cuda_path_for_the_session()

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None


@dataclasses.dataclass
class Framework:
    """How a test makes arrays for one backend and reads them back."""

    name: str
    backend: Any  # what create_scaler(backend=...) takes
    dtypes: tuple[str, ...]
    make: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    in_place: bool
    gpu: bool = False

    def array(self, values: Any, dtype: str = "float32") -> Any:
        return self.make(_np_array(values, dtype))

    def __repr__(self) -> str:
        return self.name


@contextlib.contextmanager
def without_native_numpy_kernel(active: bool = True) -> Iterator[None]:
    """The NumPy backend as an install without a C compiler has it: the pure-NumPy path only.

    ``active=False`` changes nothing (for tests parametrized over both). The once-only
    ``PerformanceWarning`` of that path is marked as shown: it is tested on its own.
    """
    from ampscale.backends import numpy as backend

    if not active:
        yield
        return
    saved = backend.NATIVE, backend._warned_no_native
    backend.NATIVE, backend._warned_no_native = False, True
    try:
        yield
    finally:
        backend.NATIVE, backend._warned_no_native = saved


def _np_array(values: Any, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return np.asarray(values, dtype=np.float32).astype(BF16)
    return np.array(values, dtype=dtype)


def _numpy_framework() -> Framework:
    dtypes = ("float16", "float32", "float64") + (("bfloat16",) if BF16 is not None else ())
    return Framework("numpy", "numpy", dtypes, lambda a: np.array(a), lambda x: np.asarray(x), True)


def _strict_framework() -> Framework | None:
    if importlib.util.find_spec("array_api_strict") is None:
        return None
    import array_api_strict as xp

    def make(a: np.ndarray) -> Any:
        return xp.asarray(a)

    return Framework("array_api_strict", xp, ("float32", "float64"), make, lambda x: np.asarray(x), False)


def _torch_frameworks() -> list[Framework]:
    if importlib.util.find_spec("torch") is None:
        return []
    import torch

    def make_on(device: str) -> Callable[[np.ndarray], Any]:
        def make(a: np.ndarray) -> Any:
            if a.dtype == BF16:
                return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
            return torch.from_numpy(np.array(a)).to(device)

        return make

    def to_numpy(t: Any) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        return t.numpy()

    dtypes = ("float16", "bfloat16", "float32", "float64")
    out = [Framework("torch", "torch", dtypes, make_on("cpu"), to_numpy, True)]
    if torch.cuda.is_available():
        out.append(Framework("torch-cuda", "torch", dtypes, make_on("cuda"), to_numpy, True, gpu=True))
    return out


def _jax_framework() -> Framework | None:
    if importlib.util.find_spec("jax") is None:
        return None
    import jax.numpy as jnp

    return Framework(
        "jax", "jax", ("float16", "bfloat16", "float32"), lambda a: jnp.asarray(a), lambda x: np.asarray(x), False
    )


def _cupy_framework() -> Framework | None:
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    dtypes = ("float16", "float32", "float64") + (("bfloat16",) if BF16 is not None else ())

    def make(a: np.ndarray) -> Any:
        if a.dtype == BF16:
            return cupy.asarray(a.view(np.uint16)).view(BF16)
        return cupy.asarray(a)

    return Framework("cupy", "cupy", dtypes, make, lambda x: cupy.asnumpy(x), True, gpu=True)


def _adapter_exists(name: str) -> bool:
    return importlib.util.find_spec(f"ampscale.backends.{name}") is not None


def all_frameworks() -> list[Framework]:
    found = [_numpy_framework(), _strict_framework()]
    if _adapter_exists("torch"):
        found += _torch_frameworks()
    if _adapter_exists("jax"):
        found.append(_jax_framework())
    if _adapter_exists("cupy"):
        found.append(_cupy_framework())
    return [f for f in found if f is not None]


FRAMEWORKS = all_frameworks()


def _param(fw: Framework) -> Any:
    marks = [pytest.mark.gpu] if fw.gpu else []
    return pytest.param(fw, id=fw.name, marks=marks)


@pytest.fixture(params=[_param(f) for f in FRAMEWORKS])
def fw(request: pytest.FixtureRequest) -> Framework:
    """Every installed framework."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``isa`` variants (NumPy's native kernel families) run for NumPy only: deselect the
    copies of a test that pair another framework with a non-default kernel family."""
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        fw, isa = params.get("fw"), params.get("isa")
        if fw is not None and isa not in (None, "best") and fw.name != "numpy":
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Report how much adversarial work the reliability tests did (for the issue notes)."""
    import sys

    module = sys.modules.get("tests.test_reliability") or sys.modules.get("test_reliability")
    if module is None:
        return
    counts = module.COUNTS
    if any(counts.values()):
        terminalreporter.write_line(
            "ampscale reliability: "
            + ", ".join(f"{name}: {count}" for name, count in counts.items())
            + " (this process; with -n each worker counts its share)"
        )


@pytest.fixture(autouse=True)
def _float16_kept_warning_already_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning for float16 gradients unscaled in float16 is shown once per process, so which
    test would see it depends on the order; it counts as shown here, and the tests of it
    (``tests/test_trust_round3.py``) reset it."""
    import ampscale.backends._base

    monkeypatch.setattr(ampscale.backends._base, "_HALF_KEPT_WARNED", True, raising=False)
