"""ampscale's benchmark: check + unscale + update per step, against the memory limit and anchors.

Run ``python benchmarks/run.py`` (``--help`` for options). For each backend and workload it
prints ms per step, GB/s (bytes read + written by the in-place unscale), the ratio to **L**
and to the best anchor installed, all measured in the same run:

* **L**: the same bytes moved by one in-place multiply over one contiguous buffer with every
  core (torch ``buf.mul_``; a NumPy multiply split over threads when torch is absent). On a GPU,
  L is the device's own memory speed: a device-to-device copy and an in-place multiply of one
  buffer of the same bytes, timed with CUDA events (the faster of the two), printed beside the
  device's nominal bandwidth. GPU rows also give kernel launches per step (counted by the
  profiler) and the host's microseconds per step (calls queued without waiting for the GPU).
* **W0**: one array of 1024 float32 values (the fixed per-step cost, full step);
  **W1**: GPT-2 small's 148 parameter shapes (124.4 M float32 values); **W1h**: the same in
  float16; **W2**: 2000 arrays of 4096 float32 values.
* **N** (torch only): the cost of each call of a ``GradScaler`` (``scale``, ``unscale_``,
  ``step``, ``update``) in a nanoGPT-style iteration (40 micro-steps, each one ``scale()``,
  then ``unscale_``, ``step`` and ``update``) over a small GPT's 52 parameters; each row times
  one kind of call, per call, against ``torch.amp.GradScaler``'s same call. On CUDA: the
  ``update()`` of both classes, host time per call and the launches of that call alone.

* **FP8-W1**, **FP8-W2** (``--workloads FP8`` selects both): the FP8 bookkeeping of a step
  (the amax of every tensor, the transition over every slot) on W1's and W2's data, against
  torchao's and flax's on the same data (``benchmarks/rows_fp8.py``). These passes only read:
  their GB/s are bytes read, their "x L" is L's time over theirs, and the note gives their read
  speed against L's GB/s (bytes read and written).

``--gpu-only`` keeps the GPU rows and the GPU's L (``scripts/gpu-check.sh``).
* Anchors: naive NumPy (``isfinite().all()`` + multiply per array), torch's fused kernel
  ``_amp_foreach_non_finite_check_and_unscale_``, ``torch.amp.GradScaler`` (unscale_ + step +
  update with a no-op optimizer), jmp (jitted ``unscale`` + ``all_finite`` + ``adjust``), and a
  per-array CuPy loop.

Every step alternates between scales 16 and 1/16 so the data keeps its magnitude and never
drifts into subnormals (which would slow every implementation down). On the CPU only the steps
at scale 16 are timed (training runs at scales of at least 1); the steps at 1/16 restore the
data untimed. (Below a scale of 1 a finite gradient can overflow when unscaled; where torch's
kernel runs, which checks its inputs, the torch backend then adds a check-only pass over what
it wrote, which no step at scale >= 1 pays. On CUDA, while the scale may be below 1, the torch
backend uses ampscale's kernel instead, one launch that checks what it writes, and every step
is timed.) For each workload the
rounds of all cases (L included) are interleaved, in a new order every round, and each case
keeps its best round, so ratios compare numbers taken at the same moments of this run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ampscale  # noqa: E402

SCALES = (16.0, 1.0 / 16.0)  # exact in every dtype; alternating keeps the data's magnitude


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124,439,808 values)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def nanogpt_shapes() -> list[tuple[int, ...]]:
    """The 52 parameter shapes of a small nanoGPT (4 layers, width 64, vocabulary 65; 0.2 M values)."""
    d, vocab, ctx, layers = 64, 65, 64, 4
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [*shapes, (d,), (d,)]


WORKLOADS: dict[str, tuple[list[tuple[int, ...]], str]] = {
    "W0": ([(1024,)], "float32"),
    "W1": (gpt2_small_shapes(), "float32"),
    "W1h": (gpt2_small_shapes(), "float16"),
    "W2": ([(4096,)] * 2000, "float32"),
    "N": (nanogpt_shapes(), "float32"),
    "FP8-W1": (gpt2_small_shapes(), "float32"),
    "FP8-W2": ([(4096,)] * 2000, "float32"),
}
#: workloads that time single calls of a stateful scaler: only these providers have rows for them
PER_CALL_WORKLOADS = {"N": ("torch",)}
#: FP8 bookkeeping (benchmarks/rows_fp8.py): read-only passes, only the fp8 provider has rows
FP8_WORKLOADS = {"FP8-W1": ("fp8",), "FP8-W2": ("fp8",)}
#: names on the command line that stand for several workloads
WORKLOAD_GROUPS = {"FP8": tuple(FP8_WORKLOADS)}


_made: dict[tuple[str, int], list[np.ndarray]] = {}  # the current workload's arrays, drawn once


def make_arrays(workload: str, seed: int = 0) -> list[np.ndarray]:
    """The workload's arrays (a new copy at every call: drawing W1's 124 M values takes seconds,
    copying them a fraction of that; the draws are kept until :func:`forget_arrays`)."""
    key = (workload, seed)
    made = _made.get(key)
    if made is None:
        shapes, dtype = WORKLOADS[workload]
        rng = np.random.default_rng(seed)
        made = _made[key] = [rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False) for shape in shapes]
    return [a.copy() for a in made]


def forget_arrays() -> None:
    """Drop the kept draws (the row modules import this file as ``run``: its copy too)."""
    _made.clear()
    other = sys.modules.get("run")
    if other is not None:
        getattr(other, "_made", {}).clear()


def nbytes(arrays: list[Any]) -> int:
    return sum(int(a.nbytes) for a in arrays)


@dataclasses.dataclass
class Case:
    """One thing to time: a step function and what it stands for."""

    backend: str
    workload: str
    name: str
    step: Callable[[int], Any]
    moved: int  # bytes read + written per step
    anchor: bool = False
    note: str = ""
    device: str = "cpu"
    limit: bool = False  # this case is L for its device
    sync: Callable[[], None] = lambda: None
    group: str = ""  # compared with the anchors of its own group only (per-call rows: the call)
    timed: bool = False  # step returns the seconds of the part it stands for (per-call rows)
    steps_per_call: int = 1  # a call of `step` runs this many training steps (a jitted loop)
    launches_of: Callable[[], float] | None = None  # GPU rows that count one call's launches themselves


@dataclasses.dataclass
class Result:
    backend: str
    workload: str
    name: str
    seconds: float
    moved: int
    anchor: bool = False
    note: str = ""
    device: str = "cpu"
    limit: bool = False
    launches: float | None = None  # kernel launches (and copies) per step, GPU rows
    host_us: float | None = None  # host microseconds per step without waiting for the GPU
    group: str = ""  # compared with the anchors of its own group only (per-call rows: the call)

    @property
    def gbps(self) -> float:
        return self.moved / self.seconds / 1e9


def budget(workload: str, quick: bool) -> dict[str, int]:
    # W0 and W2: short rounds, many of them (cheap here): on a shared machine a round that a
    # busy neighbour slows down is then simply not the best one, for every case alike
    if workload == "W0":
        return {"steps": 300 if quick else 500, "rounds": 5 if quick else 41}
    if workload == "FP8-W2":
        return {"steps": 6 if quick else 10, "rounds": 5 if quick else 25}
    if workload == "W2":
        return {"steps": 6 if quick else 10, "rounds": 5 if quick else 41}
    if workload in PER_CALL_WORKLOADS:  # one step is a whole iteration (40 scale() calls)
        return {"steps": 10 if quick else 20, "rounds": 5 if quick else 41}
    # an even number of steps: the scales alternate (x/16, x*16), so every round starts from
    # the same values (an odd count would shrink them 16x a round, into subnormals in float16)
    # many rounds: on a shared machine single rounds of W1 vary by +-15%, more than some of
    # the differences measured (the rounds are cheap next to the setup)
    return {"steps": 2, "rounds": 3 if quick else 25}


def measure(cases: list[Case], steps: int, rounds: int) -> list[Result]:
    """Best mean seconds per step of every case, with the rounds of all cases interleaved.

    A case whose call runs several training steps (``steps_per_call``) is reported per step.

    Interleaving makes the machine's drift (shared CPUs, frequency changes) hit every case
    alike, so the ratios compare numbers taken at the same moments. The order of the cases is
    shuffled every round (with a fixed seed), and each round of a case starts with one untimed
    step of that case, so no case's time depends on which one ran before it.
    """
    if steps % 2:
        raise ValueError(f"steps must be even (the scales alternate, keeping the data's magnitude); got {steps}")
    for case in cases:  # warm-up: caches, allocators, jit compilation
        for i in range(2):
            case.step(i)
        case.sync()
    best = {id(case): float("inf") for case in cases}
    # A new order every round: in a fixed order a case would always follow the same one, e.g.
    # L, whose OpenMP threads keep spinning on the cores for milliseconds after it returns.
    shuffler = random.Random(0)
    order = list(cases)
    for _ in range(rounds):
        shuffler.shuffle(order)
        for case in order:
            gc.disable()
            # One untimed step first, so each round starts from the state this case leaves
            # (torch's OpenMP threads awake or asleep, caches), not whichever case ran before;
            # cases share their arrays, so one more untimed step after the timed ones (an
            # even number) undoes its scale: every run leaves the data where it found it.
            case.step(1)
            case.sync()
            if case.timed:  # the step times the part it stands for (the scale-16 steps)
                elapsed = sum(case.step(i) if i % 2 == 0 else case.step(i) * 0 for i in range(steps)) / (steps // 2)
            elif case.device == "cpu" and case.steps_per_call == 1:
                # Only the steps at scale 16 are timed, as training runs (scales >= 1); the
                # steps at 1/16 restore the data, untimed (below a scale of 1 a finite value
                # can overflow when unscaled, so the torch backend adds a check of what it
                # wrote: a second pass that training at scales >= 1 never pays).
                elapsed = 0.0
                for i in range(steps):
                    start = time.perf_counter()
                    case.step(i)
                    case.sync()
                    if i % 2 == 0:
                        elapsed += time.perf_counter() - start
                elapsed /= steps // 2
            else:
                start = time.perf_counter()
                for i in range(steps):
                    case.step(i)
                case.sync()
                elapsed = (time.perf_counter() - start) / (steps * case.steps_per_call)
            case.step(0)
            case.sync()
            gc.enable()
            best[id(case)] = min(best[id(case)], elapsed)
    results = []
    for c in cases:
        launches = host_us = None
        if c.device == "gpu" and not c.limit:
            launches = c.launches_of() if c.launches_of is not None else launches_per_step(c)
            host_us = None if c.timed else host_microseconds(c)
        results.append(
            Result(
                c.backend,
                c.workload,
                c.name,
                best[id(c)],
                c.moved,
                c.anchor,
                c.note,
                c.device,
                c.limit,
                launches,
                host_us,
                c.group,
            )
        )
    return results


# ------------------------------------------------------------------------------ GPU measures


def launches_per_step(case: Case, steps: int = 4) -> float | None:
    """Kernels, memsets and copies per step on the GPU, counted by torch's profiler (CUPTI sees
    every kernel of the process, CuPy's too); ``None`` without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    case.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            case.step(i)
        case.sync()
    count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return count / steps


def host_microseconds(case: Case, steps: int = 40) -> float:
    """The host's time per step, the GPU left to run behind (no wait inside the timed calls)."""
    case.sync()
    start = time.perf_counter()
    for i in range(steps):
        case.step(i)
    elapsed = time.perf_counter() - start
    case.sync()
    if steps % 2:
        case.step(0)
        case.sync()
    return elapsed / steps * 1e6


def gpu_limit(workload: str) -> tuple[Result, str] | None:
    """L on the GPU: the best of a device-to-device copy and an in-place multiply of one buffer
    of the workload's bytes, each timed with CUDA events; and a note with the nominal bandwidth."""
    shapes, dtype = WORKLOADS[workload]
    total = sum(int(np.prod(s)) for s in shapes)
    moved = 2 * total * np.dtype(dtype).itemsize
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        source = torch.randn(total, device="cuda").to(getattr(torch, dtype))
        target = torch.empty_like(source)
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        copy_fn: Callable[[], Any] = lambda: target.copy_(source)  # noqa: E731
        scale_fn: Callable[[], Any] = lambda: source.mul_(1.0)  # noqa: E731

        def timed(fn: Callable[[], Any], reps: int) -> float:
            events[0].record()
            for _ in range(reps):
                fn()
            events[1].record()
            events[1].synchronize()
            return events[0].elapsed_time(events[1]) / 1e3 / reps

        nominal = _nominal_bandwidth()
    except ImportError:
        return None
    reps = 200 if moved < 1 << 20 else 20
    best = {"copy": float("inf"), "in-place multiply": float("inf")}
    for _ in range(5):
        for name, fn in (("copy", copy_fn), ("in-place multiply", scale_fn)):
            fn()
            best[name] = min(best[name], timed(fn, reps))
    name = min(best, key=lambda k: best[k])
    seconds = best[name]
    other = next(k for k in best if k != name)
    note = f"CUDA events; {other}: {moved / best[other] / 1e9:.0f} GB/s"
    if nominal:
        note += f"; nominal {nominal / 1e9:.0f} GB/s"
    result = Result("limit", workload, f"L: device {name} (CUDA events)", seconds, moved, device="gpu", limit=True)
    result.note = note
    return result, note


def _nominal_bandwidth() -> float | None:
    """The device's nominal memory bandwidth in bytes/s (memory clock x bus width x 2), if known."""
    try:
        import cupy

        runtime = cupy.cuda.runtime
        clock_khz = runtime.deviceGetAttribute(runtime.cudaDevAttrMemoryClockRate, 0)
        bus_bits = runtime.deviceGetAttribute(runtime.cudaDevAttrGlobalMemoryBusWidth, 0)
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    except Exception:
        pass
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        return 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None
    except Exception:
        return None


# ------------------------------------------------------------------------------ the limit L


def limit_case(workload: str) -> Case:
    """L: an in-place multiply of one contiguous buffer of the same bytes, with every core."""
    shapes, dtype = WORKLOADS[workload]
    total = sum(int(np.prod(s)) for s in shapes)
    moved = 2 * total * np.dtype(dtype).itemsize
    if importlib.util.find_spec("torch") is not None:
        import torch

        buffer = torch.from_numpy(np.random.default_rng(1).standard_normal(total).astype(dtype))
        return Case(
            "limit",
            workload,
            f"L: torch mul_ ({torch.get_num_threads()} threads)",
            lambda i: buffer.mul_(SCALES[i % 2]),
            moved,
            limit=True,
        )
    array = np.random.default_rng(1).standard_normal(total).astype(dtype)
    threads = os.cpu_count() or 1
    pool = ThreadPoolExecutor(threads)
    parts = np.array_split(array, threads)

    def step(i: int) -> None:
        factor = array.dtype.type(SCALES[i % 2])
        list(pool.map(lambda p: np.multiply(p, factor, out=p), parts))

    return Case("limit", workload, f"L: numpy multiply ({threads} threads)", step, moved, limit=True)


# ------------------------------------------------------------------------------ NumPy rows


def numpy_cases(workload: str) -> list[Case]:
    # Every row works on the same arrays, so the rows compare on the very same memory (an even
    # number of steps per round brings the data back to where it started).
    arrays = make_arrays(workload)
    naive_arrays = arrays
    moved = 2 * nbytes(arrays)
    scalers = [ampscale.create_scaler(backend="numpy", init_scale=s, growth_interval=10**9) for s in SCALES]

    def ampscale_step(i: int) -> None:
        scaler = scalers[i % 2]
        _, finite = scaler.unscale(arrays)
        scalers[i % 2] = scaler.update(finite)

    from ampscale.backends import numpy as np_backend

    note = f"native kernel ({np_backend.kernel_isa()})" if np_backend.NATIVE else "pure-NumPy path (no native kernel)"

    def naive(i: int) -> None:
        inv = np.float32(1.0 / SCALES[i % 2])  # float32 arithmetic, as torch's kernel
        finite = all(bool(np.isfinite(a).all()) for a in naive_arrays)
        for a in naive_arrays:
            np.multiply(a, inv, out=a, casting="same_kind")
        _ = finite

    counting_arrays = arrays
    counting = [ampscale.create_scaler(backend="numpy", init_scale=s, growth_interval=10**9) for s in SCALES]

    def counting_step(i: int) -> None:
        scaler = counting[i % 2]
        _, finite, _fraction = scaler.unscale(counting_arrays, underflow=True)
        counting[i % 2] = scaler.update(finite)

    return [
        Case("numpy", workload, "ampscale numpy", ampscale_step, moved, note=note),
        Case("numpy", workload, "ampscale numpy, underflow counted", counting_step, moved, note="same pass"),
        Case("numpy", workload, "naive numpy", naive, moved, anchor=True),
    ]


# ------------------------------------------------------------------------------ registry

ROW_PROVIDERS: dict[str, Callable[[str], list[Case]]] = {"numpy": numpy_cases}


def _register_optional() -> None:
    """Rows for the other backends live beside this file, one module each."""
    for name in ("torch", "jax", "cupy", "fp8"):
        module_path = os.path.join(HERE, f"rows_{name}.py")
        framework = "numpy" if name == "fp8" else name  # the FP8 rows load each framework they find
        if os.path.exists(module_path) and importlib.util.find_spec(framework) is not None:
            spec = importlib.util.spec_from_file_location(f"rows_{name}", module_path)
            assert spec is not None
            assert spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            ROW_PROVIDERS[name] = module.cases


# ------------------------------------------------------------------------------ report


def report(results: list[Result], as_markdown: bool) -> str:
    header = [
        "backend",
        "workload",
        "implementation",
        "ms/step",
        "GB/s",
        "x L",
        "x best anchor",
        "launches/step",
        "host us/step",
        "note",
    ]
    rows = []
    for r in results:
        limit = next((x for x in results if x.limit and x.workload == r.workload and x.device == r.device), None)
        if r.limit and r.device == "gpu" and r is not limit:
            continue  # several backends may each measure the GPU's L: keep the first
        anchors = [
            a for a in results if a.anchor and a.workload == r.workload and a.device == r.device and a.group == r.group
        ]
        best = min((a.seconds for a in anchors), default=None)
        ratio_a = f"{best / r.seconds:.2f}" if best else "-"
        ms = r.seconds * 1e3
        time_text = f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f}"
        name = r.name + (" (anchor)" if r.anchor else "")
        note = r.note
        if r.workload in FP8_WORKLOADS and limit is not None and not r.limit:
            # a read-only pass: its GB/s are bytes read, L's are bytes read and written
            speed = f"reads at {r.gbps / limit.gbps:.2f}x L's GB/s"
            note = f"{speed}; {note}" if note else speed
        rows.append(
            [
                r.backend,
                r.workload,
                name,
                time_text,
                f"{r.gbps:.1f}",
                "-" if limit is None else f"{limit.seconds / r.seconds:.2f}",
                ratio_a if not r.limit else "-",
                "-" if r.launches is None else f"{r.launches:g}",
                "-" if r.host_us is None else f"{r.host_us:.1f}",
                note,
            ]
        )
    if as_markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
        lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


#: the project's CPU targets that compare rows of one run: (backend, workload, row, against, at least).
#: ``against`` is another row, as ``"backend: name"``, or ``"L"``; "at least" is the ratio of
#: the other's time to the row's (2.0: twice as fast), or for ``"us"`` the most microseconds
TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    ("numpy", "W1", "ampscale numpy", "L", 0.80),
    ("numpy", "W1h", "ampscale numpy", "L", 0.30),
    ("numpy", "W2", "ampscale numpy", "L", 0.50),
    ("numpy", "W0", "ampscale numpy", "us", 20.0),
    ("torch", "W1", "ampscale torch (unscale + update)", "torch: torch.amp.GradScaler", 1.0),
    ("torch", "W2", "ampscale torch (unscale + update)", "torch: torch.amp.GradScaler", 2.0),
    ("torch", "W2", "ampscale torch (unscale + update)", "L", 0.60),
    ("torch", "W1h", "ampscale torch (unscale + update)", "numpy: ampscale numpy", 1.0),
    ("torch", "W0", "ampscale torch (unscale + update)", "us", 15.0),
    ("jax", "W1", "ampscale jax (jit, donated)", "L", 0.60),
    ("jax", "W2", "ampscale jax (jit, donated)", "jax: jmp (jit, donated)", 2.5),
    (
        "jax",
        "W2",
        "ampscale jax in a jitted loop (4 steps per call)",
        "jax: jmp in a jitted loop (4 steps per call)",
        3.0,
    ),
    ("jax", "W0", "ampscale jax (jit, donated)", "us", 50.0),
)


def targets_report(results: list[Result]) -> list[str]:
    """One line per target whose rows this run measured: the ratio, the target, met or not."""
    cpu = {(r.backend, r.workload, r.name): r for r in results if r.device == "cpu"}
    limits = {r.workload: r for r in results if r.limit and r.device == "cpu"}
    lines = []
    for backend, workload, name, against, target in TARGETS:
        row = cpu.get((backend, workload, name))
        if row is None:
            continue
        if against == "us":
            value = row.seconds * 1e6
            met = value <= target
            lines.append(f"{backend} {workload}: {name} {value:.1f} us (target <= {target:g} us): {_met(met)}")
            continue
        if against == "L":
            other, what = limits.get(workload), "L"
        else:
            other_backend, other_name = against.split(": ", 1)
            other, what = cpu.get((other_backend, workload, other_name)), other_name
        if other is None:
            continue
        ratio = other.seconds / row.seconds
        shown = f"{ratio:.2f} L" if what == "L" else f"{ratio:.2f}x {what}"
        goal = f"{target:g} L" if what == "L" else f"{target:g}x"
        lines.append(f"{backend} {workload}: {name} {shown} (target >= {goal}): {_met(ratio >= target)}")
    return lines


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def main(argv: list[str] | None = None) -> int:
    _register_optional()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends", default=",".join(ROW_PROVIDERS), help="comma-separated (default: all installed: %(default)s)"
    )
    parser.add_argument(
        "--workloads",
        default="W0,W1,W1h,W2,N,FP8",
        help="comma-separated; FP8 stands for FP8-W1,FP8-W2 (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (noisier)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument(
        "--gpu-only", action="store_true", help="only the GPU rows and the GPU's L (no CPU rows: scripts/gpu-check.sh)"
    )
    args = parser.parse_args(argv)
    if args.gpu_only:
        os.environ["AMPSCALE_BENCH_GPU_ONLY"] = "1"  # read by the row providers
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in ROW_PROVIDERS]
    if unknown:
        parser.error(f"unknown or not installed backend(s) {unknown}; available: {sorted(ROW_PROVIDERS)}")
    workloads = [w for name in args.workloads.split(",") if name for w in WORKLOAD_GROUPS.get(name, (name,))]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown workload(s) {bad}; choose from {sorted([*WORKLOADS, *WORKLOAD_GROUPS])}")

    print(
        f"# ampscale {ampscale.__version__} benchmark on {platform.machine()} {platform.processor() or ''}, "
        f"{os.cpu_count()} cpus, python {platform.python_version()}, numpy {np.__version__}",
        flush=True,
    )
    results: list[Result] = []
    for workload in workloads:
        cases = [] if args.gpu_only else [limit_case(workload)]
        only = {**PER_CALL_WORKLOADS, **FP8_WORKLOADS}.get(workload)
        for backend in backends:
            if (backend in only) if only is not None else backend not in ("fp8",):
                cases += ROW_PROVIDERS[backend](workload)
        if args.gpu_only:
            cases = [c for c in cases if c.device == "gpu"]
        if any(c.device == "gpu" for c in cases):
            limit = gpu_limit(workload)
            if limit is not None:
                results.append(limit[0])
        if cases:
            results += measure(cases, **budget(workload, args.quick))
        del cases
        forget_arrays()
        gc.collect()
        print(f"  {workload} done", file=sys.stderr, flush=True)
        if args.json:  # after every workload: a run stopped at a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
    print(report(results, args.markdown))
    lines = targets_report(results)
    if lines:
        print("\nTargets, in this run:" if not args.markdown else "\nTargets, in this run:\n")
        print("\n".join(f"- {line}" if args.markdown else f"  {line}" for line in lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
