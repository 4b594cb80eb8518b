"""``python -m ampscale demo``: why loss scaling exists, shown by a real fp16 training run.

Framework helpers' layer: a user of the public API.

A two-layer MLP (32 -> 128 -> 512, tanh) learns to reproduce a teacher network of the same
shape (so a perfect fit exists and fp32 keeps improving), with Adam and a mean-squared-error
loss averaged over the batch and the 512 outputs. It is trained three ways:

* **fp32**: every value in float32;
* **fp16**: mixed precision without loss scaling: every activation, product and gradient is
  rounded to float16 (products accumulate in float32, as tensor cores do), weights and the
  optimizer stay in float32 (master weights);
* **fp16 + ampscale**: the same, with the loss multiplied by ampscale's dynamic scale before
  the backward pass and the gradients unscaled (and checked) after it.

The gradient of a mean over B x 512 values is ``2 * residual / (B * 512)``. Once the
residuals fall below about ``2**-8``, that is below float16's smallest step (``2**-24``,
with values under ``2**-25`` rounding to zero): unscaled fp16 training stops learning, while
the scaled gradients stay representable and ampscale tracks fp32. Everything is seeded and
runs on the CPU; ``--backend`` runs the same loop with JAX, PyTorch or CuPy arrays.

``--fp8`` adds three runs of the same model in bfloat16, two of them with FP8 matrix products
(emulated: every operand of a product is cast to FP8 and back, E4M3 forward and E5M2 for the
gradients, as on an H100):

* **bf16**: every value rounded to bfloat16 (no loss scaling needed: ``mode="guard"`` only
  skips non-finite steps);
* **bf16 + fp8 delayed**: each tensor cast with the scale of ``ampscale.fp8``'s ``te_delayed``
  preset, computed from the amaxes of the previous steps (one update per step, with the loss
  scaler's flag: ``ampscale.fp8.unscale_and_update``);
* **bf16 + fp8 current**: each tensor cast with the scale of its own amax (``te_current``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import ampscale
from ampscale._config import shown
from ampscale._info import backend_info, missing_framework

__all__ = ["RunResult", "main", "run_demo", "train"]

INPUTS, HIDDEN, OUTPUTS = 32, 128, 512
MODES = ("fp32", "fp16", "fp16 + ampscale")
#: the runs ``--fp8`` adds
FP8_MODES = ("bf16", "bf16 + fp8 delayed", "bf16 + fp8 current")
#: the FP8 tensors of one step: operands of the forward products (E4M3), then of the backward's (E5M2)
FP8_SLOTS = {"x": "forward", "w1": "forward", "h": "forward", "w2": "forward", "dy": "backward", "dh": "backward"}
#: steps per run: the default, and the fewest that leave room for the scale to settle
DEFAULT_STEPS, MIN_STEPS = 1000, 20


# ------------------------------------------------------------------------------ arithmetic


def round_to_half_numpy(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to the nearest float16 value, ties to even, kept as float32.

    Equal to ``x.astype(np.float16).astype(np.float32)`` bit for bit (the tests check every
    kind of value), with integer arithmetic that NumPy vectorises instead of NumPy's scalar
    float16 conversion loop.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    odd = (magnitude >> np.uint32(13)) & np.uint32(1)
    normal = ((magnitude + np.uint32(0xFFF) + odd) & np.uint32(0xFFFFE000)).view(np.float32)
    # below 2**-14 the float16 step is 2**-24, the float32 unit of 0.5: add and subtract it
    with np.errstate(invalid="ignore"):  # signalling NaNs flag "invalid"; their lanes keep x below
        subnormal = (np.abs(x) + np.float32(0.5)) - np.float32(0.5)
    out = np.where(magnitude < np.uint32(0x38800000), subnormal, normal)
    out = np.where(magnitude >= np.uint32(0x477FF000), np.float32(np.inf), out)
    out = np.where(magnitude > np.uint32(0x7F800000), x, out)  # nan stays nan
    result: np.ndarray = np.copysign(out, x)
    return result


def round_to_bfloat16_numpy(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to the nearest bfloat16 value, ties to even, kept as float32.

    bfloat16 is the upper half of a float32: add half of the dropped half (plus the kept
    half's lowest bit, for ties to even) and clear it. Infinities stay, nan stays nan, and
    values past bfloat16's largest round to inf, as ``astype(ml_dtypes.bfloat16)`` does.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + odd) & np.uint32(0xFFFF0000)).view(np.float32)
    result: np.ndarray = np.where(np.isnan(x), x, rounded)
    return result


@dataclasses.dataclass
class Arithmetic:
    """The array namespace of one backend and how it rounds to float16 and bfloat16."""

    name: str
    xp: Any
    to_half_precision: Callable[[Any], Any]
    asarray: Callable[[np.ndarray], Any]
    to_float: Callable[[Any], float]
    to_bfloat16: Callable[[Any], Any] | None = None


def arithmetic_for(backend: str) -> Arithmetic:
    """Build the :class:`Arithmetic` of ``backend`` ("numpy", "torch", "jax" or "cupy").

    Raises:
        ModuleNotFoundError: the backend's framework is not installed (the message says how to
            install it).
        ValueError: an unknown backend.
    """
    try:
        return _arithmetic_for(backend)
    except ModuleNotFoundError as exc:
        raise missing_framework(f"the demo's --backend {backend}", exc) from exc


def _arithmetic_for(backend: str) -> Arithmetic:
    if backend == "numpy":
        import array_api_compat.numpy as xp

        return Arithmetic("numpy", xp, round_to_half_numpy, np.asarray, float, round_to_bfloat16_numpy)
    if backend == "torch":
        import array_api_compat.torch as xp
        import torch

        return Arithmetic(
            "torch",
            xp,
            lambda x: x.half().float(),
            lambda a: torch.from_numpy(np.array(a)),
            lambda v: float(v),
            lambda x: x.bfloat16().float(),
        )
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_default_matmul_precision", "highest")
        return Arithmetic(
            "jax",
            jnp,
            lambda x: x.astype(jnp.float16).astype(jnp.float32),
            jnp.asarray,
            lambda v: float(v),
            lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
        )
    if backend == "cupy":
        import array_api_compat.cupy as xp
        import cupy

        return Arithmetic(
            "cupy", xp, lambda x: x.astype(cupy.float16).astype(cupy.float32), cupy.asarray, lambda v: float(v)
        )
    raise ValueError(f"--backend must be one of numpy, torch, jax, cupy; got {backend!r}")


# ------------------------------------------------------------------------------ the model


def teacher_and_data(seed: int, samples: int = 8192) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """A teacher MLP, its inputs and outputs (small outputs: realistic residual scales)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    teacher = [
        rng.standard_normal((INPUTS, HIDDEN)).astype(f32) / f32(math.sqrt(INPUTS)),
        (0.1 * rng.standard_normal(HIDDEN)).astype(f32),
        rng.standard_normal((HIDDEN, OUTPUTS)).astype(f32) / f32(10 * math.sqrt(HIDDEN)),
        (0.01 * rng.standard_normal(OUTPUTS)).astype(f32),
    ]
    inputs = rng.standard_normal((samples, INPUTS)).astype(f32)
    targets = (np.tanh(inputs @ teacher[0] + teacher[1]) @ teacher[2] + teacher[3]).astype(f32)
    return teacher, inputs, targets


def student(teacher: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """The student starts as the teacher with 30% noise on every weight."""
    rng = np.random.default_rng(seed + 1)
    return [
        (p + np.float32(0.3) * np.float32(p.std()) * rng.standard_normal(p.shape)).astype(np.float32) for p in teacher
    ]


def loss_and_grads(
    ar: Arithmetic,
    params: list[Any],
    x: Any,
    target: Any,
    half: bool,
    scale: float,
    rounding: Callable[[Any], Any] | None = None,
    fp8: Callable[[Any, str], Any] | None = None,
) -> tuple[Any, list[Any]]:
    """Forward and backward pass, every value rounded to float16 when ``half``.

    Returns the (unscaled) loss and the gradients of ``scale * loss``, as float32 master
    gradients. The gradient seed ``2 * scale * residual / n`` is rounded to float16 *after*
    the multiplication by the scale: that is what rescues small values.

    ``rounding`` replaces float16 (bfloat16 runs); ``fp8(value, slot)`` casts each operand of a
    matrix product (the slots of :data:`FP8_SLOTS`) to FP8 and back.
    """
    xp = ar.xp
    q = rounding or (ar.to_half_precision if half else (lambda v: v))
    cast = fp8 or (lambda v, slot: v)
    w1, b1, w2, b2 = (q(p) for p in params)
    x = q(x)
    x8, w1_8, w2_8 = cast(x, "x"), cast(w1, "w1"), cast(w2, "w2")
    hidden = q(xp.tanh(q(x8 @ w1_8 + b1)))
    hidden8 = cast(hidden, "h")
    output = q(hidden8 @ w2_8 + b2)
    residual = output - target
    loss = xp.mean(residual * residual)
    seed = q(residual * (2.0 * scale / (residual.shape[0] * residual.shape[1])))
    seed8 = cast(seed, "dy")
    grad_w2 = q(xp.matrix_transpose(hidden8) @ seed8)
    grad_b2 = q(xp.sum(seed, axis=0))
    grad_hidden = q(seed8 @ xp.matrix_transpose(w2_8))
    grad_pre = q(grad_hidden * (1.0 - hidden * hidden))
    grad_w1 = q(xp.matrix_transpose(x8) @ cast(grad_pre, "dh"))
    grad_b1 = q(xp.sum(grad_pre, axis=0))
    return loss, [grad_w1, grad_b1, grad_w2, grad_b2]


def adam(
    xp: Any, params: list[Any], grads: list[Any], state: tuple[list[Any], list[Any]], lr: float, t: int
) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
    """One functional Adam step, the ``t``-th applied one (works for mutable and immutable arrays).

    The step count is a Python int kept by the training loop, not part of ``state``: on device
    backends a skipped step selects the state leaf by leaf, which would turn it into an array.
    """
    m, v = state
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    m = [beta1 * mi + (1 - beta1) * g for mi, g in zip(m, grads, strict=False)]
    v = [beta2 * vi + (1 - beta2) * g * g for vi, g in zip(v, grads, strict=False)]
    c1, c2 = 1 - beta1**t, 1 - beta2**t
    params = [p - lr * (mi / c1) / (xp.sqrt(vi / c2) + eps) for p, mi, vi in zip(params, m, v, strict=False)]
    return params, (m, v)


@contextlib.contextmanager
def _one_compute_thread(backend: str) -> Iterator[None]:
    """Run the matrix products on one thread: NumPy's BLAS (where threadpoolctl is installed)
    and torch's intra-op pool, restored afterwards.

    They are small (512 x 128 by 128 x 512): a second thread gains little, and on a busy
    machine its spin-waits cost several times the work. On a loaded 2-core machine, 100 steps
    took 10 s instead of 40 s with NumPy, and 2 s instead of 19 s with torch. JAX (XLA's own
    thread pool) and CuPy (the GPU) are left as they are.
    """
    if backend == "torch":
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
        return
    limits: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if backend == "numpy":
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            pass
        else:
            limits = threadpool_limits(limits=1, user_api="blas")
    with limits:
        yield


@dataclasses.dataclass
class RunResult:
    """One training run."""

    mode: str
    losses: list[float]
    scales: list[float]
    skipped: list[int]
    seconds: float
    final_scale: float | None

    @property
    def final_loss(self) -> float:
        """The mean loss of the last 20 steps (one step's loss is noisy: it is one batch's)."""
        tail = self.losses[-20:]
        return float(np.mean(tail))


def train(
    mode: str,
    *,
    backend: str = "numpy",
    steps: int = DEFAULT_STEPS,
    batch: int = 512,
    lr: float = 1e-3,
    seed: int = 0,
    preset: str = "torch",
    init_scale: float = 2.0**32,
    growth_interval: int = 50,
    on_step: Callable[[int], None] = lambda step: None,
) -> RunResult:
    """Train the student in ``mode`` (one of :data:`MODES` or :data:`FP8_MODES`) and record the
    loss at every step."""
    if mode not in MODES + FP8_MODES:
        raise ValueError(f"mode must be one of {MODES + FP8_MODES}; got {shown(mode)}")
    ar = arithmetic_for(backend)
    if mode in FP8_MODES:
        return _train_bfloat16(mode, ar, steps=steps, batch=batch, lr=lr, seed=seed, on_step=on_step)
    xp = ar.xp
    teacher, inputs, targets = teacher_and_data(seed)
    params = [ar.asarray(p) for p in student(teacher, seed)]
    opt_state: tuple[list[Any], list[Any]] = ([xp.zeros_like(p) for p in params], [xp.zeros_like(p) for p in params])
    applied = 0  # Adam's step count: applied steps only
    half = mode != "fp32"
    scaler = None
    if mode == "fp16 + ampscale":
        scaler = ampscale.create_scaler(
            backend=backend, preset=preset, init_scale=init_scale, growth_interval=growth_interval
        )
    rng = np.random.default_rng(seed + 2)
    losses, scales, skipped = [], [], []
    start = time.perf_counter()
    with _one_compute_thread(ar.name):
        for step in range(steps):
            index = rng.integers(0, len(inputs), batch)
            x, target = ar.asarray(inputs[index]), ar.asarray(targets[index])
            scale = 1.0 if scaler is None else scaler.get_scale()
            loss, grads = loss_and_grads(ar, params, x, target, half, scale)
            lr_now = lr * 0.5 * (1 + math.cos(math.pi * step / steps))  # cosine decay
            if scaler is None:
                applied += 1
                params, opt_state = adam(xp, params, grads, opt_state, lr_now, applied)
            else:
                scaled_loss = scaler.scale(loss)

                def update(p: Any, g: Any, s: Any, lr_now: float = lr_now, t: int = applied + 1) -> Any:
                    return adam(xp, p, g, s, lr_now, t)

                params, opt_state, scaler = scaler.step(update, params, grads, opt_state, loss=scaled_loss)
                if bool(scaler.outcome.applied):
                    applied += 1
                else:
                    skipped.append(step)
            losses.append(ar.to_float(loss))
            scales.append(scale)
            on_step(step)
    seconds = time.perf_counter() - start
    return RunResult(mode, losses, scales, skipped, seconds, None if scaler is None else scaler.get_scale())


def _train_bfloat16(
    mode: str, ar: Arithmetic, *, steps: int, batch: int, lr: float, seed: int, on_step: Callable[[int], None]
) -> RunResult:
    """One of :data:`FP8_MODES`: bfloat16 everywhere, the products' operands in FP8 or not."""
    import ampscale.fp8 as fp8

    if ar.to_bfloat16 is None:
        raise ValueError(f"the FP8 runs train with numpy, torch or jax; got --backend {ar.name}")
    xp = ar.xp
    teacher, inputs, targets = teacher_and_data(seed)
    params = [ar.asarray(p) for p in student(teacher, seed)]
    opt_state: tuple[list[Any], list[Any]] = ([xp.zeros_like(p) for p in params], [xp.zeros_like(p) for p in params])
    applied = 0
    scaler = ampscale.create_scaler(backend=ar.name, mode="guard")  # bf16: no scaling, skips non-finite steps
    delayed = fp8.create_fp8_scaler("te_delayed", FP8_SLOTS, backend=ar.name, history_len=16)
    current = {
        slot: fp8.create_fp8_scaler("te_current", {slot: role}, backend=ar.name) for slot, role in FP8_SLOTS.items()
    }
    seen: dict[str, Any] = {}

    def cast(value: Any, slot: str) -> Any:
        if mode == "bf16 + fp8 current":  # the scale of this tensor's own amax, then the cast
            current[slot] = current[slot].update([fp8.tensor_amax(value)])
            return current[slot].qdq(value, 0)
        seen[slot] = value  # its amax is wanted only by the update, after the step
        return delayed.qdq(value, slot)  # the scale of the amaxes of the previous steps

    rng = np.random.default_rng(seed + 2)
    losses, scales, skipped = [], [], []
    start = time.perf_counter()
    with _one_compute_thread(ar.name):
        for step in range(steps):
            index = rng.integers(0, len(inputs), batch)
            x, target = ar.asarray(inputs[index]), ar.asarray(targets[index])
            rounding = ar.to_bfloat16
            loss, grads = loss_and_grads(
                ar, params, x, target, False, 1.0, rounding=rounding, fp8=None if mode == "bf16" else cast
            )
            if mode == "bf16 + fp8 delayed":  # one update of every slot per step, with the step's flag
                amax = fp8.amax([seen[slot] for slot in FP8_SLOTS])  # every tensor's amax in one pass
                scaler, delayed, grads, finite = fp8.unscale_and_update(scaler, delayed, grads, amax)
            else:
                grads, finite = scaler.unscale(grads)
                scaler = scaler.update(finite)
            lr_now = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            if bool(finite):
                applied += 1
                params, opt_state = adam(xp, params, grads, opt_state, lr_now, applied)
            else:
                skipped.append(step)
            losses.append(ar.to_float(loss))
            scales.append(1.0)
            on_step(step)
    seconds = time.perf_counter() - start
    return RunResult(mode, losses, scales, skipped, seconds, None)


# ------------------------------------------------------------------------------ reporting


def _power_of_two(value: float) -> str:
    """``2^32`` for powers of two, the plain number otherwise (as the header and plot show it)."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{value:g}"


def describe(args: argparse.Namespace, separator: str = "; ") -> str:
    """Everything the run uses: the model and data, then ampscale's settings, joined by ``separator``."""
    text = (
        f"MLP {INPUTS}-{HIDDEN}-{OUTPUTS}, Adam (lr {args.lr:g}, cosine), MSE over {args.batch}x{OUTPUTS} values, "
        f"{args.steps} steps, seed {args.seed}, backend {args.backend}{separator}ampscale: preset {args.preset}, "
        f"init scale {_power_of_two(args.init_scale)}, growth interval {args.growth_interval}"
    )
    if getattr(args, "fp8", False):
        text += f"{separator}fp8: te_delayed (history 16), te_current, E4M3 forward, E5M2 backward, emulated"
    return text


def _plot(results: list[RunResult], path: str, subtitle: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp8_runs = [r for r in results if r.mode in FP8_MODES]
    if fp8_runs:
        fig, (top, middle, bottom) = plt.subplots(
            3, 1, figsize=(9, 10.5), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2]}
        )
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    # fp16 + ampscale follows fp32 so closely that one line would hide the other: fp32 is drawn
    # wide and pale underneath, ampscale narrow and dashed on top, so both stay visible.
    styles = {
        "fp32": {"color": "#1f77b4", "lw": 3.2, "alpha": 0.55, "zorder": 2},
        "fp16": {"color": "#d62728", "lw": 1.3, "zorder": 3},
        "fp16 + ampscale": {"color": "#2ca02c", "lw": 1.2, "ls": (0, (4, 2)), "zorder": 4},
    }
    for r in results:
        if r.mode in styles:
            top.plot(r.losses, label=f"{r.mode} (final {r.final_loss:.2g})", **styles[r.mode])
    top.set_yscale("log")
    top.set_ylabel("training loss (MSE)")
    top.set_title("fp16 training: unscaled gradients underflow, ampscale tracks fp32\n" + subtitle, fontsize=9.5)
    top.legend()
    top.grid(True, which="both", alpha=0.3)
    if fp8_runs:
        fp8_styles = {
            "bf16": {"color": "#9467bd", "lw": 2.6, "alpha": 0.6, "zorder": 2},
            "bf16 + fp8 delayed": {"color": "#ff7f0e", "lw": 1.3, "zorder": 3},
            "bf16 + fp8 current": {"color": "#8c564b", "lw": 1.1, "ls": (0, (4, 2)), "zorder": 4},
        }
        fp32 = next((r for r in results if r.mode == "fp32"), None)
        if fp32 is not None:
            middle.plot(fp32.losses, label=f"fp32 (final {fp32.final_loss:.2g})", color="#1f77b4", lw=1.0, alpha=0.4)
        for r in fp8_runs:
            middle.plot(r.losses, label=f"{r.mode} (final {r.final_loss:.2g})", **fp8_styles[r.mode])
        middle.set_yscale("log")
        middle.set_ylabel("training loss (MSE)")
        middle.set_title("bf16 with FP8 products (emulated casts): delayed and current scaling", fontsize=9.5)
        middle.legend()
        middle.grid(True, which="both", alpha=0.3)
    scaled = next(r for r in results if r.mode == "fp16 + ampscale")
    bottom.plot(
        scaled.scales, color=styles["fp16 + ampscale"]["color"], lw=1.4, drawstyle="steps-post", label="loss scale"
    )
    if scaled.skipped:
        bottom.scatter(
            scaled.skipped,
            [scaled.scales[i] for i in scaled.skipped],
            color="#d62728",
            marker="x",
            zorder=3,
            label=f"skipped step (overflow), {len(scaled.skipped)} in all",
        )
    bottom.set_yscale("log", base=2)
    bottom.set_ylabel("loss scale")
    bottom.set_xlabel("step")
    bottom.legend()
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(args: argparse.Namespace) -> list[RunResult]:
    """Run the three trainings with a progress bar, print the table, save the plot."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table
    except ImportError:
        Console = None

    modes = list(MODES) + (list(FP8_MODES) if getattr(args, "fp8", False) else [])
    results: list[RunResult] = []
    settings = {
        "backend": args.backend,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "preset": args.preset,
        "init_scale": args.init_scale,
        "growth_interval": args.growth_interval,
    }
    header = f"ampscale demo: {describe(args)}"
    if Console is not None:
        console = Console() if sys.stdout.isatty() else Console(width=110)
        console.print(f"[bold]{header}[/bold]", soft_wrap=True)  # one line, as the plain output
        columns = (TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            for mode in modes:
                task = progress.add_task(mode, total=args.steps)

                def advance(_step: int, task: Any = task) -> None:
                    progress.advance(task)

                results.append(train(mode, **settings, on_step=advance))
    else:
        print(header)
        for mode in modes:

            def tick(step: int, mode: str = mode) -> None:
                if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
                    done = (step + 1) * 30 // args.steps
                    print(f"\r{mode:<16} [{'#' * done}{'.' * (30 - done)}] {step + 1}/{args.steps}", end="", flush=True)

            results.append(train(mode, **settings, on_step=tick))
            print()

    fp32 = results[0].final_loss
    rows = []
    for r in results:
        rows.append(
            [
                r.mode,
                f"{r.final_loss:.3g}",
                f"{r.final_loss / fp32:.3g}x",
                str(len(r.skipped)) if r.final_scale is not None else "-",
                _power_of_two(r.final_scale) if r.final_scale is not None else "-",
                f"{r.seconds:.1f} s",
            ]
        )
    columns_text = ["run", "final loss", "vs fp32", "skipped steps", "final scale", "time"]
    if Console is not None:
        table = Table(title="Summary (final loss: mean of the last 20 steps)")
        for c in columns_text:
            table.add_column(c, justify="right" if c != "run" else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    else:
        print("Summary (final loss: mean of the last 20 steps)")
        for row in [columns_text, *rows]:
            print("  ".join(f"{cell:>14}" for cell in row))
    if not args.no_plot:
        try:
            path = _plot(results, args.out, describe(args, separator="\n"))
        except ImportError:
            print("matplotlib is not installed: no plot (pip install 'ampscale[demo]')")
        else:
            print(f"plot saved to {os.path.abspath(path)}")
    return results


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {MIN_STEPS}; got {text!r}") from None
    if value < MIN_STEPS:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_STEPS}; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (``python -m ampscale demo --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m ampscale demo",
        description="Train the same fp16 MLP three ways (fp32, fp16, fp16 + ampscale) and compare.",
    )
    parser.add_argument(
        "--backend",
        default="numpy",
        choices=["numpy", "torch", "jax", "cupy"],
        help="array library to train with (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=_steps,
        default=DEFAULT_STEPS,
        help=f"training steps per run, at least {MIN_STEPS} (default: %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=512, help="batch size (default: %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam learning rate, cosine-decayed (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--preset",
        default="torch",
        choices=sorted(ampscale.PRESETS),
        help="ampscale scaling policy (default: %(default)s)",
    )
    parser.add_argument(
        "--init-scale",
        type=float,
        default=2.0**32,
        help="initial loss scale (default: 2**32, Megatron's, so the first steps overflow and "
        "back off, as real runs do)",
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=50,
        help="finite steps between scale growths (default: %(default)s; short runs need a short one)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="also train in bf16, and in bf16 with FP8 products (emulated) under delayed and current "
        "scaling (ampscale.fp8); about doubles the time",
    )
    parser.add_argument("--out", default="ampscale-demo.png", help="where to save the plot (default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true", help="do not save a plot")
    return parser


def _fp8_problem(backend: str) -> str | None:
    """Why the FP8 runs cannot train with ``backend`` here (``None``: they can)."""
    if backend == "cupy":
        return "the FP8 runs train with --backend numpy, torch or jax"
    if backend == "numpy":
        import importlib.util

        if importlib.util.find_spec("ml_dtypes") is None:
            return "NumPy's FP8 casts need ml_dtypes; fix: pip install 'ampscale[demo]'"
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m ampscale demo [options]``: the exit status (argparse exits on bad options).

    A backend whose framework is missing, or that has no usable device, is reported in one
    line (what is missing and the command that fixes it) with exit status 2, before any work.
    """
    args = build_parser().parse_args(argv)
    if args.fp8:
        problem = _fp8_problem(args.backend)
        if problem is not None:
            print(f"ampscale demo: --fp8 cannot run here: {problem}", file=sys.stderr)
            return 2
    if args.backend != "numpy":
        facts = backend_info(args.backend)
        if not facts["usable"]:
            print(
                f"ampscale demo: --backend {args.backend} cannot run here: {facts['problem']}; fix: {facts['fix']}",
                file=sys.stderr,
            )
            return 2
    run_demo(args)
    return 0
