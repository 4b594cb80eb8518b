"""FP8 per-tensor scaling: delayed and current scaling as one more pure state machine.

Every tensor (a *slot*: an input, a weight or a gradient) has a scale, the inverse scale and a
history of its absolute maxima. :meth:`Fp8Scaler.update` runs one transition over every slot
(:mod:`ampscale.fp8._transition`), traced and emitted as Python and C like the loss scaler's,
with each quirk of the systems it reproduces (Transformer Engine, torchao, flax, Keras,
Megatron-Core) a named setting; casts saturate in each framework's own operations::

    import ampscale.fp8 as fp8

    f8 = fp8.create_fp8_scaler("te_delayed", slots={"fc1.x": "forward", "fc1.dy": "backward"})
    q, scale_inv, amax_x = f8.quantize(x, "fc1.x")     # saturate(x * scale) as E4M3FN
    ...
    f8 = f8.update({"fc1.x": amax_x, "fc1.dy": amax_dy}, step_ok=finite)   # once per optimizer step

``import ampscale.fp8`` imports no framework; each loads when its arrays are first used.
"""

from __future__ import annotations

from ampscale.fp8._amax import combine_amax
from ampscale.fp8._block import dequantize_block, dequantize_mx, quantize_block, quantize_mx
from ampscale.fp8._cast import (
    dequantize,
    e8m0_decode,
    e8m0_encode,
    fp8_dtype,
    quantize,
    quantize_dequantize,
    tensor_amax,
)
from ampscale.fp8._combined import Fp8Step, unscale_and_update
from ampscale.fp8._config import FORMATS, FP8_PRESETS, Fp8Config, Fp8Preset, make_fp8_config
from ampscale.fp8._distributed import reduce_amax
from ampscale.fp8._fused import amax, amax_and_cast
from ampscale.fp8._scaler import Fp8Scaler, create_fp8_scaler, init_state, update_state
from ampscale.fp8._state_dict import FP8_FORMAT_VERSION
from ampscale.fp8._transition import Fp8State

__all__ = [
    "FORMATS",
    "FP8_FORMAT_VERSION",
    "FP8_PRESETS",
    "Fp8Config",
    "Fp8Preset",
    "Fp8Scaler",
    "Fp8State",
    "Fp8Step",
    "amax",
    "amax_and_cast",
    "combine_amax",
    "create_fp8_scaler",
    "dequantize",
    "dequantize_block",
    "dequantize_mx",
    "e8m0_decode",
    "e8m0_encode",
    "fp8_dtype",
    "init_state",
    "make_fp8_config",
    "quantize",
    "quantize_block",
    "quantize_dequantize",
    "quantize_mx",
    "reduce_amax",
    "tensor_amax",
    "unscale_and_update",
    "update_state",
]
