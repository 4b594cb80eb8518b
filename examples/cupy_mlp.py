"""A hand-written CuPy MLP trained in float16 with ampscale (one fused kernel per step).

Forward and backward are written by hand, in float16, on float16 copies of float32 master
weights; the loss is scaled before the backward pass, and ``scaler.step`` unscales the
float32 master gradients with ampscale's single CUDA kernel, skips overflowing steps and
adjusts the scale, with no host synchronisation.

Run on a GPU: ``python examples/cupy_mlp.py``. ``--numpy`` runs the same code with NumPy on the
CPU (the test suite does, so the example never rots).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import ampscale


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--numpy", action="store_true", help="run on the CPU with NumPy instead of CuPy")
    args = parser.parse_args(argv)
    if args.numpy:
        xp: Any = np
    else:
        cupy = ampscale.info(["cupy"])["backends"]["cupy"]
        if not cupy["usable"]:  # one line that says what to do, as the demo does, not a traceback
            raise SystemExit(
                f"cupy_mlp.py cannot run on CuPy here: {cupy['problem']}; fix: {cupy['fix']}; "
                "or run it on the CPU: python examples/cupy_mlp.py --numpy"
            )
        import cupy as xp

    rng = np.random.default_rng(0)
    n = 4096
    angle = rng.uniform(0, np.pi, n)
    label = rng.integers(0, 2, n)
    x = np.stack([np.cos(angle) + label, np.sin(angle) * (1 - 2 * label) + 0.5 * label], 1)
    x = x + 0.1 * rng.standard_normal(x.shape)
    features = xp.asarray(np.concatenate([x, x**2, x[:, :1] * x[:, 1:]], 1).astype(np.float32))
    targets = xp.asarray(np.eye(2, dtype=np.float32)[label])

    params = [
        xp.asarray((rng.standard_normal((5, 64)) * np.sqrt(2 / 5)).astype(np.float32)),
        xp.zeros(64, dtype=xp.float32),
        xp.asarray((rng.standard_normal((64, 2)) * np.sqrt(2 / 64)).astype(np.float32)),
        xp.zeros(2, dtype=xp.float32),
    ]
    momentum = [xp.zeros_like(p) for p in params]
    scaler = ampscale.create_scaler(growth_interval=100)

    def sgd(params, grads, momentum):  # functional: returns new arrays
        momentum = [0.9 * m + g for m, g in zip(momentum, grads, strict=True)]
        return [p - 0.05 * m for p, m in zip(params, momentum, strict=True)], momentum

    start = time.perf_counter()
    loss = 0.0
    for step in range(args.steps):
        index = xp.asarray(rng.integers(0, n, 256))
        xb, yb = features[index].astype(xp.float16), targets[index]
        w1, b1, w2, b2 = (p.astype(xp.float16) for p in params)
        pre = xb @ w1 + b1
        hidden = xp.maximum(pre, 0)
        logits = (hidden @ w2 + b2).astype(xp.float32)
        probs = xp.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        loss = -(yb * xp.log(probs + 1e-7)).sum(1).mean()
        scaled_loss = scaler.scale(loss)
        # backward, in float16, from the scaled loss
        seed = scaler.scale((probs - yb) / xb.shape[0]).astype(xp.float16)  # the scaled loss gradient
        g_w2, g_b2 = hidden.T @ seed, seed.sum(0)
        g_pre = (seed @ w2.T) * (pre > 0)
        g_w1, g_b1 = xb.T @ g_pre, g_pre.sum(0)
        grads = [g.astype(xp.float32) for g in (g_w1, g_b1, g_w2, g_b2)]  # float32 master gradients
        params, momentum, scaler = scaler.step(sgd, params, grads, momentum, loss=scaled_loss)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {float(loss):.4f}  scale {scaler.get_scale():.0f}")

    hidden = xp.maximum(features @ params[0] + params[1], 0)
    accuracy = float(((hidden @ params[2] + params[3]).argmax(1) == xp.asarray(label)).mean())
    outcome = scaler.outcome.to_dict()
    print(
        f"accuracy {accuracy:.3f}, skipped {outcome['skipped_steps']}/{outcome['steps']} steps, "
        f"{time.perf_counter() - start:.1f} s"
    )
    return {"accuracy": accuracy, "loss": float(loss), "steps": outcome["steps"]}


if __name__ == "__main__":
    main()
