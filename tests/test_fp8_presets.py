"""Each FP8 preset against its anchor, bit for bit, over hypothesis-drawn amax streams.

Streams mix normal amaxes with 0 (a tensor that did not run), subnormals, float32's smallest
normal, FLT_MAX / 2, inf, nan, isolated spikes and runs of zeros; history lengths 1, 2, 16 and
1024; margins 0 to 3; both roles (E4M3FN forward, E5M2 backward). ampscale runs on the NumPy
backend here (tests/test_fp8_backends.py shows JAX, torch and the emitted code agree with it).
Compared after every update: the scale, the inverse scale and the history (in the anchor's
layout). A nan is compared as "nan" (its payload is not specified by any anchor).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampscale.fp8 as fp8

os.environ.setdefault("KERAS_BACKEND", "jax")
from tests import fp8_anchors as anchors

SUBNORMAL = float(np.float32(1e-40))
TINY = float(np.finfo(np.float32).tiny)
HALF_MAX = float(np.float32(np.finfo(np.float32).max / 2))
SPECIAL = [
    0.0,
    float(np.float32(1e-45)),
    SUBNORMAL,
    TINY,
    float(np.float32(3e-38)),
    float(np.float32(1e-36)),
    HALF_MAX,
    math.inf,
    math.nan,
]
normal = st.floats(0.0009765625, 16384.0, width=32)
spike = st.floats(16384.0, float(np.float32(3e38)), width=32)
amax_value = st.one_of(normal, normal, normal, spike, st.sampled_from(SPECIAL))
streams = st.lists(
    st.one_of(amax_value.map(lambda a: [a]), st.integers(2, 6).map(lambda n: [0.0] * n)), min_size=1, max_size=14
).map(lambda parts: [a for part in parts for a in part])
lengths = st.sampled_from([1, 2, 16, 1024])
margins = st.integers(0, 3)
roles = st.sampled_from(["forward", "backward"])
CASES = settings(
    max_examples=int(os.environ.get("AMPSCALE_FP8_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def bits(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return np.asarray(x, np.float32).view(np.uint32).tobytes().hex()


def same(a, b) -> bool:
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    return a.shape == b.shape and [bits(x) for x in a.tolist()] == [bits(x) for x in b.tolist()]


def ours(preset: str, stream: list[float], role: str, **settings_) -> list[tuple]:
    """ampscale's (scale, scale_inv, canonical history) after each update, one slot."""
    f8 = fp8.create_fp8_scaler(preset, slots={"t": role}, **settings_)
    out = []
    for a in stream:
        f8 = f8.update(np.asarray([a], np.float32))
        s = f8.state
        out.append((float(s.scale[0]), float(s.scale_inv[0]), np.asarray(f8.history(0)).copy()))
    return out


def fmt_of(role: str, formats: str = "hybrid") -> str:
    return {"hybrid": {"forward": "e4m3fn", "backward": "e5m2"}, "e4m3fn": {"forward": "e4m3fn", "backward": "e4m3fn"}}[
        formats
    ][role]


def fp8_max(role: str) -> float:
    return fp8.FORMATS[fmt_of(role)]


def te_layout(canonical: np.ndarray) -> np.ndarray:
    """ampscale's last L amaxes as TE keeps them: row 0 the (reset) current amax, then the
    L-1 newest, oldest first."""
    out = canonical.copy()
    out[0] = 0.0
    return out


def check_te_like(mine: list[tuple], theirs: list[tuple], reciprocal: bool = True) -> None:
    for t, ((s, s_inv, h), (ts, th)) in enumerate(zip(mine, theirs, strict=True)):
        assert same(s, ts), f"step {t}: scale {s!r} != anchor {ts!r}"
        if reciprocal:
            with np.errstate(divide="ignore"):
                assert same(s_inv, np.float32(1.0) / np.float32(ts)), f"step {t}: scale_inv {s_inv!r}"
        assert same(te_layout(h), th), f"step {t}: history {h} != anchor {th}"


@CASES
@given(stream=streams, length=lengths, margin=margins, role=roles, algo=st.sampled_from(["max", "most_recent"]))
def test_te_delayed_matches_the_fused_kernel(stream, length, margin, role, algo):
    mine = ours("te_delayed", stream, role, history_len=length, margin=margin, amax_algo=algo)
    check_te_like(mine, anchors.te_fused_run(stream, fp8_max(role), length, algo, margin))


@CASES
@given(stream=streams, margin=margins, role=roles)
def test_megatron_is_the_fused_kernel_with_one_most_recent_amax(stream, margin, role):
    mine = ours("megatron", stream, role, margin=margin)
    check_te_like(mine, anchors.te_fused_run(stream, fp8_max(role), 1, "most_recent", margin))


@CASES
@given(stream=streams, length=lengths, margin=margins, role=roles, algo=st.sampled_from(["max", "most_recent"]))
def test_te_delayed_unfused_matches_te_own_functions(stream, length, margin, role, algo):
    pytest.importorskip("torch")
    mine = ours("te_delayed_unfused", stream, role, history_len=length, margin=margin, amax_algo=algo)
    check_te_like(mine, anchors.te_unfused_run(stream, fp8_max(role), length, algo, margin))


@CASES
@given(stream=streams, length=lengths, margin=margins, role=roles, algo=st.sampled_from(["max", "most_recent"]))
def test_te_jax_delayed_matches_te_own_functions(stream, length, margin, role, algo):
    pytest.importorskip("jax")
    mine = ours("te_jax_delayed", stream, role, history_len=length, margin=margin, amax_algo=algo)
    check_te_like(mine, anchors.te_jax_run(stream, fmt_of(role), length, algo, margin))


@CASES
@given(stream=streams, role=roles, pow2=st.booleans(), eps=st.sampled_from([0.0, 1e-12, 1e-30]))
def test_te_current_matches_the_kernel_transcription(stream, role, pow2, eps):
    mine = ours("te_current", stream, role, pow2="mask" if pow2 else "none", eps=eps)
    for t, (a, (s, s_inv, h)) in enumerate(zip(stream, mine, strict=True)):
        expected = anchors.te_current_scale(a, fp8_max(role), pow2, np.float32(eps))
        assert same(s, expected), f"step {t}: amax {a!r}: scale {s!r} != {expected!r}"
        assert same(s_inv, np.float32(1.0) / np.float32(expected))
        assert same(h[-1:], [a])


@CASES
@given(stream=streams, role=roles, rowwise=st.booleans())
def test_torchao_matches_amax_to_scale(stream, role, rowwise):
    pytest.importorskip("torchao")
    preset = "torchao_rowwise" if rowwise else "torchao_tensorwise"
    formats = "e4m3fn" if rowwise else "hybrid"
    mine = ours(preset, stream, role)
    for t, (a, (s, _s_inv, _h)) in enumerate(zip(stream, mine, strict=True)):
        expected = anchors.torchao_scale(a, fmt_of(role, formats), pow2=rowwise)
        assert same(s, expected), f"step {t}: amax {a!r}: scale {s!r} != torchao {expected!r}"


def test_torchao_pow2_rounds_up_below_a_power_of_two_as_torch_log2():
    """Every float32 within 2**12 ulps below each power of two, and a sweep: ampscale's
    ``floor_log2`` against torch's own ``exp2(floor(log2(s)))`` on the CPU."""
    torch = pytest.importorskip("torch")
    from ampscale.fp8._ops import Fp8ArrayOps

    top = np.arange((1 << 23) - (1 << 12), 1 << 23, dtype=np.uint32)
    biased = np.arange(1, 255, dtype=np.uint32)
    near = ((biased[:, None] << 23) | top[None, :]).reshape(-1).view(np.float32)
    sweep = np.random.default_rng(0).integers(0x00800000, 0x7F800000, 2_000_000, dtype=np.uint32).view(np.float32)
    values = np.concatenate([near, sweep, np.float32([1023.99994, 1048575.9, 1.0, 0.0, np.inf])])
    expected = torch.exp2(torch.floor(torch.log2(torch.from_numpy(values)))).numpy()
    got = Fp8ArrayOps("numpy").pow2_floor_log2(values)
    wrong = np.flatnonzero(got.view(np.uint32) != expected.view(np.uint32))
    assert wrong.size == 0, [(values[i], got[i], expected[i]) for i in wrong[:5]]
    assert got[-5] == 1024.0  # 1023.99994: a mask would give 512


@CASES
@given(stream=streams, length=lengths, role=roles)
def test_flax_matches_update_fp8_meta(stream, length, role):
    """flax's scale variable after call t+1 is the scale ampscale holds after update t: flax
    computes the scale of the window ending at a_t at its next call, then casts with it."""
    pytest.importorskip("flax")
    mine = ours("flax", stream, role, history_len=length)
    theirs = anchors.flax_run([*stream, 1.0], fmt_of(role), length)
    for t, (s, s_inv, h) in enumerate(mine):
        flax_scale, _ = theirs[t + 1]
        _, flax_history = theirs[t]
        assert same(s_inv, flax_scale), f"step {t}: scale_inv {s_inv!r} != flax {flax_scale!r}"
        with np.errstate(divide="ignore"):
            assert same(s, np.float32(1.0) / np.float32(flax_scale))
        assert same(np.concatenate([h[-1:], h[:-1]]), flax_history), f"step {t}: history"


@CASES
@given(stream=streams, length=lengths, role=roles, data=st.data())
def test_keras_matches_float8_bookkeeping(stream, length, role, data):
    pytest.importorskip("keras")
    skipped = data.draw(st.lists(st.booleans(), min_size=len(stream), max_size=len(stream)))
    f8 = fp8.create_fp8_scaler("keras", slots={"t": role}, history_len=length)
    theirs = anchors.keras_run(stream, fmt_of(role), length, skipped)
    for t, a in enumerate(stream):
        f8 = f8.update(np.asarray([a], np.float32), step_ok=not skipped[t])
        keras_scale, keras_history = theirs[t]
        s = f8.state
        assert same(s.scale_inv[0], keras_scale), f"step {t}: scale_inv {s.scale_inv[0]!r} != keras {keras_scale!r}"
        h = f8.history(0)
        assert same(np.concatenate([h[-1:], h[:-1]]), keras_history), f"step {t}: history"


def cast_scale_inv(f8, a: float, slot: int = 0) -> float:
    """The inverse scale the scaler's next cast of a tensor whose amax is ``a`` uses."""
    _q, scale_inv, _amax = f8.quantize(np.asarray([a], np.float32), slot)
    return float(scale_inv)


@CASES
@given(stream=streams, margin=margins, role=roles, window=st.sampled_from([1, 2, 16]))
def test_msamp_matches_its_scaling_meta(stream, margin, role, window):
    """MS-AMP's ScalingMeta (its TorchScript rule compiled from its own text, its cast and
    optimizer update transcribed): the scale each cast uses (in time during the warm-up), then
    the scale, the window and the warm-up counter after each update."""
    pytest.importorskip("torch")
    f8 = fp8.create_fp8_scaler("msamp", slots={"t": role}, history_len=window, margin=margin)
    theirs = anchors.msamp_run(stream, fp8_max(role), window, margin)
    for t, (a, (cast_scale, scale, window_values, counter)) in enumerate(zip(stream, theirs, strict=True)):
        with np.errstate(divide="ignore"):
            expected_inv = np.float32(1.0) / np.float32(cast_scale)
        assert same(cast_scale_inv(f8, a), expected_inv), f"step {t}: cast with 1/{cast_scale!r}"
        f8 = f8.update(np.asarray([a], np.float32))
        s = f8.state
        assert same(s.scale[0], scale), f"step {t}: scale {s.scale[0]!r} != MS-AMP {scale!r}"
        h = np.asarray(f8.history(0))
        assert same(np.concatenate([[0.0], h[1:][::-1]]), window_values), f"step {t}: window {h} vs {window_values}"
        assert int(s.filled[0]) == counter, f"step {t}: warm-up counter"


@CASES
@given(stream=streams, role=roles, data=st.data())
def test_torchao_delayed_matches_the_removed_delayed_scaling(stream, role, data):
    """torchao's delayed scaling before pytorch/ao#1753 (transcribed, with the installed
    ``amax_to_scale``): the first cast scales by its own amax, the first sync writes it twice,
    then 16 amaxes newest first; every sync records (a skipped optimizer step included)."""
    pytest.importorskip("torchao")
    skipped = data.draw(st.lists(st.booleans(), min_size=len(stream), max_size=len(stream)))
    f8 = fp8.create_fp8_scaler("torchao_delayed", slots={"t": role})
    theirs = anchors.torchao_delayed_run(stream, fmt_of(role))
    for t, (a, (cast_scale, scale, history)) in enumerate(zip(stream, theirs, strict=True)):
        with np.errstate(divide="ignore"):
            expected_inv = np.float32(1.0) / np.float32(cast_scale)
        assert same(cast_scale_inv(f8, a), expected_inv), f"step {t}: cast with 1/{cast_scale!r}"
        f8 = f8.update(np.asarray([a], np.float32), step_ok=not skipped[t])
        assert same(f8.state.scale[0], scale), f"step {t}: scale {f8.state.scale[0]!r} != torchao {scale!r}"
        assert same(np.asarray(f8.history(0))[::-1], history), f"step {t}: history"


@CASES
@given(stream=streams, pow2=st.booleans(), inf_scale=st.sampled_from(["bf16_max", "fp16_max", "flt_max"]))
def test_te_block_slots_match_compute_scale_from_types(stream, pow2, inf_scale):
    """One slot per block: TE's compute_scale_from_types (recipe_common.cuh, transcribed) with the
    input dtype's largest value for an overflowing scale."""
    from ampscale.fp8._config import INF_SCALE_VALUES

    mine = ours("te_block", stream, "forward", pow2="mask" if pow2 else "none", inf_scale=inf_scale)
    for t, (a, (s, s_inv, _h)) in enumerate(zip(stream, mine, strict=True)):
        expected = anchors.te_current_scale(a, 448.0, pow2, 0.0, INF_SCALE_VALUES[inf_scale])
        assert same(s, expected), f"step {t}: amax {a!r}: scale {s!r} != {expected!r}"
        assert same(s_inv, np.float32(1.0) / np.float32(expected))
