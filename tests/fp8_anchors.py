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
import functools
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


# ---------------------------------------------------------------- MS-AMP (transcribed)
#
# MS-AMP is not on PyPI and its casts assert CUDA tensors, but its scale rule is a TorchScript
# function: compiled here from its own text (Azure/MS-AMP@9746ea8, msamp/common/tensor/meta.py,
# ScalingMeta.compute_scaling_factor), as MS-AMP compiles it.


@functools.cache
def msamp_scaling_factor() -> Any:
    """``ScalingMeta.compute_scaling_factor``, its body verbatim, compiled by TorchScript."""
    import warnings

    import torch

    def compute_scaling_factor(amax, scale, fp_max: float, margin: int):  # type: ignore[no-untyped-def]
        exp = torch.floor(torch.log2(fp_max / amax)) - margin
        sf = torch.round(torch.pow(2, torch.abs(exp)))
        sf = torch.where(amax > 0.0, sf, scale)
        sf = torch.where(torch.isfinite(amax), sf, scale)
        sf = torch.where(exp < 0, 1 / sf, sf)
        return sf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.script(compute_scaling_factor)


def msamp_run(stream: list[float], fp_max: float, window: int, margin: int = 0) -> list[tuple]:
    """One ScalingMeta over ``stream``: per step, the scale the cast uses, then the state after
    the optimizer's update.

    Cast (msamp/common/tensor/cast.py, ``TypeCast.cast_to_fp8``, with ``sync=True``): in time
    while ``window_size == 1 or amax_counter < window_size`` (``ScalingMeta.is_in_time_scaling``)
    it sets ``amax[0] = |x|.max()``, turns nan into inf ("NCCL-ReduceMax ignores NAN") and
    rescales with ``reset_scaling_factor`` (``compute_scaling_factor(amax[0], scale, fp_max, 0)``);
    else the amax of the cast lands in ``amax[0]``. Update (msamp/optim/optimizer.py,
    ``_update_scaling_factors``): non-finite ``amax[0]`` set to 0, ``sf`` from the window's max,
    roll by +1, ``amax[0] = 0``, ``counter += 1`` (0 after a non-finite amax), ``scale = sf``.
    Returns ``(cast scale, scale, amax window [W] newest-first after index 0, counter)``.
    """
    import torch

    amax = torch.zeros(window, dtype=torch.float32)
    scale = torch.ones((), dtype=torch.float32)
    counter = torch.zeros((), dtype=torch.int32)
    out = []
    for a in stream:
        value = torch.tensor(a, dtype=torch.float32)
        if window == 1 or bool(counter < window):
            amax[0] = value
            amax[0].nan_to_num_(nan=torch.inf, posinf=torch.inf)
            scale = msamp_scaling_factor()(amax[0], scale, fp_max, 0)
        else:
            amax[0] = value
        cast_scale = float(scale)
        amaxs = amax.view(1, window)
        mask_inf_nan = ~torch.isfinite(amaxs[:, 0])
        amaxs[mask_inf_nan, 0] = 0
        sf = msamp_scaling_factor()(amaxs.max(1).values, scale.view(1), fp_max, margin)
        amaxs.copy_(amaxs.roll(1, dims=1))
        amaxs[:, 0] = 0
        counter += 1
        if bool(mask_inf_nan[0]):
            counter.zero_()
        scale = sf.view(())
        out.append((cast_scale, float(scale), amax.numpy().copy(), int(counter)))
    return out


# ---------------------------------------------------------------- torchao's removed delayed scaling (transcribed)


def torchao_delayed_run(stream: list[float], fmt: str, length: int = 16) -> list[tuple]:
    """torchao's delayed scaling as it was before pytorch/ao#1753 (at d37019636^), one tensor.

    First cast (torchao/float8/float8_scaling_utils.py,
    ``_maybe_initialize_amaxes_scales_for_float8_cast``): ``amax_history[0] = amax`` and
    ``scale = amax_history_to_scale(amax_history)``; every cast then records ``cur_amax``.
    Sync (torchao/float8/float8_linear_utils.py, ``sync_float8_amax_and_scale_history``):
    ``_update_history_stack`` (``roll(h, 1)``, ``h[0] = cur_amax``), then
    ``amax_history_to_scale_stack`` (``amax_to_scale(max(h))``, torchao/float8/float8_utils.py;
    ``amax_to_scale`` is unchanged since, so the installed one is used). Returns ``(cast scale,
    scale after the sync, history newest first)``.
    """
    import torch
    from torchao.float8.float8_utils import amax_to_scale

    dtype = getattr(torch, f"float8_{fmt}")
    history = torch.zeros(length, dtype=torch.float32)
    scale = torch.ones((), dtype=torch.float32)
    initialized = False
    out = []
    for a in stream:
        cur_amax = torch.tensor(a, dtype=torch.float32)
        if not initialized:
            history[0] = cur_amax
            scale = amax_to_scale(torch.max(history), dtype)
        cast_scale = float(scale)
        stack = history.view(1, length)
        new_stack = torch.roll(stack, 1, dims=1)
        new_stack[:, 0] = cur_amax
        stack.copy_(new_stack)
        scale = amax_to_scale(torch.max(stack, dim=1).values, dtype).view(())
        initialized = True
        out.append((cast_scale, float(scale), history.numpy().copy()))
    return out


# ---------------------------------------------------------------- TE block scaling and MXFP8 (transcribed)


def te_block_quantize(x: np.ndarray, fmt: str, block: tuple[int, int], pow2: bool, eps: float = 0.0) -> tuple:
    """TE's ``Float8BlockScaling`` cast, transcribed from its kernels
    (transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu for 1x128,
    quantize_transpose_square_blockwise.cu for 128x128): per block ``amax = fmaxf(amax, fabsf(x))``
    from 0 (nan elements dropped), ``scale = compute_scale_from_types<IType, OType>(amax, eps,
    pow2)`` (recipe_common.cuh: ``value_for_inf`` is the input type's largest value),
    ``scale_inv = 1.0 / scale`` (double, stored as float), data ``OType(float(x) * scale)``
    (``__nv_fp8_e4m3`` / ``e5m2`` saturate finite values: a clip, then ml_dtypes' RNE cast).
    The tensor is flattened to ``[rows, K]`` and the tail blocks hold only valid elements."""
    import ml_dtypes

    value_for_inf = float(np.finfo(x.dtype).max) if x.dtype != ml_dtypes.bfloat16 else float.fromhex("0x1.fep+127")
    fp8_max = {"e4m3fn": 448.0, "e5m2": 57344.0}[fmt]
    flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
    rows, columns = flat.shape
    block_rows, block_columns = block
    row_blocks, column_blocks = -(-rows // block_rows), -(-columns // block_columns)
    scale_inv = np.empty((row_blocks, column_blocks), np.float32)
    q = np.empty(flat.shape, getattr(ml_dtypes, f"float8_{fmt}"))
    for i in range(row_blocks):
        for j in range(column_blocks):
            tile = flat[i * block_rows : (i + 1) * block_rows, j * block_columns : (j + 1) * block_columns]
            amax = F32(0.0)
            for value in tile.reshape(-1):
                amax = np.fmax(amax, np.abs(value))
            scale = F32(te_current_scale(float(amax), fp8_max, pow2, eps, value_for_inf))
            scale_inv[i, j] = F32(1.0 / float(scale))
            with np.errstate(all="ignore"):
                scaled = np.clip(tile * scale, -fp8_max, fp8_max)
            q[i * block_rows : (i + 1) * block_rows, j * block_columns : (j + 1) * block_columns] = scaled.astype(
                q.dtype
            )
    if block == (1, 128):
        scale_inv = scale_inv.reshape(*x.shape[:-1], column_blocks)
    return q.reshape(x.shape), scale_inv


def te_float_to_e8m0(value: np.float32) -> int:
    """transformer_engine/common/util/ptx_arch_spec.cuh ``float_to_e8m0`` (the path off
    Blackwell; on Blackwell ``cvt.rp.satfinite.ue8m0x2.f32``, the same rounding)."""
    if np.isnan(value):
        return 0xFF
    if np.isinf(value):
        return 0xFE
    if value == 0:
        return 0x00
    bits = int(np.asarray(value, np.float32).view(np.uint32))
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if (mantissa > 0 and exponent != 0xFE) and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def te_mxfp8_quantize(x: np.ndarray, fmt: str, block: int = 32) -> tuple:
    """TE's MXFP8 rowwise cast (transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh): per
    32 values ``thread_amax = fmaxf(thread_amax, fabsf(elt))`` (nan dropped), ``biased =
    float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp)`` (``1.0 / max_norm`` as a
    float), ``block_scale_inverse = exp2f_rcp(biased)`` (util/ptx.cuh), data
    ``cvt.rn.satfinite(float(x) * block_scale_inverse)``."""
    import ml_dtypes

    fp8_max = {"e4m3fn": 448.0, "e5m2": 57344.0}[fmt]
    rcp = F32(1.0 / fp8_max)
    blocks = x.astype(np.float32).reshape(-1, block)
    q = np.empty(blocks.shape, getattr(ml_dtypes, f"float8_{fmt}"))
    scales = np.empty(blocks.shape[0], np.uint8)
    for k, row in enumerate(blocks):
        amax = F32(0.0)
        for value in row:
            amax = np.fmax(amax, np.abs(value))
        with np.errstate(all="ignore"):
            biased = te_float_to_e8m0(F32(amax * rcp))
        if biased == 255:
            inverse = np.uint32(0x7FFFFFFF).view(np.float32)
        elif biased == 254:
            inverse = np.uint32(0x00400000).view(np.float32)
        else:
            inverse = np.uint32((254 - biased) << 23).view(np.float32)
        scales[k] = biased
        with np.errstate(all="ignore"):
            q[k] = np.clip(row * inverse, -fp8_max, fp8_max).astype(q.dtype)
    return q.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def te_mxfp8_dequantize(q: np.ndarray, scales: np.ndarray, dtype: Any, block: int = 32) -> np.ndarray:
    """transformer_engine/common/cast/mxfp8/dequantize_mxfp8.cuh: ``OType(exp2f(biased) *
    float(q))``, ``exp2f`` (util/ptx.cuh) giving nan for 255 and ``2**-127`` for 0."""
    out = np.empty(q.shape, np.float32).reshape(-1, block)
    for k, (row, biased) in enumerate(zip(q.astype(np.float32).reshape(-1, block), scales.reshape(-1), strict=True)):
        if biased == 255:
            power = np.uint32(0x7FFFFFFF).view(np.float32)
        elif biased == 0:
            power = np.uint32(0x00400000).view(np.float32)
        else:
            power = np.uint32(int(biased) << 23).view(np.float32)
        with np.errstate(all="ignore"):
            out[k] = power * row
    return out.reshape(q.shape).astype(dtype)


# ---------------------------------------------------------------- microxcaling (its own code, transcribed)
#
# microsoft/microxcaling@7bc4195 (MIT), mx/mx_ops.py and mx/elemwise_ops.py: the torch functions
# below are its text, the CUDA and sparse branches left out; run on torch's CPU.


def microxcaling_quantize_mx(A: Any, fmt: str, block_size: int = 32) -> Any:
    """``_quantize_mx(A, scale_bits=8, elem_format, shared_exp_method="max", axes=[-1],
    block_size, round="nearest", flush_fp32_subnorms=False)`` for fp8_e4m3 / fp8_e5m2, the
    last axis a multiple of ``block_size``."""
    import torch

    FP32_EXPONENT_BIAS = 127
    FP32_MIN_NORMAL = 2 ** (-FP32_EXPONENT_BIAS + 1)
    # mx/formats.py _get_format_params: fp8_e4m3 ebits 4, mbits 5, emax 2**(4-1), max_norm 2**8 * 1.75;
    # fp8_e5m2 ebits 5, mbits 4, emax 2**(5-1) - 1, max_norm 2**15 * 1.75
    ebits, mbits, emax, max_norm = {"e4m3fn": (4, 5, 8, 448.0), "e5m2": (5, 4, 15, 57344.0)}[fmt]
    scale_bits = 8

    def _shared_exponents(A, axes):
        shared_exp = A
        for axis in axes:
            shared_exp, _ = torch.max(torch.abs(shared_exp), dim=axis, keepdim=True)
        shared_exp = torch.floor(torch.log2(shared_exp + FP32_MIN_NORMAL * (shared_exp == 0).type(shared_exp.dtype)))
        return shared_exp

    def _safe_lshift(x, bits, exp):
        return x / (2**exp) * (2**bits)

    def _safe_rshift(x, bits, exp):
        return x / (2**bits) * (2**exp)

    def _round_mantissa(A):
        return torch.sign(A) * torch.floor(torch.abs(A) + 0.5)

    def _quantize_elemwise_core(A, bits, exp_bits, max_norm):
        out = A
        private_exp = torch.floor(torch.log2(torch.abs(A) + (A == 0).type(A.dtype)))
        min_exp = -(2 ** (exp_bits - 1)) + 2
        private_exp = private_exp.clip(min=min_exp)
        out = _safe_lshift(out, bits - 2, private_exp)
        out = _round_mantissa(out)
        out = _safe_rshift(out, bits - 2, private_exp)
        out = torch.clamp(out, min=-max_norm, max=max_norm)
        out[float("Inf") == A] = float("Inf")
        out[-float("Inf") == A] = -float("Inf")
        out[float("NaN") == A] = float("NaN")
        return out

    # _reshape_to_blocks with axes=[-1]: [..., K] -> [..., K / block, block]
    A = A.reshape(*A.shape[:-1], A.shape[-1] // block_size, block_size)
    shared_exp = _shared_exponents(A, axes=[A.ndim - 1])
    shared_exp = shared_exp - emax
    scale_emax = 2 ** (scale_bits - 1) - 1
    shared_exp[shared_exp > scale_emax] = float("NaN")
    shared_exp[shared_exp < -scale_emax] = -scale_emax
    A = A / (2**shared_exp)
    A = _quantize_elemwise_core(A, mbits, ebits, max_norm)
    A = A * (2**shared_exp)
    return A.reshape(*A.shape[:-2], -1)
