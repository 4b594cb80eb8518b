"""ampscale: framework-agnostic dynamic loss scaling for mixed-precision training.

One state machine (:mod:`ampscale._core`), written once against the array API, drives fused
backends for NumPy, CuPy, JAX and PyTorch. The three interfaces of patent CN115018072A::

    import ampscale

    scaler = ampscale.create_scaler(preset="torch")            # creation
    scaled_loss = scaler.scale(loss)                           # scale
    grads, finite = scaler.unscale(grads, loss=scaled_loss)    # optimizer iteration ...
    scaler = scaler.update(finite)                             # ... (or scaler.step(...))

``import ampscale`` imports no framework; backends load when first used. Framework helpers
live in ``ampscale.torch`` (a drop-in ``GradScaler``), ``ampscale.jax`` (optax wrapper,
``value_and_grad``) and ``ampscale.cupy``, imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ampscale._config import PRESETS, FloorEvent, Preset, ScalerConfig
from ampscale._core import ScalerState
from ampscale._diagnostics import Diagnosis, LeafReport, OverflowReport, diagnose, doctor
from ampscale._errors import (
    AliasedGradientsError,
    AmpscaleError,
    AmpscaleWarning,
    PerformanceWarning,
    ScaleAtFloorError,
    ScaleAtFloorWarning,
    StateDictError,
)
from ampscale._scaler import Scaler, StepOutcome, all_finite, create_scaler
from ampscale._state_dict import FORMAT_VERSION
from ampscale.backends import available_backends, get_backend

if TYPE_CHECKING:
    from types import ModuleType

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "PRESETS",
    "AliasedGradientsError",
    "AmpscaleError",
    "AmpscaleWarning",
    "Diagnosis",
    "FloorEvent",
    "LeafReport",
    "OverflowReport",
    "PerformanceWarning",
    "Preset",
    "ScaleAtFloorError",
    "ScaleAtFloorWarning",
    "Scaler",
    "ScalerConfig",
    "ScalerState",
    "StateDictError",
    "StepOutcome",
    "__version__",
    "all_finite",
    "available_backends",
    "create_scaler",
    "diagnose",
    "doctor",
    "get_backend",
]

_SUBMODULES = ("torch", "jax", "cupy")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"ampscale.{name}")
    raise AttributeError(f"module 'ampscale' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])
