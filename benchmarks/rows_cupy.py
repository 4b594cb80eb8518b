"""Benchmark cases for the CuPy backend on a GPU (loaded by ``benchmarks/run.py`` with cupy).

Rows: ampscale's one-launch step (unscale + update), the unscale alone, and a per-array CuPy
loop (``isfinite().all()`` + multiply per array, the anchor), all synchronised at the end of
each round. The GPU's L (CUDA events) is measured by ``run.py``.
"""

from __future__ import annotations

import cupy
from run import SCALES, Case, make_arrays, nbytes

import ampscale


def cases(workload: str) -> list[Case]:
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return []
    except Exception:
        return []
    sync = cupy.cuda.get_current_stream().synchronize
    grads = [cupy.asarray(a) for a in make_arrays(workload)]
    moved = 2 * nbytes(grads)
    scalers = [ampscale.create_scaler(backend="cupy", init_scale=s, growth_interval=10**9) for s in SCALES]

    def fused(i: int) -> None:
        scaler = scalers[i % 2]
        _, finite = scaler.unscale(grads)
        scalers[i % 2] = scaler.update(finite)

    kernel_scalers = [ampscale.create_scaler(backend="cupy", init_scale=s) for s in SCALES]

    def kernel_only(i: int) -> None:  # the same launch, its next state discarded
        kernel_scalers[i % 2].unscale(grads)

    loop_grads = [cupy.asarray(a) for a in make_arrays(workload)]
    invs = [cupy.float32(1.0 / s) for s in SCALES]

    def per_array(i: int) -> None:
        flags = [cupy.logical_not(cupy.isfinite(g).all()) for g in loop_grads]
        for g in loop_grads:
            g *= invs[i % 2]
        _ = flags

    out = [
        Case("cupy", workload, "ampscale cupy (one launch: unscale + update)", fused, moved, device="gpu", sync=sync),
        Case("cupy", workload, "ampscale cupy unscale only", kernel_only, moved, device="gpu", sync=sync),
        Case("cupy", workload, "per-array cupy loop", per_array, moved, device="gpu", anchor=True, sync=sync),
    ]
    return out
