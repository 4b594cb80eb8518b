"""Independent transcriptions of each system's scale update, the oracles of the preset tests.

Each class copies its system's code path by path (sources in ``docs/presets.md`` and
``shared/reference/scaler-semantics.md``), in the system's own vocabulary and with its own
float semantics: float32 tensors or variables are emulated with NumPy float32 scalars, Python
floats stay Python floats, and torch's kernels (float32 scale times a C++ double factor) are
computed in float64 and rounded once. None of this code is shared with ampscale.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def f32(value: float) -> float:
    """Round to float32 like a C++ ``static_cast<float>`` (overflow gives inf)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(np.float32(value))


def f32_mul(a: float, b: float) -> float:
    """float32 * float32 product (operands rounded to float32 first)."""
    with np.errstate(all="ignore"):
        return float(F32(a) * F32(b))


def f32_div(a: float, b: float) -> float:
    with np.errstate(all="ignore"):
        return float(F32(a) / F32(b))


class TorchGradScaler:
    """``torch.amp.GradScaler.update`` via ``_amp_update_scale_`` (CPU/CUDA kernels)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = f32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.tracker = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = f32(self.scale * self.backoff_factor)  # float * double -> float
            self.tracker = 0
        else:
            successful = self.tracker + 1
            if successful == self.growth_interval:
                new_scale = f32(self.scale * self.growth_factor)
                if math.isfinite(new_scale):
                    self.scale = new_scale
                self.tracker = 0
            else:
                self.tracker = successful

    step = update


class JmpDynamicLossScale:
    """``jmp.DynamicLossScale.adjust`` (float32 arrays, one ``factor``)."""

    def __init__(self, loss_scale=2.0**15, period=2000, factor=2, min_loss_scale=1.0):
        self.scale = f32(loss_scale)
        self.counter = 0
        self.period = period
        self.factor = factor
        self.min_loss_scale = f32(min_loss_scale)

    def update(self, finite: bool) -> None:
        if finite:
            if self.counter == self.period - 1:
                grown = f32_mul(self.scale, self.factor)
                self.scale = grown if math.isfinite(grown) else self.scale
        else:
            self.scale = max(self.min_loss_scale, f32_div(self.scale, self.factor))
        self.counter = ((self.counter + 1) % self.period) * int(finite)

    step = update


class FlaxDynamicScale:
    """``flax.training.dynamic_scale.DynamicScale.value_and_grad``'s scale update."""

    def __init__(
        self, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, scale=65536.0, minimum_scale=F32_TINY
    ):
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.fin_steps = 0
        self.scale = f32(scale)
        self.minimum_scale = minimum_scale

    def update(self, finite: bool) -> None:
        grow = self.fin_steps == self.growth_interval
        fin_scale = min(f32_mul(self.scale, self.growth_factor), F32_MAX) if grow and finite else self.scale
        inf_scale = f32_mul(self.scale, self.backoff_factor)
        if self.minimum_scale is not None:
            inf_scale = max(inf_scale, f32(self.minimum_scale))
        self.scale = fin_scale if finite else inf_scale
        self.fin_steps = 0 if (grow or not finite) else self.fin_steps + 1

    step = update


class KerasLossScaleOptimizer:
    """Keras 3 ``LossScaleOptimizer``: ``step_counter == dynamic_growth_steps - 1``, x2 and /2."""

    def __init__(self, initial_scale=2.0**15, dynamic_growth_steps=2000):
        self.scale = f32(initial_scale)
        self.steps = dynamic_growth_steps
        self.step_counter = 0

    def update(self, finite: bool) -> None:
        if finite:
            if self.step_counter == self.steps - 1:
                self.step_counter = 0
                self.scale = f32_mul(self.scale, 2.0)
            else:
                self.step_counter += 1
        else:
            self.step_counter = 0
            self.scale = f32_div(self.scale, 2.0)

    step = update


class MegatronDynamicGradScaler:
    """``megatron.core.optimizer.grad_scaler.DynamicGradScaler.update`` (float32 CUDA tensors)."""

    def __init__(
        self,
        initial_scale=2.0**32,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    ):
        self.scale = f32(initial_scale)
        self.min_scale = f32(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf_flag: bool) -> None:
        if found_inf_flag:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(f32_mul(self.scale, self.backoff_factor), self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = f32_mul(self.scale, self.growth_factor)

    def step(self, finite: bool) -> None:
        self.update(not finite)


class DeepSpeedDynamicLossScaler:
    """DeepSpeed ``DynamicLossScaler.update_scale`` (ZeRO's scaler; Python floats)."""

    class AtMinimum(Exception):
        pass

    def __init__(
        self,
        init_scale=2.0**16,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=True,
    ):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    @property
    def scale(self) -> float:
        return float(self.cur_scale)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise self.AtMinimum("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def step(self, finite: bool) -> None:
        self.update_scale(not finite)


class ApexLossScaler:
    """Legacy ``apex.amp.scaler.LossScaler.update_scale`` (dynamic; Python floats)."""

    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
        self._loss_scale = min(max_loss_scale, init_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0

    @property
    def scale(self) -> float:
        return float(self._loss_scale)

    def update(self, finite: bool) -> None:
        if not finite:
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0

    step = update


class ApexHysteresisKernel:
    """apex ``update_scale_hysteresis`` CUDA kernel (``csrc/update_scale_hysteresis.cu``)."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = f32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, finite: bool) -> None:
        found_inf = not finite
        if found_inf:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.growth_tracker = 0
                return
        if found_inf:
            self.scale = f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = f32(self.scale * self.growth_factor)
                if math.isfinite(new_scale):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
        if not found_inf:
            self.hysteresis_tracker = self.hysteresis

    step = update


class PaddleGradScaler:
    """``paddle.amp.GradScaler._update`` (dygraph; float32 tensor scale)."""

    def __init__(
        self,
        init_loss_scaling=2.0**16,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
        decr_every_n_nan_or_inf=1,
    ):
        self._scale = f32(init_loss_scaling)
        self._incr_ratio = incr_ratio
        self._decr_ratio = decr_ratio
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._incr_count = 0
        self._decr_count = 0

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, finite: bool) -> None:
        if not finite:
            self._incr_count = 0
            self._decr_count = self._decr_count + 1
            if self._decr_count == self._decr_every_n_nan_or_inf:
                self._scale = f32_mul(self._scale, self._decr_ratio)
                self._decr_count = 0
        else:
            self._decr_count = 0
            self._incr_count = self._incr_count + 1
            if self._incr_count == self._incr_every_n_steps:
                self._scale = f32_mul(self._scale, self._incr_ratio)
                self._incr_count = 0

    step = update


class MindSporeDynamicLossScaler:
    """``mindspore.amp.DynamicLossScaler.adjust`` (float32 Parameters, floor 1)."""

    def __init__(self, scale_value, scale_factor, scale_window):
        self.scale = f32(scale_value)
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.counter = 0

    def update(self, finite: bool) -> None:
        if finite:
            if self.counter == self.scale_window - 1:
                grown = f32_mul(self.scale, self.scale_factor)
                self.scale = grown if math.isfinite(grown) else self.scale
        else:
            self.scale = max(1.0, f32_div(self.scale, self.scale_factor))
        self.counter = ((self.counter + 1) % self.scale_window) * int(finite)

    step = update


class TfKerasDynamicLossScale:
    """tf.keras 2 ``_DynamicLossScaleState.update`` (float32 variable, ``>=``, floor 1)."""

    def __init__(self, initial_loss_scale=2.0**15, growth_steps=2000, multiplier=2.0):
        self.scale = f32(initial_loss_scale)
        self.growth_steps = growth_steps
        self.multiplier = multiplier
        self.counter = 0

    def update(self, finite: bool) -> None:
        if finite:
            if self.counter + 1 >= self.growth_steps:
                grown = f32_mul(self.scale, self.multiplier)
                if math.isfinite(grown):
                    self.scale = grown
                self.counter = 0
            else:
                self.counter += 1
        else:
            self.counter = 0
            self.scale = max(f32_div(self.scale, self.multiplier), 1.0)

    step = update


def reference_for(preset: str, **s):
    """The reference model of ``preset`` built from ampscale-style settings ``s``.

    Only the settings each system actually has may appear in ``s``; the mapping to the
    system's own parameter names is the documented one (``docs/presets.md``).
    """
    if preset == "torch":
        return TorchGradScaler(
            s.get("init_scale", 2.0**16),
            s.get("growth_factor", 2.0),
            s.get("backoff_factor", 0.5),
            s.get("growth_interval", 2000),
        )
    if preset == "jmp":
        return JmpDynamicLossScale(
            s.get("init_scale", 2.0**15),
            s.get("growth_interval", 2000),
            s.get("growth_factor", 2),
            s.get("min_scale", 1.0),
        )
    if preset == "flax":
        return FlaxDynamicScale(
            s.get("growth_factor", 2.0),
            s.get("backoff_factor", 0.5),
            s.get("growth_interval", 2000),
            s.get("init_scale", 65536.0),
            s.get("min_scale", F32_TINY),
        )
    if preset == "keras":
        return KerasLossScaleOptimizer(s.get("init_scale", 2.0**15), s.get("growth_interval", 2000))
    if preset == "megatron":
        return MegatronDynamicGradScaler(
            s.get("init_scale", 2.0**32),
            s.get("min_scale", 1.0),
            s.get("growth_factor", 2.0),
            s.get("backoff_factor", 0.5),
            s.get("growth_interval", 1000),
            s.get("hysteresis", 2),
        )
    if preset == "deepspeed":
        consecutive = s.get("hysteresis_mode", "cumulative") == "consecutive"
        return DeepSpeedDynamicLossScaler(
            s.get("init_scale", 2.0**16),
            s.get("growth_interval", 1000),
            s.get("min_scale", 1.0),
            s.get("hysteresis", 2),
            consecutive,
            raise_error_at_min_scale=False,
        )
    if preset == "apex":
        return ApexLossScaler(
            s.get("init_scale", 2.0**16),
            s.get("growth_interval", 2000),
            s.get("min_scale"),
            s.get("max_scale", 2.0**24),
        )
    if preset == "paddle":
        return PaddleGradScaler(
            s.get("init_scale", 2.0**16),
            s.get("growth_factor", 2.0),
            s.get("backoff_factor", 0.5),
            s.get("growth_interval", 2000),
            s.get("hysteresis", 1),
        )
    if preset == "mindspore":
        return MindSporeDynamicLossScaler(
            s.get("init_scale", 2.0**24), s.get("growth_factor", 2), s.get("growth_interval", 2000)
        )
    if preset == "tf_keras":
        return TfKerasDynamicLossScale(s.get("init_scale", 2.0**15), s.get("growth_interval", 2000))
    raise ValueError(preset)
