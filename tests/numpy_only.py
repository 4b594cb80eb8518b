"""Run code in a fresh interpreter that sees NumPy but no framework: a NumPy-only install.

The frameworks (and the optional packages a NumPy-only ``pip install ampscale`` lacks) are
hidden from the import system itself, so ``import torch`` raises ``ModuleNotFoundError`` and
``importlib.util.find_spec("torch")`` returns ``None``, exactly as where they are not installed.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: what a NumPy-only install lacks (``pip install ampscale`` brings numpy and array-api-compat)
HIDDEN = (
    "torch",
    "jax",
    "jaxlib",
    "cupy",
    "cupyx",
    "optax",
    "flax",
    "jmp",
    "tensorflow",
    "ml_dtypes",
    "array_api_strict",
    "matplotlib",
    "rich",
)

PRELUDE = f"""
import importlib.machinery, sys

class _NumpyOnly(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {HIDDEN!r}:
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [_NumpyOnly if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert _NumpyOnly in sys.meta_path
"""


def run_numpy_only(code: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` after :data:`PRELUDE` in a new interpreter at the repository root."""
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
