"""The anchors the FP8 presets reproduce: their own functions where they install on a CPU, else
independent transcriptions of their source, each citing its file and function.

* Transformer Engine (torch, unfused update; JAX ``DelayedScaleQuantizer``): TE's own Python
  functions, taken from the sources its ``transformer-engine`` meta wheel installs (the package
  itself does not import without CUDA, so only the functions are parsed out of the files and
  run, with their decorators left off: ``jit_fuser`` / ``jax.jit`` only compile them).
* Transformer Engine's fused CUDA update (``kernel_bulk``) and current scaling
  (``compute_scale_from_amax``): transcribed below, in NumPy float32, line by line.
* torchao, flax ``fp8_ops``, Keras 3 ``quantizers``: the installed packages' own functions.

Each anchor keeps its own state layout; the tests turn it into ampscale's canonical one.
"""

from __future__ import annotations

import ast
import enum
import importlib.metadata
import os
import typing
from typing import Any

import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def te_source(path: str) -> str:
    """The text of ``transformer_engine/<path>`` from the installed meta wheel."""
    dist = importlib.metadata.distribution("transformer_engine")
    return pathlib_read(dist.locate_file(f"transformer_engine/{path}"))


def pathlib_read(located: Any) -> str:
    with open(str(located), encoding="utf-8") as handle:
        return handle.read()


def extract(source: str, names: list[str], namespace: dict[str, Any], cls: str | None = None) -> dict[str, Any]:
    """Compile the functions ``names`` of ``source`` (methods of class ``cls``), undecorated."""
    tree = ast.parse(source)
    body = tree.body
    if cls is not None:
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls).body
    found = {}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            found[node.name] = node
    missing = set(names) - set(found)
    assert not missing, f"not in the anchor's source: {missing}"
    module = ast.Module(body=[found[name] for name in names], type_ignores=[])
    exec(compile(module, "<anchor>", "exec"), namespace)
    return {name: namespace[name] for name in names}


# ---------------------------------------------------------------- TE torch, unfused (its own)


def te_unfused_functions() -> dict[str, Any]:
    import torch

    namespace: dict[str, Any] = {"torch": torch, **{n: getattr(typing, n) for n in typing.__all__}}
    names = ["_update_amax_history", "_default_get_amax_and_update_history", "_default_sf_compute"]
    return extract(te_source("pytorch/quantization.py"), names, namespace)


def te_unfused_run(stream: list[float], fp8_max: float, length: int, algo: str, margin: int) -> list[tuple]:
    """TE's ``_amax_and_scale_update`` (quantization.py) over ``stream``, one slot.

    The quantizer's amax is the view ``amax_history[0]``: the step's amax lands there before
    the update. Returns ``(scale, history [L])`` after each update, TE's layout.
    """
    import torch

    fns = te_unfused_functions()
    history = torch.zeros(length, 1, dtype=torch.float32)
    scale = torch.ones(1, dtype=torch.float32)
    out = []
    for a in stream:
        history[0].fill_(a)
        new_history, amax = fns["_default_get_amax_and_update_history"](history, algo)
        new_scale = fns["_default_sf_compute"](amax, scale, fp8_max, margin)
        scale.copy_(new_scale)
        history.copy_(new_history)
        out.append((float(scale[0]), history[:, 0].numpy().copy()))
    return out


# ---------------------------------------------------------------- TE JAX (its own)


class AmaxComputeAlgo(enum.Enum):
    """Stand-in for ``transformer_engine.jax.quantize.helper.AmaxComputeAlgo``."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def te_jax_functions() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    namespace: dict[str, Any] = {
        "jnp": jnp,
        "jax": jax,
        "Optional": typing.Optional,
        "AmaxComputeAlgo": AmaxComputeAlgo,
    }
    source = te_source("jax/quantize/quantizer.py")
    fns = extract(source, ["compute_scale_from_amax"], namespace)
    methods = ["_update_amax_history", "_compute_scale", "_roll_and_reset_amax_history"]
    fns.update(extract(source, methods, namespace, cls="DelayedScaleQuantizer"))
    return fns


def te_jax_run(stream: list[float], fmt: str, length: int, algo: str, margin: int) -> list[tuple]:
    """``DelayedScaleQuantizer.update`` (quantizer.py) over ``stream``: set h[0], scale from
    the window, roll and reset h[0]; TE's own three steps, jitted as TE jits them."""
    import jax
    import jax.numpy as jnp

    fns = te_jax_functions()
    update_history = jax.jit(fns["_update_amax_history"])
    compute_scale = jax.jit(fns["_compute_scale"], static_argnums=(2, 3, 4))
    roll = jax.jit(fns["_roll_and_reset_amax_history"])
    q_dtype = getattr(jnp, f"float8_{fmt}")
    algo_enum = AmaxComputeAlgo.MAX if algo == "max" else AmaxComputeAlgo.MOST_RECENT
    history = jnp.zeros((length,), jnp.float32)
    scale = jnp.ones((1,), jnp.float32)
    out = []
    for a in stream:
        history = update_history(history, jnp.asarray([a], jnp.float32))
        scale = compute_scale(history, scale, q_dtype, algo_enum, float(margin))
        history = roll(history)
        out.append((float(np.asarray(scale)[0]), np.asarray(history).copy()))
    return out


# ---------------------------------------------------------------- TE fused kernel (transcribed)


def te_fused_run(stream: list[float], fp8_max: float, length: int, algo: str, margin: int) -> list[tuple]:
    """``kernel_bulk`` of transformer_engine/common/recipe/delayed_scaling.cu, one scale.

    The amax reduction buffer holds the step's amax (``torch.cat`` of the ``amax_history[0]``
    views, reduced), so ``last_amax`` is it unless it is 0. ``fmaxf`` drops nan.
    """
    history = np.zeros(length, F32)
    scale = F32(1.0)
    scaled_max = F32(fp8_max) * F32(2.0**-margin)  # fp8_dtype_max(dtype) * std::pow(2.f, -margin)
    out = []
    with np.errstate(all="ignore"):
        for a in stream:
            history[0] = F32(a)
            buffer = F32(a)
            last_amax = buffer if buffer != F32(0.0) else history[0]
            amax = F32(0.0)
            if last_amax != F32(0.0):
                values = [history[i + 1] if i < length - 1 else last_amax for i in range(length)]
                for value in values:
                    amax = np.fmax(amax, value)  # fmaxf
                for i in range(length):
                    history[i] = values[i] if i > 0 else F32(0.0)
            if algo == "most_recent":
                amax = last_amax
            if np.isfinite(amax) and amax > F32(0.0):
                new_scale = F32(scaled_max / amax)
            else:
                new_scale = scale
            if np.isinf(new_scale):
                new_scale = FLT_MAX
            scale = F32(new_scale)
            out.append((float(scale), history.copy()))
    return out


# ---------------------------------------------------------------- TE current scaling (transcribed)


def te_current_scale(amax: float, fp8_max: float, pow2: bool, eps: float, value_for_inf: float = FLT_MAX) -> float:
    """``compute_scale_from_amax`` of transformer_engine/common/recipe/recipe_common.cuh."""
    a = F32(amax)
    with np.errstate(all="ignore"):
        if a < F32(eps):
            a = F32(eps)
        if np.isinf(a) or a == F32(0.0) or np.isnan(a):
            return 1.0
        scale = F32(F32(fp8_max) / a)  # __fdiv_rn
        if np.isinf(scale):
            scale = F32(value_for_inf)
        if pow2:
            scale = (np.asarray(scale, F32).view(np.uint32) & np.uint32(0xFF800000)).view(F32)
    return float(scale)


# ---------------------------------------------------------------- torchao (its own)


def torchao_scale(amax: float, fmt: str, pow2: bool) -> float:
    import torch
    from torchao.float8.float8_utils import amax_to_scale

    dtype = getattr(torch, f"float8_{fmt}")
    return float(amax_to_scale(torch.tensor(amax, dtype=torch.float32), dtype, round_scales_to_power_of_2=pow2))


# ---------------------------------------------------------------- flax fp8_ops (its own)


def flax_run(stream: list[float], fmt: str, length: int) -> list[tuple]:
    """``flax.linen.fp8_ops.update_fp8_meta`` over ``stream`` (the amax of ``x = [a]`` is a).

    Returns flax's variables ``(dequant scale, history [L], newest at 0)`` after each call.
    """
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    q_dtype = getattr(jnp, f"float8_{fmt}")
    scale = jnp.ones((1,), jnp.float32)
    history = jnp.zeros((length,), jnp.float32)
    out = []
    for a in stream:
        scale, history = fp8_ops.update_fp8_meta(jnp.asarray([a], jnp.float32), q_dtype, scale, history)
        out.append((float(np.asarray(scale)[0]), np.asarray(history).copy()))
    return out


# ---------------------------------------------------------------- Keras 3 (its own)


def keras_run(stream: list[float], fmt: str, length: int, skipped: list[bool] | None = None) -> list[tuple]:
    """Keras's ``Dense._float8_call`` bookkeeping (keras/src/layers/core/dense.py) over ``stream``.

    The new scale comes from ``compute_float8_scale(max(history), scale, fp8_max)`` with the
    history before this step's amax, the history from ``compute_float8_amax_history``; both
    reach the variables through the optimizer, which a skipped (non-finite) step skips whole.
    """
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import ml_dtypes
    from keras import ops, quantizers

    fp8_max = ops.cast(float(ml_dtypes.finfo(getattr(ml_dtypes, f"float8_{fmt}")).max), "float32")
    scale = ops.ones((1,), "float32")
    history = ops.zeros((length,), "float32")
    out = []
    for t, a in enumerate(stream):
        x = ops.convert_to_tensor(np.asarray([a], np.float32))
        new_scale = quantizers.compute_float8_scale(ops.max(history, axis=0), scale, fp8_max)
        new_history = quantizers.compute_float8_amax_history(x, history)
        if skipped is None or not skipped[t]:
            scale, history = ops.reshape(new_scale, (1,)), new_history
        out.append((float(np.asarray(scale).reshape(-1)[0]), np.asarray(history).copy()))
    return out


# ---------------------------------------------------------------- TE's _extra_state, pickled as TE does


def te_extra_state_bytes(recipe_fields: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """TE's ``_extra_state`` as ``TransformerEngineBaseModule.get_extra_state``
    (transformer_engine/pytorch/module/base.py) makes it: ``pickle.dumps`` of ``{"recipe",
    "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd", "extra_fp8_variables"}``
    with torch CPU tensors, as a uint8 tensor.

    The recipe is an instance of a class with TE's qualified name,
    ``transformer_engine.common.recipe.DelayedScaling`` (a dataclass with TE's fields, whose
    ``fp8_format`` is a ``Format`` enum member valued by a ``_FormatHelper`` named tuple, as in
    transformer_engine/common/recipe/__init__.py), from a module put in ``sys.modules`` for the
    pickling only: the bytes name the classes exactly as a TE 2.x checkpoint does.
    """
    import dataclasses
    import pickle
    import sys
    import types

    import torch

    names = ["transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe"]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names:
            module = types.ModuleType(name)
            module.__path__ = []  # type: ignore[attr-defined]
            sys.modules[name] = module
        recipe_module = sys.modules[names[-1]]

        class _FormatHelper(typing.NamedTuple):
            max_fwd: float
            max_bwd: float

        class Format(enum.Enum):
            E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
            E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
            E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
            HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

        class Recipe:
            pass

        @dataclasses.dataclass(repr=False)
        class DelayedScaling(Recipe):
            margin: int = 0
            fp8_format: Format = Format.HYBRID
            amax_history_len: int = 1024
            amax_compute_algo: Any = "max"
            scaling_factor_compute_algo: Any = None
            reduce_amax: bool = True
            fp8_dpa: bool = False
            fp8_mha: bool = False
            backward_override: Any = None

        for cls in (_FormatHelper, Format, Recipe, DelayedScaling):
            cls.__module__ = recipe_module.__name__
            cls.__qualname__ = cls.__name__
            setattr(recipe_module, cls.__name__, cls)
        fields = dict(recipe_fields)
        if isinstance(fields.get("fp8_format"), str):
            fields["fp8_format"] = Format[fields["fp8_format"]]
        state = {"recipe": DelayedScaling(**fields)}
        state.update({key: torch.as_tensor(np.asarray(value, np.float32)) for key, value in tensors.items()})
        state["extra_fp8_variables"] = {"num_gemms": 1, "fp8_checkpoint": True}
        raw = bytearray(pickle.dumps(state))
        return torch.frombuffer(raw, dtype=torch.uint8)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
