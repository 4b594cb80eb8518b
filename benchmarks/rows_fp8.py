"""Benchmark cases for FP8 bookkeeping (loaded by ``benchmarks/run.py``; workloads ``FP8-W1``,
``FP8-W2``, selected together by ``--workloads FP8``).

The bookkeeping of one step: the amax of every tensor, the transition over every slot (scale,
history write) and nothing else, on the same float32 data for every row (W1: GPT-2 small's 148
tensors; W2: 2000 tensors of 4096 values). Each row reads every tensor once; its GB/s is the
bytes READ per second, and its "x L" is L's time over its own (L moves the same bytes twice: a
read and a write). The note gives its read speed against L's GB/s, the memory limit of a pass
that only reads.

Rows are compared within their group, each with its own anchor on the same data:

* **amax**: ``ampscale.fp8.amax`` on NumPy arrays, torch CPU tensors and jitted JAX arrays,
  against NumPy's ``max(abs(x))`` per tensor (``tensor_amax``) and torch's
  ``_foreach_norm(ord=inf)``;
* **torchao**: ``fp8.amax`` + ``Fp8Scaler.update`` with the ``torchao_tensorwise`` preset
  (current scaling: no history) on torch CPU tensors, against torchao's own current-scaling
  bookkeeping, ``tensor_to_amax`` + ``amax_to_scale`` per tensor (its delayed scaling was
  removed), and against the form torchao's FSDP precompute uses, one ``_foreach_norm(inf)``
  over every tensor then ``amax_to_scale`` of the stacked amaxes;
* **flax**: ``fp8.amax`` + ``Fp8Scaler.update`` with the ``flax`` preset (history of 1024),
  one jitted call, against flax's ``fp8_ops.update_fp8_meta`` for every tensor in one jitted
  call (its history of 1024 rolled per tensor).

On a GPU (torch CUDA, CuPy; ``--gpu-only`` keeps only these), timed with CUDA events:

* **cast**: ``fp8.amax_and_cast`` to E4M3FN (one launch: every amax, payload and count) against
  a plain device copy of the same input bytes (``copy_``), the bound a pass that reads every
  byte and writes something cannot beat by much; its GB/s count the bytes read and the payload
  bytes written;
* **amax**: ``fp8.amax`` against ``torch._foreach_norm(ord=inf)``.

Launches per step are counted by the profiler (1 for each ampscale row).
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import numpy as np
from run import Case, make_arrays, nbytes

import ampscale.fp8 as fp8

GROUPS = ("amax", "torchao", "flax")


def _sync_jax(value: Any) -> None:
    import jax

    jax.block_until_ready(value)


def numpy_cases(workload: str, arrays: list[np.ndarray]) -> list[Case]:
    moved = nbytes(arrays)
    from ampscale.backends import numpy as numpy_backend

    note = f"native kernels ({numpy_backend.kernel_isa()})" if numpy_backend.NATIVE else "pure-NumPy path"
    return [
        Case("fp8", workload, "ampscale fp8.amax, numpy", lambda i: fp8.amax(arrays), moved, note=note, group="amax"),
        Case(
            "fp8",
            workload,
            "numpy max(abs(x)) per tensor (tensor_amax)",
            lambda i: [fp8.tensor_amax(a) for a in arrays],
            moved,
            anchor=True,
            group="amax",
        ),
    ]


def torch_cases(workload: str, arrays: list[np.ndarray]) -> list[Case]:
    import torch

    tensors = [torch.from_numpy(a) for a in arrays]  # the NumPy rows' memory
    moved = nbytes(arrays)
    holder = {"scaler": fp8.create_fp8_scaler("torchao_tensorwise", slots=len(tensors), backend="torch")}

    def bookkeeping(i: int) -> None:
        holder["scaler"] = holder["scaler"].update(fp8.amax(tensors))

    cases = [
        Case("fp8", workload, "ampscale fp8.amax, torch CPU", lambda i: fp8.amax(tensors), moved, group="amax"),
        Case(
            "fp8",
            workload,
            "torch._foreach_norm(inf)",
            lambda i: torch._foreach_norm(tensors, ord=math.inf),
            moved,
            anchor=True,
            group="amax",
        ),
        Case(
            "fp8",
            workload,
            "ampscale amax + update, torch CPU (torchao_tensorwise)",
            bookkeeping,
            moved,
            note="fp8.amax, then Fp8Scaler.update over every slot",
            group="torchao",
        ),
    ]
    if importlib.util.find_spec("torchao") is not None:
        try:
            from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
        except Exception as exc:  # pragma: no cover - a torchao that does not import here
            print(f"  torchao rows skipped: {exc}")
            return cases
        e4m3 = torch.float8_e4m3fn

        def per_tensor(i: int) -> None:
            for t in tensors:
                amax_to_scale(tensor_to_amax(t), e4m3)

        def foreach(i: int) -> None:
            amax_to_scale(torch.stack(torch._foreach_norm(tensors, ord=math.inf)), e4m3)

        cases += [
            Case(
                "fp8",
                workload,
                "torchao tensor_to_amax + amax_to_scale per tensor",
                per_tensor,
                moved,
                anchor=True,
                group="torchao",
            ),
            Case(
                "fp8",
                workload,
                "torchao FSDP precompute: _foreach_norm(inf) + amax_to_scale",
                foreach,
                moved,
                anchor=True,
                group="torchao",
            ),
        ]
    return cases


def jax_cases(workload: str, arrays: list[np.ndarray]) -> list[Case]:
    import jax
    import jax.numpy as jnp

    from ampscale.fp8 import _fused_jax

    leaves = [jnp.asarray(a) for a in arrays]
    moved = nbytes(arrays)
    amax = jax.jit(lambda x: fp8.amax(x))
    amax(leaves)
    chosen = _fused_jax.last_lowering() or ""
    scaler = fp8.create_fp8_scaler("flax", slots=len(leaves), backend="jax")
    step = jax.jit(lambda s, x: s.update(fp8.amax(x)))
    holder = {"scaler": step(scaler, leaves)}

    def bookkeeping(i: int) -> None:
        holder["scaler"] = step(holder["scaler"], leaves)

    cases = [
        Case(
            "fp8",
            workload,
            "ampscale fp8.amax, jax jit",
            lambda i: amax(leaves),
            moved,
            note=chosen,
            group="amax",
            sync=lambda: _sync_jax(amax(leaves[:1])),
        ),
        Case(
            "fp8",
            workload,
            "ampscale amax + update, jax jit (flax preset, history 1024)",
            bookkeeping,
            moved,
            note=chosen,
            group="flax",
            sync=lambda: _sync_jax(holder["scaler"].state.scale),
        ),
    ]
    if importlib.util.find_spec("flax") is not None:
        from flax.linen import fp8_ops

        length = scaler.config.history_len

        @jax.jit
        def flax_step(x: list[Any], scales: list[Any], histories: list[Any]) -> tuple[list[Any], list[Any]]:
            meta = zip(x, scales, histories, strict=True)
            updated = [fp8_ops.update_fp8_meta(t, jnp.float8_e4m3fn, s, h) for t, s, h in meta]
            return [u[0] for u in updated], [u[1] for u in updated]

        meta = {
            "scales": [jnp.ones((1,), jnp.float32) for _ in leaves],
            "histories": [jnp.zeros((length,), jnp.float32) for _ in leaves],
        }
        meta["scales"], meta["histories"] = flax_step(leaves, meta["scales"], meta["histories"])

        def flax_bookkeeping(i: int) -> None:
            meta["scales"], meta["histories"] = flax_step(leaves, meta["scales"], meta["histories"])

        cases.append(
            Case(
                "fp8",
                workload,
                "flax fp8_ops.update_fp8_meta per tensor, jit (history 1024)",
                flax_bookkeeping,
                moved,
                anchor=True,
                group="flax",
                sync=lambda: _sync_jax(meta["scales"]),
            )
        )
    return cases


def _event_timed(fn: Any, events: tuple[Any, Any], reps: int = 5) -> Any:
    """A step that runs ``fn`` ``reps`` times between two CUDA events: seconds per run."""

    def step(i: int) -> float:
        events[0].record()
        for _ in range(reps):
            fn()
        events[1].record()
        events[1].synchronize()
        return float(events[0].elapsed_time(events[1])) / 1e3 / reps

    return step


def _launches(fn: Any) -> Any:
    """Kernels, memsets and copies of one call of ``fn``, counted by torch's profiler."""

    def count() -> float:
        import torch
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return float(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))

    return count


def gpu_cases(workload: str, arrays: list[np.ndarray]) -> list[Case]:
    """The GPU rows (torch CUDA, and CuPy when installed), on a copy of the data on the device."""
    out: list[Case] = []
    read = nbytes(arrays)
    elements = sum(a.size for a in arrays)
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            tensors = [torch.from_numpy(a).cuda() for a in arrays]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            target = torch.empty_like(flat)
            scales = torch.full((len(tensors),), 2.0, device="cuda")
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            sync = torch.cuda.synchronize
            out += [
                Case(
                    "fp8-gpu",
                    workload,
                    "ampscale fp8.amax_and_cast e4m3fn, torch CUDA",
                    _event_timed(lambda: fp8.amax_and_cast(tensors, scales, "e4m3fn"), events),
                    read + elements,
                    device="gpu",
                    group="cast",
                    timed=True,
                    sync=sync,
                    launches_of=_launches(lambda: fp8.amax_and_cast(tensors, scales, "e4m3fn")),
                    note="CUDA events; GB/s: read + payload written",
                ),
                Case(
                    "fp8-gpu",
                    workload,
                    "device copy of the same bytes (copy_)",
                    _event_timed(lambda: target.copy_(flat), events),
                    2 * read,
                    anchor=True,
                    device="gpu",
                    group="cast",
                    timed=True,
                    sync=sync,
                    launches_of=_launches(lambda: target.copy_(flat)),
                    note="CUDA events",
                ),
                Case(
                    "fp8-gpu",
                    workload,
                    "ampscale fp8.amax, torch CUDA",
                    _event_timed(lambda: fp8.amax(tensors), events),
                    read,
                    device="gpu",
                    group="amax",
                    timed=True,
                    sync=sync,
                    launches_of=_launches(lambda: fp8.amax(tensors)),
                    note="CUDA events",
                ),
                Case(
                    "fp8-gpu",
                    workload,
                    "torch._foreach_norm(inf), CUDA",
                    _event_timed(lambda: torch._foreach_norm(tensors, ord=math.inf), events),
                    read,
                    anchor=True,
                    device="gpu",
                    group="amax",
                    timed=True,
                    sync=sync,
                    launches_of=_launches(lambda: torch._foreach_norm(tensors, ord=math.inf)),
                    note="CUDA events",
                ),
            ]
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        try:
            have_gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            have_gpu = False
        if have_gpu:
            device_arrays = [cupy.asarray(a) for a in arrays]
            cupy_scales = cupy.full((len(arrays),), 2.0, dtype=cupy.float32)
            cupy_events = (cupy.cuda.Event(), cupy.cuda.Event())

            def cupy_step(i: int) -> float:
                cupy_events[0].record()
                for _ in range(5):
                    fp8.amax_and_cast(device_arrays, cupy_scales, "e4m3fn")
                cupy_events[1].record()
                cupy_events[1].synchronize()
                return float(cupy.cuda.get_elapsed_time(cupy_events[0], cupy_events[1])) / 1e3 / 5

            out.append(
                Case(
                    "fp8-gpu",
                    workload,
                    "ampscale fp8.amax_and_cast e4m3fn, CuPy",
                    cupy_step,
                    read + elements,
                    device="gpu",
                    group="cast",
                    timed=True,
                    sync=cupy.cuda.get_current_stream().synchronize,
                    note="CUDA events; GB/s: read + payload written",
                    launches_of=_launches(lambda: fp8.amax_and_cast(device_arrays, cupy_scales, "e4m3fn")),
                )
            )
    return out


def cases(workload: str) -> list[Case]:
    """Every installed framework's FP8 rows for ``workload`` (``FP8-W1`` or ``FP8-W2``)."""
    arrays = make_arrays(workload)
    if os.environ.get("AMPSCALE_BENCH_GPU_ONLY"):
        return gpu_cases(workload, arrays)
    out = numpy_cases(workload, arrays)
    if importlib.util.find_spec("torch") is not None:
        out += torch_cases(workload, arrays)
    if importlib.util.find_spec("jax") is not None:
        out += jax_cases(workload, arrays)
    return out + gpu_cases(workload, arrays)
