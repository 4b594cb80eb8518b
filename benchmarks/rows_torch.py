"""Benchmark cases for the PyTorch backend (loaded by ``benchmarks/run.py`` when torch is installed).

Rows: ampscale's functional API on torch tensors, ``ampscale.torch.GradScaler`` (unscale_ +
step + update with a no-op optimizer), and the anchors: torch's fused kernel alone,
``torch.amp.GradScaler`` doing the same three calls, and a naive per-tensor loop. Workload
``N``: one row per call of each ``GradScaler`` (see :func:`per_call_cases`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from run import SCALES, WORKLOADS, Case, make_arrays, nbytes

import ampscale
import ampscale.torch as amp_torch


class NoOpOptimizer(torch.optim.Optimizer):
    """An optimizer whose step does nothing: the benchmark times the scaler alone."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:
        return None


def _tensors(workload: str, seed: int = 0) -> list[torch.Tensor]:
    return [torch.from_numpy(a) for a in make_arrays(workload, seed)]


def _with_grads(grads: list[torch.Tensor]) -> NoOpOptimizer:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))  # never touched: no memory traffic
        p.grad = g  # only the gradients are touched
        params.append(p)
    return NoOpOptimizer(params)


#: scale() calls per iteration in the per-call rows (nanoGPT's gradient accumulation on 8 GPUs)
MICRO_STEPS = 40
CALLS = ("scale", "unscale_", "step", "update")


def per_call_cases(workload: str) -> list[Case]:
    """One row per call and class: a whole nanoGPT-style iteration runs, one kind of call is timed.

    Each iteration scales 40 losses (0-d, requiring grad, as a real loss does), then calls
    ``unscale_``, ``step`` (a no-op optimizer, so only the scaler is timed) and ``update``; the
    row's step returns the seconds spent in its kind of call, per call. Both classes run the
    same iterations on the same gradients, with the scales alternating as in the other rows.
    """
    grads = _tensors(workload)
    loss = torch.ones((), requires_grad=True)
    out: list[Case] = []
    for label, cls, anchor in (
        ("ampscale.torch.GradScaler", amp_torch.GradScaler, False),
        ("torch.amp.GradScaler", torch.amp.GradScaler, True),
    ):
        opt = _with_grads(grads)
        for call in CALLS:
            scalers = [cls("cpu", init_scale=s, growth_interval=10**9) for s in SCALES]

            def iteration(i: int, scalers: list[Any] = scalers, opt: NoOpOptimizer = opt, call: str = call) -> float:
                scaler = scalers[i % 2]
                clock = time.perf_counter
                start = clock()
                for _ in range(MICRO_STEPS):
                    scaler.scale(loss)
                scaled = clock() - start
                start = clock()
                scaler.unscale_(opt)
                unscaled = clock() - start
                start = clock()
                scaler.step(opt)
                stepped = clock() - start
                start = clock()
                scaler.update()
                updated = clock() - start
                return {"scale": scaled / MICRO_STEPS, "unscale_": unscaled, "step": stepped, "update": updated}[call]

            moved = 2 * nbytes(grads) if call == "unscale_" else 0
            out.append(
                Case("torch", workload, f"{label}.{call}", iteration, moved, anchor=anchor, group=call, timed=True)
            )
            out[-1].note = "per call" if call != "scale" else f"per call ({MICRO_STEPS} per iteration)"
    return out


def cuda_update_cases(workload: str) -> list[Case]:
    """``update()`` of ``ampscale.torch.GradScaler`` and of ``torch.amp.GradScaler`` on CUDA.

    Each iteration scales one loss, then ``unscale_``, ``step`` (a no-op optimizer) and
    ``update``; the row's time is the host's time in ``update()`` per call (nothing waits for
    the GPU), and its launches are those of ``update()`` alone (torch's profiler).
    """
    from torch.profiler import ProfilerActivity, profile

    grads = [t.cuda() for t in _tensors(workload)]
    loss = torch.ones((), device="cuda", requires_grad=True)
    out: list[Case] = []
    for label, cls, anchor in (
        ("ampscale.torch.GradScaler", amp_torch.GradScaler, False),
        ("torch.amp.GradScaler", torch.amp.GradScaler, True),
    ):
        opt = _with_grads(grads)
        scalers = [cls("cuda", init_scale=s, growth_interval=10**9) for s in SCALES]

        def prepare(i: int, scalers: list[Any] = scalers, opt: NoOpOptimizer = opt) -> Any:
            scaler = scalers[i % 2]
            scaler.scale(loss)
            scaler.unscale_(opt)
            scaler.step(opt)
            return scaler

        def iteration(i: int, prepare: Any = prepare) -> float:
            scaler = prepare(i)
            start = time.perf_counter()
            scaler.update()
            return time.perf_counter() - start

        def launches(prepare: Any = prepare, calls: int = 4) -> float:
            count = 0
            for i in range(calls):
                scaler = prepare(i)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    scaler.update()
                    torch.cuda.synchronize()
                count += sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            return count / calls

        case = Case("torch-cuda", workload, f"{label}.update (CUDA)", iteration, 0, anchor=anchor, group="update")
        case.device, case.timed, case.sync, case.launches_of = "gpu", True, torch.cuda.synchronize, launches
        case.note = "host time per call (no sync); launches of update() alone"
        out.append(case)
    return out


def cases(workload: str) -> list[Case]:
    gpu_only = os.environ.get("AMPSCALE_BENCH_GPU_ONLY") == "1"
    if workload == "N":
        out = [] if gpu_only else per_call_cases(workload)
        return out + (cuda_update_cases(workload) if torch.cuda.is_available() else [])
    if gpu_only:
        return cuda_cases(workload) if torch.cuda.is_available() else []
    out: list[Case] = []
    dtype = WORKLOADS[workload][1]

    # Every CPU row works on the same gradient tensors, so the rows compare on the very same
    # memory (an even number of steps per round brings the data back to where it started).
    grads = _tensors(workload)
    moved = 2 * nbytes(grads)
    scalers = [ampscale.create_scaler(backend="torch", init_scale=s, growth_interval=10**9) for s in SCALES]

    def functional(i: int) -> None:
        scaler = scalers[i % 2]
        _, finite = scaler.unscale(grads)
        scalers[i % 2] = scaler.update(finite)

    out.append(Case("torch", workload, "ampscale torch (unscale + update)", functional, moved))

    drop_opt = _with_grads(grads)
    drop_in = [amp_torch.GradScaler("cpu", init_scale=s, growth_interval=10**9) for s in SCALES]
    for scaler in drop_in:
        scaler.scale(torch.ones(()))  # creates the state, as the first loss would

    def drop_in_step(i: int) -> None:
        scaler = drop_in[i % 2]
        scaler.unscale_(drop_opt)
        scaler.step(drop_opt)
        scaler.update()

    out.append(Case("torch", workload, "ampscale.torch.GradScaler", drop_in_step, moved))

    fused_grads = grads
    found_inf = torch.zeros(())
    invs = [torch.tensor(1.0 / s) for s in SCALES]

    def fused(i: int) -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(fused_grads, found_inf, invs[i % 2])

    out.append(Case("torch", workload, "torch fused kernel only", fused, moved, anchor=True))

    if dtype != "float16":
        torch_opt = _with_grads(grads)
        theirs = [torch.amp.GradScaler("cpu", init_scale=s, growth_interval=10**9) for s in SCALES]
        for scaler in theirs:
            scaler.scale(torch.ones(()))

        def torch_scaler(i: int) -> None:
            scaler = theirs[i % 2]
            scaler.unscale_(torch_opt)
            scaler.step(torch_opt)
            scaler.update()

        out.append(Case("torch", workload, "torch.amp.GradScaler", torch_scaler, moved, anchor=True))

    naive_grads = grads

    def naive(i: int) -> None:
        inv = 1.0 / SCALES[i % 2]
        finite = all(bool(torch.isfinite(g).all()) for g in naive_grads)
        for g in naive_grads:
            g.mul_(inv)
        _ = finite

    out.append(Case("torch", workload, "naive torch loop", naive, moved, anchor=True))
    if dtype == "float16":
        out[-1].note = "torch.amp.GradScaler refuses float16 gradients"
    if torch.cuda.is_available():
        out += cuda_cases(workload)
    return out


def cuda_cases(workload: str) -> list[Case]:
    """The same rows on the GPU (the GPU's L, with CUDA events, is measured by ``run.py``)."""
    dtype = WORKLOADS[workload][1]
    sync = torch.cuda.synchronize
    grads = [t.cuda() for t in _tensors(workload)]
    moved = 2 * nbytes(grads)
    out: list[Case] = []
    scalers = [ampscale.create_scaler(backend="torch", init_scale=s, growth_interval=10**9) for s in SCALES]

    def functional(i: int) -> None:
        scaler = scalers[i % 2]
        _, finite = scaler.unscale(grads)
        scalers[i % 2] = scaler.update(finite)

    out.append(
        Case("torch-cuda", workload, "ampscale torch (unscale + update)", functional, moved, device="gpu", sync=sync)
    )
    drop_grads = [t.cuda() for t in _tensors(workload)]
    drop_opt = _with_grads(drop_grads)
    drop_in = [amp_torch.GradScaler("cuda", init_scale=s, growth_interval=10**9) for s in SCALES]
    for scaler in drop_in:
        scaler.scale(torch.ones((), device="cuda"))

    def drop_in_step(i: int) -> None:
        scaler = drop_in[i % 2]
        scaler.unscale_(drop_opt)
        scaler.step(drop_opt)
        scaler.update()

    out.append(Case("torch-cuda", workload, "ampscale.torch.GradScaler", drop_in_step, moved, device="gpu", sync=sync))
    fused_grads = [t.cuda() for t in _tensors(workload)]
    found_inf = torch.zeros((), device="cuda")
    invs = [torch.tensor(1.0 / s, device="cuda") for s in SCALES]
    out.append(
        Case(
            "torch-cuda",
            workload,
            "torch fused kernel only",
            lambda i: torch._amp_foreach_non_finite_check_and_unscale_(fused_grads, found_inf, invs[i % 2]),
            moved,
            anchor=True,
            device="gpu",
            sync=sync,
        )
    )
    if dtype != "float16":
        theirs_grads = [t.cuda() for t in _tensors(workload)]
        theirs_opt = _with_grads(theirs_grads)
        theirs = [torch.amp.GradScaler("cuda", init_scale=s, growth_interval=10**9) for s in SCALES]
        for scaler in theirs:
            scaler.scale(torch.ones((), device="cuda"))

        def torch_scaler(i: int) -> None:
            scaler = theirs[i % 2]
            scaler.unscale_(theirs_opt)
            scaler.step(theirs_opt)
            scaler.update()

        out.append(
            Case(
                "torch-cuda",
                workload,
                "torch.amp.GradScaler",
                torch_scaler,
                moved,
                anchor=True,
                device="gpu",
                sync=sync,
            )
        )
    return out
