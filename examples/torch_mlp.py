"""Train a small MLP with PyTorch autocast and ``ampscale.torch.GradScaler`` (CPU, under a minute).

The loop is torch's canonical one, with ``ampscale.torch.GradScaler`` in place of
``torch.amp.GradScaler``; ``step`` also reports whether the update was applied, so the
learning-rate schedule only advances on applied steps.

Run: ``python examples/torch_mlp.py [--steps N] [--dtype bfloat16|float16]``.
"""

from __future__ import annotations

import argparse
import time

try:
    import torch
except ModuleNotFoundError:  # one line that says what to do, as the demo does, not a traceback
    raise SystemExit("torch_mlp.py needs PyTorch, which is not installed: pip install 'ampscale[torch]'") from None

import ampscale.torch as amp_torch


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default="bfloat16",
        help="autocast dtype (float16 autocast on CPU needs torch >= 2.3)",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)

    # A two-moons-like classification problem, generated: no download.
    n = 4096
    angle = torch.rand(n) * torch.pi
    label = torch.randint(0, 2, (n,))
    x = torch.stack([torch.cos(angle) + label * 1.0, torch.sin(angle) * (1 - 2 * label) + label * 0.5], 1)
    x = x + 0.1 * torch.randn(n, 2)
    features = torch.cat([x, x**2, x[:, :1] * x[:, 1:]], 1)

    model = torch.nn.Sequential(
        torch.nn.Linear(5, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    scaler = amp_torch.GradScaler("cpu", growth_interval=100)

    start, applied_steps, loss = time.perf_counter(), 0, torch.tensor(0.0)
    for step in range(args.steps):
        index = torch.randint(0, n, (256,))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(features[index])
            loss = torch.nn.functional.cross_entropy(logits.float(), label[index])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip unscaled gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)  # returns what torch's does: optimizer.step()'s value
        scaler.update()
        if scaler.last_step.applied:  # pytorch#55585: only advance the schedule on applied steps
            schedule.step()
            applied_steps += 1
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():.0f}")

    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        accuracy = (model(features).argmax(1) == label).float().mean().item()
    seconds = time.perf_counter() - start
    print(f"accuracy {accuracy:.3f}, {applied_steps}/{args.steps} steps applied, {seconds:.1f} s")
    return {"accuracy": accuracy, "loss": loss.item(), "applied": applied_steps}


if __name__ == "__main__":
    main()
