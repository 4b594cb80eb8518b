"""Benchmark cases for the JAX backend (loaded by ``benchmarks/run.py`` when jax is installed).

Both rows are one jitted step with the gradients donated (the best case for both): ampscale's
``unscale`` + ``update``, and jmp's ``unscale`` + ``all_finite`` + ``adjust`` (the anchor).
The compile time of the first call is reported in the notes.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import jax
import jax.numpy as jnp
from run import SCALES, Case, make_arrays, nbytes

import ampscale


def _arrays(workload: str) -> list[jax.Array]:
    return [jnp.asarray(a) for a in make_arrays(workload)]


def _runner(step_fn: Any, grads: list[jax.Array], states: list[Any]) -> tuple[Any, float, Any]:
    """A Case step closing over donated gradients, the compile time, and a sync function."""
    holder = {"grads": grads, "states": states}
    start = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=0).lower(grads, states[0]).compile()
    compile_seconds = time.perf_counter() - start

    def step(i: int) -> None:
        holder["grads"], holder["states"][i % 2] = compiled(holder["grads"], holder["states"][i % 2])

    def sync() -> None:
        jax.block_until_ready(holder["grads"])

    return step, compile_seconds, sync


def cases(workload: str) -> list[Case]:
    out: list[Case] = []
    grads = _arrays(workload)
    moved = 2 * nbytes(grads)
    device = "cpu" if jax.default_backend() == "cpu" else "gpu"
    label = "jax" if device == "cpu" else "jax-gpu"  # rows on a GPU compare with the GPU's L
    if device == "gpu":  # the device's own L: a donated in-place multiply of one buffer
        buffer = {"x": jnp.concatenate([g.reshape(-1) for g in _arrays(workload)])}
        mul = jax.jit(lambda x, s: x * s, donate_argnums=0)

        def limit(i: int) -> None:
            buffer["x"] = mul(buffer["x"], SCALES[i % 2])

        out.append(
            Case(
                "jax-gpu",
                workload,
                "L: jax donated multiply",
                limit,
                moved,
                device=device,
                limit=True,
                sync=lambda: jax.block_until_ready(buffer["x"]),
            )
        )

    def ampscale_step(g: Any, scaler: Any) -> Any:
        g, finite = scaler.unscale(g)
        return g, scaler.update(finite)

    # One config (static under jit), two current scales: the second is a loaded checkpoint.
    first = ampscale.create_scaler(backend="jax", init_scale=SCALES[0], growth_interval=10**9)
    saved = first.state_dict()
    saved["ampscale"]["state"]["scale"] = saved["ampscale"]["state"]["last_scale"] = SCALES[1]
    scalers = [first, first.load_state_dict(saved)]
    step, seconds, sync = _runner(ampscale_step, grads, scalers)
    out.append(
        Case(
            label,
            workload,
            "ampscale jax (jit, donated)",
            step,
            moved,
            note=f"compile {seconds:.1f} s",
            device=device,
            sync=sync,
        )
    )

    if importlib.util.find_spec("jmp") is not None:
        import jmp

        def jmp_step(g: Any, loss_scale: Any) -> Any:
            g = loss_scale.unscale(g)
            return g, loss_scale.adjust(jmp.all_finite(g))

        jmp_grads = _arrays(workload)
        states = [jmp.DynamicLossScale(jnp.float32(s), period=10**9) for s in SCALES]
        holder = {"grads": jmp_grads, "states": states}
        fn = jax.jit(jmp_step, donate_argnums=0)
        start = time.perf_counter()
        holder["grads"], holder["states"][0] = fn(holder["grads"], holder["states"][0])
        jax.block_until_ready(holder["grads"])
        jmp_seconds = time.perf_counter() - start

        def jmp_run(i: int) -> None:
            holder["grads"], holder["states"][i % 2] = fn(holder["grads"], holder["states"][i % 2])

        note = f"compile {jmp_seconds:.1f} s"
        if workload == "W1h":
            note += "; promotes float16 to float32"
        out.append(
            Case(
                label,
                workload,
                "jmp (jit, donated)",
                jmp_run,
                moved,
                anchor=True,
                note=note,
                device=device,
                sync=lambda: jax.block_until_ready(holder["grads"]),
            )
        )
    return out
