"""Doctest collection: skip the adapter modules of frameworks that are not installed."""

import importlib.util

_ADAPTERS = {
    "torch": ["ampscale/torch.py", "ampscale/backends/torch.py"],
    "jax": ["ampscale/jax.py", "ampscale/backends/jax.py"],
    "cupy": ["ampscale/cupy.py", "ampscale/backends/cupy.py"],
}

collect_ignore = [
    path for module, paths in _ADAPTERS.items() if importlib.util.find_spec(module) is None for path in paths
]
