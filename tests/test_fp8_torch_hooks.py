"""FP8 hooks on torch modules (:class:`ampscale.fp8.torch.Fp8Hooks`) against a product by hand.

A one-layer model with known weights, two micro-batches per optimizer step: the forward
output, the weight's gradient (through the cast output gradient) and the merged amaxes equal
a computation by hand with NumPy and ml_dtypes, bit for bit, at the first step (scales 1) and
at the next (scales from the merged amaxes); the history gets one entry per optimizer step.
With the loss scaler, an overflowing step is skipped and (preset ``ampscale``) changes no slot.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ml_dtypes  # noqa: E402

import ampscale  # noqa: E402
import ampscale.fp8 as fp8  # noqa: E402
from ampscale.fp8.torch import Fp8Hooks  # noqa: E402

# Values with more bits than FP8 keeps, so that every cast rounds (a missing cast changes the
# result); the merged amaxes (7, 3.5, 3.5) give power-of-two scales at the second step (64, 128,
# 16384), so the products of cast values are exact and no order of a sum can change a bit.
W = np.asarray([[0.53, -1.27, 2.1], [3.5, 0.77, -0.49]], np.float32)
MICRO_BATCHES = [
    (np.asarray([[1.1, 2.3, -3.7]], np.float32), np.asarray([[2.1, -1.3]], np.float32)),
    (np.asarray([[7.0, -0.55, 0.29]], np.float32), np.asarray([[0.45, 3.5]], np.float32)),
]


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def hand_qdq(x, scale, fmt, bound):
    scale, inverse = np.float32(scale), np.float32(1.0) / np.float32(scale)
    q = np.clip(np.float32(x) * scale, -bound, bound).astype(getattr(ml_dtypes, fmt)).astype(np.float32)
    return q * inverse


def model() -> torch.nn.Module:
    layer = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(W))
    return torch.nn.Sequential(layer)


def run_step(net, hooks):
    outputs = []
    for x, upstream in MICRO_BATCHES:
        y = net(torch.from_numpy(x))
        (y * torch.from_numpy(upstream)).sum().backward()
        outputs.append(y.detach().numpy())
    return outputs


def test_hooks_cast_and_merge_amaxes_as_computed_by_hand() -> None:
    net = model()
    hooks = Fp8Hooks(net, preset="te_delayed", history_len=4)
    assert hooks.fp8_scaler.config.slots == ("0.input", "0.weight", "0.grad_output")
    for step in range(2):
        scales = hooks.fp8_scaler.state.scale.numpy().copy()
        net.zero_grad()
        outputs = run_step(net, hooks)
        w_hat = hand_qdq(W, scales[1], "float8_e4m3fn", 448.0)
        grad_w = np.zeros_like(W)
        for (x, upstream), y in zip(MICRO_BATCHES, outputs, strict=True):
            x_hat = hand_qdq(x, scales[0], "float8_e4m3fn", 448.0)
            assert (bits(y) == bits(x_hat @ w_hat.T)).all(), step
            g_hat = hand_qdq(upstream, scales[2], "float8_e5m2", 57344.0)
            grad_w += g_hat.T @ x_hat
        assert (bits(net[0].weight.grad.numpy()) == bits(grad_w)).all(), step
        # the merge over both micro-batches: max |x| = 7, max |W| = 3.5, max |dy| = 3.5
        assert hooks.amax.tolist() == [7.0, 3.5, 3.5]
        hooks.update()
        assert hooks.amax.tolist() == [0.0, 0.0, 0.0]
    state = hooks.fp8_scaler.state
    assert state.scale.tolist() == [64.0, 128.0, 16384.0]
    assert state.filled.tolist() == [2, 2, 2]  # one history entry per optimizer step
    assert hooks.fp8_scaler.history()[:, -2:].tolist() == [[7.0, 7.0], [3.5, 3.5], [3.5, 3.5]]
    # the Parameter itself is back in the module after every forward
    assert isinstance(net[0]._parameters["weight"], torch.nn.Parameter)
    assert list(net.state_dict()) == ["0.weight"]


def test_removed_hooks_leave_the_model_as_it_was() -> None:
    net, plain = model(), model()
    hooks = Fp8Hooks(net, preset="te_delayed", history_len=2)
    hooks.update(step_ok=True)
    x = torch.tensor([[1.1, 2.3, -3.7]])
    assert not torch.equal(net(x), plain(x))  # cast with scales != 1
    hooks.remove()
    assert torch.equal(net(x), plain(x))


def test_hooks_with_the_loss_scaler_skip_an_overflowing_step() -> None:
    net = model()
    hooks = Fp8Hooks(net, preset="ampscale", history_len=4)
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0**4, growth_interval=100)
    history = []
    for step in range(3):
        net.zero_grad()
        x, upstream = MICRO_BATCHES[0]
        y = net(torch.from_numpy(x))
        loss = (y * torch.from_numpy(upstream)).sum()
        scaler.scale(loss).backward()
        if step == 1:
            net[0].weight.grad[0, 0] = float("inf")
        result = hooks.unscale_and_update(scaler, [p.grad for p in net.parameters()], loss=scaler.scale(loss))
        scaler = result.scaler
        history.append((bool(result.finite), hooks.fp8_scaler.state.filled.tolist(), scaler.get_scale()))
    assert history == [(True, [1, 1, 1], 16.0), (False, [1, 1, 1], 8.0), (True, [2, 2, 2], 8.0)]
    # the output gradients carry the loss scale: recorded as seen (16 * 2.1, then 8 * 2.1)
    assert hooks.fp8_scaler.history(2)[-2:].tolist() == [np.float32(2.1) * 16, np.float32(2.1) * 8]


def test_bad_slots_and_scalers_are_refused_before_anything_is_hooked() -> None:
    net = model()
    cases = [
        ({"slots": ["1.input"]}, "the model has no module '1'"),
        ({"slots": ["0.bias"]}, r"kind after the last '\.' must be one of"),
        ({"slots": ["0"]}, "must be names '<module>.<kind>'"),
        (
            {"fp8_scaler": fp8.create_fp8_scaler("te_delayed", ["0.input"], backend="torch"), "slots": ["0.weight"]},
            "fp8_scaler has no slot '0.weight'",
        ),
        (
            {"fp8_scaler": fp8.create_fp8_scaler("te_delayed", {"0.input": "backward"}, backend="torch")},
            "fp8_scaler has no slot|is a forward tensor",
        ),
        ({"fp8_scaler": fp8.create_fp8_scaler("te_delayed", ["0.input"])}, "an Fp8Scaler on torch tensors"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            Fp8Hooks(net, **kwargs)
    assert not net[0]._forward_pre_hooks
    assert not net[0]._forward_hooks
    relu = torch.nn.Sequential(torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"has no torch\.nn\.Linear"):
        Fp8Hooks(relu)
    with pytest.raises(ValueError, match="module '0' has no 'weight' parameter"):
        Fp8Hooks(relu, slots=["0.weight"])
