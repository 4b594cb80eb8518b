"""``import ampscale`` imports no framework, and the public surface is exactly what is documented."""

from __future__ import annotations

import subprocess
import sys

import ampscale

FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy", "optax", "flax", "tensorflow", "array_api_strict")


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_pulls_in_no_framework() -> None:
    run(f"import sys, ampscale\nloaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\nassert not loaded, loaded\n")


def test_numpy_training_step_pulls_in_no_framework() -> None:
    run(
        "import sys, numpy as np, ampscale\n"
        "s = ampscale.create_scaler()\n"
        "loss = s.scale(np.float32(1.0))\n"
        "g, f = s.unscale({'w': np.ones(3, np.float32)}, loss=loss)\n"
        "s = s.update(f)\n"
        "s.state_dict(); ampscale.all_finite([np.ones(2)])\n"
        "import ampscale.backends; ampscale.available_backends()\n"
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )


def test_public_surface() -> None:
    assert sorted(ampscale.__all__) == sorted(
        [
            "FORMAT_VERSION", "PRESETS", "AliasedGradientsError", "AmpscaleError", "AmpscaleWarning", "Diagnosis",
            "FloorEvent", "LeafReport", "OverflowReport", "PerformanceWarning", "Preset", "ScaleAtFloorError",
            "ScaleAtFloorWarning", "Scaler", "ScalerConfig", "ScalerState", "StateDictError", "StepOutcome",
            "__version__", "all_finite", "available_backends", "create_scaler", "diagnose", "doctor",
            "get_backend",
        ]
    )  # fmt: skip
    for name in ampscale.__all__:
        assert hasattr(ampscale, name), name
    assert set(ampscale.PRESETS) >= {"torch", "jmp", "flax", "keras", "megatron", "deepspeed", "apex", "paddle"}
