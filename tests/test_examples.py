"""Every example runs (in a short smoke mode) and learns something, so none of them rots."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

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


@pytest.mark.parametrize(
    ("example", "framework", "says"),
    [
        ("cupy_mlp", "cupy", "CuPy is not installed; fix: pip install 'ampscale[cupy]'"),
        ("torch_mlp", "torch", "needs PyTorch, which is not installed: pip install 'ampscale[torch]'"),
        ("jax_optax_mlp", "optax", "needs optax, which is not installed: pip install 'ampscale[jax]'"),
    ],
)
def test_an_example_without_its_framework_says_what_to_install_in_one_line(
    example: str, framework: str, says: str
) -> None:
    if framework == "optax":
        pytest.importorskip("jax", reason="the example checks for JAX before optax")
    path = str(EXAMPLES / f"{example}.py")
    hide = f"import runpy, sys\nsys.modules[{framework!r}] = None  # as if not installed\n"
    code = hide + f"sys.argv = [{path!r}]\nrunpy.run_path({path!r}, run_name='__main__')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert says in done.stderr
