"""ampscale: dynamic loss scaling for mixed-precision training, on NumPy, CuPy, JAX and PyTorch.

Package layer: the public surface, re-exported from the layers below.

It keeps float16 training from losing its small gradients: the loss is multiplied by a scale
before the backward pass, the gradients are divided back and checked for inf and nan in one
fused pass, a step that overflowed is skipped, and the scale grows or backs off as training
goes, with the exact policy of torch (the default), jmp, flax, Keras, Megatron, DeepSpeed,
apex, Paddle, MindSpore or tf.keras::

    import ampscale

    scaler = ampscale.create_scaler(preset="torch")
    scaled_loss = scaler.scale(loss)                           # backward from this
    grads, finite = scaler.unscale(grads, loss=scaled_loss)    # unscaled, and checked
    scaler = scaler.update(finite)                             # the next scaler (or step())

One state machine (:mod:`ampscale._core`), written once against the array API, drives every
backend.

``import ampscale`` imports no framework; backends load when first used. Two modules add
framework helpers: ``ampscale.torch`` (a drop-in ``GradScaler``; needs PyTorch) and
``ampscale.jax`` (an optax wrapper and ``value_and_grad``; needs JAX). They are imported on
first attribute access, and listed by ``dir(ampscale)`` only where their framework is
installed. CuPy needs no helper module: ``create_scaler(backend="cupy")`` is the whole API.
``ampscale.info()`` says which backends this machine can run.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from ampscale._config import PRESETS, FloorEvent, Preset, ScalerConfig
from ampscale._core import ScalerState
from ampscale._diagnostics import Diagnosis, LeafReport, OverflowReport, diagnose, doctor
from ampscale._errors import (
    AliasedGradientsError,
    AmpscaleError,
    AmpscaleWarning,
    InPlaceUpdateError,
    PerformanceWarning,
    ScaleAtFloorError,
    ScaleAtFloorWarning,
    StateDictError,
)
from ampscale._functional import all_finite, masked_add_, masked_copy_
from ampscale._info import info
from ampscale._scaler import Scaler, StepOutcome, create_scaler
from ampscale._state_dict import FORMAT_VERSION
from ampscale._version import __version__
from ampscale.backends import available_backends, get_backend

if TYPE_CHECKING:
    from types import ModuleType


__all__ = [
    "FORMAT_VERSION",
    "PRESETS",
    "AliasedGradientsError",
    "AmpscaleError",
    "AmpscaleWarning",
    "Diagnosis",
    "FloorEvent",
    "InPlaceUpdateError",
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
    "info",
    "masked_add_",
    "masked_copy_",
]

#: helper module -> (the framework it needs, the command that installs it)
_SUBMODULES = {"torch": ("torch", "pip install 'ampscale[torch]'"), "jax": ("jax", "pip install 'ampscale[jax]'")}


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        framework, install = _SUBMODULES[name]
        try:
            return importlib.import_module(f"ampscale.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != framework:
                raise
            # AttributeError, so that hasattr(), inspect.getmembers() and help() carry on
            raise AttributeError(f"ampscale.{name} needs {framework}, which is not installed: {install}") from exc
    raise AttributeError(f"module 'ampscale' has no attribute {name!r}")


def __dir__() -> list[str]:
    installed = [name for name, (framework, _) in _SUBMODULES.items() if importlib.util.find_spec(framework)]
    return sorted([*__all__, *installed])
