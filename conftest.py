"""Test-run setup: use the cores by default, and skip the doctests of frameworks that are absent."""

import importlib.util
import os

import pytest

_ADAPTERS = {
    "torch": [
        "ampscale/torch.py",
        "ampscale/backends/torch.py",
        "ampscale/fp8/torch.py",
        "ampscale/fp8/_fused_torch.py",
    ],
    "jax": ["ampscale/jax.py", "ampscale/backends/jax.py", "ampscale/fp8/jax.py", "ampscale/fp8/_fused_jax.py"],
    "cupy": ["ampscale/backends/cupy.py"],
}

collect_ignore = [
    path for module, paths in _ADAPTERS.items() if importlib.util.find_spec(module) is None for path in paths
]


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``python -m pytest`` runs on every core (pytest-xdist's ``-n auto``) unless told otherwise.

    An explicit ``-n``/``--numprocesses`` (``-n 0`` for one process), ``-p no:xdist``, ``--pdb``
    or ``PYTEST_XDIST_AUTO_NUM_WORKERS`` keeps its meaning; a worker never spawns workers. Set
    here rather than in ``addopts`` so that ``-p no:xdist`` stays a valid command line.
    """
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = config.option
    if getattr(option, "numprocesses", None) is not None or getattr(option, "usepdb", False):
        return
    if option.collectonly or (os.cpu_count() or 1) < 2:
        return
    option.numprocesses = "auto"
    if getattr(option, "dist", "no") == "no":
        # long tests (hypothesis over JAX, the demo) are spread as workers free up
        option.dist = "worksteal"
