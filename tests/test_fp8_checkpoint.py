"""FP8 checkpoints: JSON round trips across backends, recipe diffs, TE / flax / Keras imports,
and bad input that is refused with nothing changed."""

from __future__ import annotations

import json
import pickle
import types

import numpy as np
import pytest

import ampscale
import ampscale.fp8 as fp8
from ampscale.fp8._state_dict import from_flax, from_keras, from_transformer_engine
from tests import fp8_anchors as anchors

SLOTS = {"x": "forward", "dy": "backward"}
STREAM = [[3.0, 7.0], [0.0, np.inf], [np.nan, 1e-40], [100.0, 5.0], [0.5, 0.0]]


def run(f8, stream):
    for amax in stream:
        f8 = f8.update(amax if hasattr(amax, "detach") else np.asarray(amax, np.float32))
    return f8


def fields(f8):
    """Every field of the state, the history in canonical order (a restored state starts its ring
    at 0), the ring's head left out."""
    state = f8.state._replace(history=f8.history(), head=None)
    return [np.asarray(f.detach().numpy() if hasattr(f, "detach") else f) for f in state if f is not None]


def test_json_round_trip_continues_the_trajectory_on_another_backend():
    torch = pytest.importorskip("torch")
    f8 = run(fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4), STREAM[:3])
    saved = json.loads(json.dumps(f8.state_dict()))
    restored = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="torch", history_len=4).load_state_dict(saved)
    a = run(f8, STREAM[3:])
    b = run(restored, [torch.tensor(x, dtype=torch.float32) for x in STREAM[3:]])
    for x, y in zip(fields(a), fields(b), strict=True):
        assert x.tobytes() == y.tobytes()


def test_a_recipe_that_differs_is_named():
    saved = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4, margin=1).state_dict()
    other = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4)
    with pytest.raises(ampscale.StateDictError, match=r"margin: saved 1, this scaler 0"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["ampscale_fp8"].update(version=99), "newer"),
        (lambda d: d["ampscale_fp8"]["slots"][0].update(scale="0x1.8p+"), "hex"),
        (lambda d: d["ampscale_fp8"]["slots"][0].update(history="AAAA"), "base64 of 4"),
        (lambda d: d["ampscale_fp8"]["slots"][1].update(filled=-1), "filled"),
        (lambda d: d["ampscale_fp8"].update(extra=1), "unknown"),
    ],
)
def test_bad_checkpoints_are_refused(edit, message):
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4)
    saved = f8.state_dict()
    edit(saved)
    with pytest.raises(ampscale.StateDictError, match=message):
        f8.load_state_dict(saved)


def test_transformer_engine_extra_state_imports_and_continues_as_te():
    """A TE ``_extra_state`` dict (TE's layout: [L, N], row 0 the current amax) built from the
    fused-kernel transcription, imported, then driven on: the scales equal TE's, step by step."""
    length = 4
    stream = [3.0, 0.0, 7.0, 1e-40, 100.0, np.inf, 0.5, 2.0]
    fwd = anchors.te_fused_run(stream, 448.0, length, "max", 0)
    bwd = anchors.te_fused_run(stream, 57344.0, length, "max", 0)
    cut = 5
    extra = {
        "scale_fwd": np.float32([fwd[cut - 1][0]]),
        "amax_history_fwd": fwd[cut - 1][1][:, None],
        "scale_bwd": np.float32([bwd[cut - 1][0]]),
        "amax_history_bwd": bwd[cut - 1][1][:, None],
    }
    f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=length)
    pytest.importorskip("torch")
    raw = anchors.te_extra_state_bytes({"amax_history_len": length}, extra)
    with pytest.raises(ampscale.StateDictError, match="allow_pickle"):
        from_transformer_engine(raw, f8.config)
    f8 = f8.load_state_dict(from_transformer_engine(raw, f8.config, allow_pickle=True))
    for t in range(cut, len(stream)):
        f8 = f8.update(np.float32([stream[t], stream[t]]))
        assert f8.scales_sync() == {"x": fwd[t][0], "dy": bwd[t][0]}


def test_flax_and_keras_variables_import():
    pytest.importorskip("flax")
    stream = [3.0, 100.0, 0.0, 7.0]
    flax = anchors.flax_run([*stream, 1.0], "e4m3fn", 3)
    config = fp8.make_fp8_config("flax", {"x": "forward"}, history_len=3)
    scale, history = flax[len(stream) - 1]
    f8 = fp8.Fp8Scaler(config, fp8.init_state(config)).load_state_dict(
        from_flax({"x": (np.float32([scale]), history)}, config)
    )
    assert float(f8.state.scale_inv[0]) == flax[len(stream)][0]  # the scale flax computes next
    keras_config = fp8.make_fp8_config("keras", {"x": "forward"}, history_len=3)
    loaded = from_keras({"x": {"scale": np.float32([scale]), "amax_history": history}}, keras_config)
    assert loaded["ampscale_fp8"]["slots"][0]["scale_inv"] == float(np.float32(scale)).hex()


def test_bad_update_input_changes_nothing():
    f8 = fp8.create_fp8_scaler("ampscale", SLOTS, history_len=2)
    before = [f.copy() for f in fields(f8)]
    with pytest.raises(ValueError, match=r"amax must have shape \(2,\).*got shape \(3,\)"):
        f8.update(np.float32([1.0, 2.0, 3.0]))
    with pytest.raises(KeyError, match="unknown slot"):
        f8.update({"x": 1.0, "dy": 1.0, "nope": 2.0})
    with pytest.raises(KeyError, match="slot must be one of"):
        f8.scale("nope")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, fields(f8), strict=True))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"history_len": 0}, "'history_len' must be an integer from 1"),
        ({"formats": "e4m3"}, "'formats' must be one of"),
        ({"margin": 0.5}, "'margin' must be an integer"),
        ({"preset": "te"}, "'preset' must be one of"),
    ],
)
def test_bad_settings_name_the_setting(settings, message):
    preset = settings.pop("preset", "te_delayed")
    with pytest.raises(ValueError, match=message):
        fp8.create_fp8_scaler(preset, SLOTS, **settings)


def test_a_missing_recipe_setting_is_refused_by_name():
    """A checkpoint of margin 3 whose settings lost "margin" does not load into a margin-0 scaler
    (it did, silently, when missing settings went unchecked)."""
    saved = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4, margin=3).update(np.float32([2, 2])).state_dict()
    del saved["ampscale_fp8"]["settings"]["margin"]
    other = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4)
    before = fields(other)
    with pytest.raises(ampscale.StateDictError, match=r"misses recipe setting\(s\) \['margin'\]"):
        other.load_state_dict(saved)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, fields(other), strict=True))


def test_a_version_1_checkpoint_still_loads():
    """Version 1 wrote no amax_nan, warmup or cast: it is read as holding what version 1 did."""
    f8 = run(fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4), STREAM[:3])
    saved = f8.state_dict()
    saved["ampscale_fp8"]["version"] = 1
    for name in ("amax_nan", "warmup", "cast"):
        del saved["ampscale_fp8"]["settings"][name]
    restored = fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4).load_state_dict(saved)
    assert [x.tobytes() for x in fields(restored)] == [x.tobytes() for x in fields(f8)]
    saved["ampscale_fp8"]["settings"]["margin"] = 2
    with pytest.raises(ampscale.StateDictError, match="margin: saved 2, this scaler 0"):
        fp8.create_fp8_scaler("te_delayed", SLOTS, history_len=4).load_state_dict(saved)


TE_TENSORS = {
    "scale_fwd": [64.0],
    "amax_history_fwd": [[0.0], [3.0], [7.0]],
    "scale_bwd": [8192.0],
    "amax_history_bwd": [[0.0], [3.0], [7.0]],
}


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"amax_history_len": 3, "amax_compute_algo": "most_recent"}, "amax_compute_algo='most_recent'; this scaler"),
        ({"amax_history_len": 3, "fp8_format": "E4M3"}, "fp8_format='E4M3'; this scaler has 'HYBRID'"),
        ({"amax_history_len": 3, "margin": 1}, "margin=1; this scaler has 0"),
        ({"amax_history_len": 5}, "amax_history_len=5; this scaler has 3"),
        ({"amax_history_len": 3, "amax_compute_algo": len}, "callable amax_compute_algo"),
        ({"amax_history_len": 3, "scaling_factor_compute_algo": abs}, "scaling_factor_compute_algo"),
    ],
)
def test_every_te_recipe_field_that_changes_the_trajectory_is_checked(recipe, message):
    """Pickled as TE pickles it, or (for the callables, which the restricted unpickler refuses
    to look up at all) as the dict TE's set_extra_state sees after unpickling."""
    pytest.importorskip("torch")
    config = fp8.make_fp8_config("te_delayed", SLOTS, history_len=3)
    if any(callable(value) for value in recipe.values()):
        extra = {"recipe": types.SimpleNamespace(**recipe), **{k: np.float32(v) for k, v in TE_TENSORS.items()}}
    else:
        extra = anchors.te_extra_state_bytes(recipe, TE_TENSORS)
    with pytest.raises(ampscale.StateDictError, match=message):
        from_transformer_engine(extra, config, allow_pickle=True)


def test_a_te_2_checkpoint_loads_without_te():
    """TE 2.x pickles transformer_engine.common.recipe.DelayedScaling: plain unpickling imports
    TE, whose CPU meta package raises; ampscale's restricted unpickler reads it."""
    pytest.importorskip("torch")
    raw = anchors.te_extra_state_bytes({"amax_history_len": 3, "fp8_format": "HYBRID"}, TE_TENSORS)
    with pytest.raises(RuntimeError, match="meta package"):
        pickle.loads(raw.numpy().tobytes())
    config = fp8.make_fp8_config("te_delayed", SLOTS, history_len=3)
    f8 = fp8.Fp8Scaler(config, fp8.init_state(config)).load_state_dict(
        from_transformer_engine(raw, config, allow_pickle=True)
    )
    assert f8.scales_sync() == {"x": 64.0, "dy": 8192.0}
    assert np.asarray(f8.history(0)).tolist() == [0.0, 3.0, 7.0]


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    """Only TE's recipe classes and torch's tensor rebuilders are looked up: a pickle calling
    anything else is refused before it runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    raw = pickle.dumps({"recipe": Payload(), "scale_fwd": None})
    config = fp8.make_fp8_config("te_delayed", SLOTS, history_len=3)
    with pytest.raises(ampscale.StateDictError, match=r"refers to (io|builtins)\.open.*refusing"):
        from_transformer_engine(raw, config, allow_pickle=True)
    assert not marker.exists()


@pytest.mark.parametrize("other", ["numpy", "torch"])
def test_jax_checkpoints_load_on_numpy_and_torch_and_back(other):
    jax = pytest.importorskip("jax")
    pytest.importorskip(other)
    import jax.numpy as jnp

    stream = [[3.0, 7.0], [0.0, np.inf], [np.nan, 1e-40], [100.0, 5.0], [0.5, 0.0], [3e38, 2.0]]
    on = {"numpy": lambda a: np.asarray(a, np.float32), "jax": lambda a: jnp.asarray(a, jnp.float32)}
    if other == "torch":
        import torch

        on["torch"] = lambda a: torch.tensor(a, dtype=torch.float32)
    step = jax.jit(lambda scaler, amax: scaler.update(amax))
    for source, target in (("jax", other), (other, "jax")):
        f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend=source, history_len=4)
        for amax in stream[:3]:
            f8 = step(f8, on[source](amax)) if source == "jax" else f8.update(on[source](amax))
        saved = json.loads(json.dumps(f8.state_dict()))
        restored = fp8.create_fp8_scaler("te_delayed", SLOTS, backend=target, history_len=4).load_state_dict(saved)
        assert restored.framework == target
        for amax in stream[3:]:
            f8 = step(f8, on[source](amax)) if source == "jax" else f8.update(on[source](amax))
            restored = step(restored, on[target](amax)) if target == "jax" else restored.update(on[target](amax))
        for x, y in zip(fields(f8), fields(restored), strict=True):
            assert x.tobytes() == y.tobytes(), f"{source} -> {target}"
