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
            "FloorEvent", "InPlaceUpdateError", "LeafReport", "OverflowReport", "PerformanceWarning", "Preset",
            "ScaleAtFloorError", "ScaleAtFloorWarning", "Scaler", "ScalerConfig", "ScalerState", "StateDictError",
            "StepOutcome", "__version__", "all_finite", "available_backends", "create_scaler", "diagnose",
            "doctor", "get_backend", "info", "masked_add_", "masked_copy_",
        ]
    )  # fmt: skip
    for name in ampscale.__all__:
        assert hasattr(ampscale, name), name
    assert set(ampscale.PRESETS) >= {"torch", "jmp", "flax", "keras", "megatron", "deepspeed", "apex", "paddle"}


def test_help_and_introspection_in_a_numpy_only_install() -> None:
    """``help()``, ``dir()``, ``inspect.getmembers``, ``hasattr`` and ``pydoc`` work on every
    public module when no framework is installed, and the framework helpers say what to install."""
    from tests.numpy_only import run_numpy_only

    result = run_numpy_only(
        """
import contextlib, importlib, inspect, io, pydoc
import ampscale

assert "torch" not in dir(ampscale) and "jax" not in dir(ampscale), dir(ampscale)
assert not hasattr(ampscale, "torch") and not hasattr(ampscale, "jax") and not hasattr(ampscale, "cupy")
try:
    ampscale.torch
except AttributeError as exc:
    assert "pip install 'ampscale[torch]'" in str(exc), exc
for name, install in (("torch", "ampscale[torch]"), ("jax", "ampscale[jax]")):
    try:
        importlib.import_module("ampscale." + name)
    except ModuleNotFoundError as exc:
        assert exc.name == name and install in str(exc), exc
    else:
        raise AssertionError("ampscale." + name + " imported without " + name)

for module_name in ("ampscale", "ampscale.backends", "ampscale.demo", "ampscale.__main__"):
    module = importlib.import_module(module_name)
    dict(inspect.getmembers(module))
    for name in dir(module):
        getattr(module, name)
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    assert "<object object" not in text, module_name
    with contextlib.redirect_stdout(io.StringIO()) as out:
        help(module)
    assert module_name.split(".")[-1] in out.getvalue()
    print(module_name, "ok")

import sys
assert not [m for m in ("torch", "jax", "cupy", "matplotlib") if m in sys.modules]
"""
    )
    modules = ["ampscale", "ampscale.backends", "ampscale.demo", "ampscale.__main__"]
    assert result.stdout.splitlines() == [f"{name} ok" for name in modules]


def test_pydoc_command_on_every_public_module_in_a_numpy_only_install() -> None:
    """``python -m pydoc`` prints each module's page, and names the install command for the
    framework helpers instead of a bare ``No module named 'torch'``."""
    from tests.numpy_only import run_numpy_only

    result = run_numpy_only(
        """
import contextlib, io, sys, pydoc
for name in ("ampscale", "ampscale.backends", "ampscale.demo", "ampscale.torch", "ampscale.jax"):
    sys.argv = ["pydoc", name]
    status = 0
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            pydoc.cli()
        except SystemExit as exc:  # pydoc exits 1 when a module does not import
            status = exc.code
    print(name, status, "|", " ".join(out.getvalue().split()))
"""
    )
    pages = dict(line.split(" | ", 1) for line in result.stdout.splitlines())
    assert list(pages) == ["ampscale 0", "ampscale.backends 0", "ampscale.demo 0", "ampscale.torch 1", "ampscale.jax 1"]
    pages = {key.split()[0]: text for key, text in pages.items()}
    assert "create_scaler" in pages["ampscale"]
    assert "get_backend" in pages["ampscale.backends"]
    assert "run_demo" in pages["ampscale.demo"]
    assert "pip install 'ampscale[torch]'" in pages["ampscale.torch"]
    assert "pip install 'ampscale[jax]'" in pages["ampscale.jax"]


def test_help_with_every_framework_installed() -> None:
    """With the frameworks present, ``dir`` lists the helpers and ``help`` renders them all."""
    import importlib.util
    import inspect
    import pydoc

    expected = [name for name in ("jax", "torch") if importlib.util.find_spec(name) is not None]
    assert [name for name in ("jax", "torch") if name in dir(ampscale)] == expected
    assert not hasattr(ampscale, "cupy")
    dict(inspect.getmembers(ampscale))
    text = pydoc.render_doc(ampscale, renderer=pydoc.plaintext)
    assert "<object object" not in text
    for name in expected:
        module = getattr(ampscale, name)
        assert "<object object" not in pydoc.render_doc(module, renderer=pydoc.plaintext)


def test_signatures_read_as_what_the_default_means() -> None:
    import inspect

    signature = str(inspect.signature(ampscale.create_scaler))
    assert "init_scale: 'float' = <preset default>" in signature
    assert "object at 0x" not in signature
    assert "axis_name: 'Any' = <the scaler's axis_name>" in str(inspect.signature(ampscale.Scaler.unscale))


def _undocumented(module_name: str) -> list[str]:
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    missing = []
    for name in getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")]):
        obj = getattr(module, name)
        if not getattr(obj, "__module__", "ampscale").startswith("ampscale"):
            continue  # re-exported from a framework (torch's OptState): documented there
        if inspect.isfunction(obj) and not obj.__doc__:
            missing.append(f"{module_name}.{name}")
        if not inspect.isclass(obj):
            continue
        if not obj.__doc__:
            missing.append(f"{module_name}.{name}")
        for klass in obj.__mro__:
            if not klass.__module__.startswith("ampscale"):
                continue
            for attr, value in vars(klass).items():
                function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if not attr.startswith("_") and inspect.isfunction(function) and not function.__doc__:
                    missing.append(f"{module_name}.{name}.{attr}")
    return missing


def test_every_public_function_class_and_method_has_a_docstring() -> None:
    import importlib.util

    modules = ["ampscale", "ampscale.backends", "ampscale.demo", "ampscale.__main__"]
    modules += [f"ampscale.{name}" for name in ("torch", "jax") if importlib.util.find_spec(name) is not None]
    assert [name for module in modules for name in _undocumented(module)] == []
