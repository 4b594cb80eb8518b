"""Every example runs (in a short smoke mode) and learns something, so none of them rots."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_mlp() -> None:
    pytest.importorskip("torch")
    result = load("torch_mlp").main(["--steps", "120"])
    assert result["accuracy"] > 0.9
    assert result["applied"] > 100


def test_jax_optax_mlp() -> None:
    pytest.importorskip("optax")
    result = load("jax_optax_mlp").main(["--steps", "150"])
    assert result["accuracy"] > 0.9
    assert result["steps"] == 150


def test_cupy_mlp_logic_runs_on_numpy() -> None:
    result = load("cupy_mlp").main(["--numpy", "--steps", "200"])
    assert result["accuracy"] > 0.9
    assert result["steps"] == 200


@pytest.mark.gpu
def test_cupy_mlp_on_the_gpu() -> None:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    result = load("cupy_mlp").main(["--steps", "200"])
    assert result["accuracy"] > 0.9
