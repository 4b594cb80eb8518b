"""Benchmark cases for the JAX backend (loaded by ``benchmarks/run.py`` when jax is installed).

Two ways a step runs, both with the gradients donated (the best case for everyone):

* **one jitted call per step**: ampscale's ``unscale`` + ``update`` (with its custom call, on
  the CPU or CUDA, and with the custom call turned off: the pure-XLA path), jmp's ``unscale`` + ``all_finite`` +
  ``adjust`` (the anchor), and the floor of any such call: a jitted function that only takes
  and returns the same donated arrays (for W2's 2000 arrays this is jit's own dispatch cost);
* **inside a jitted loop**, as training runs it: a ``fori_loop`` of :data:`LOOP_STEPS` steps per
  call, reported per step, for ampscale and jmp.

Every step alternates the scales 16 and 1/16 (two scalers, or two jmp states), so the data
keeps its magnitude. The compile time of the first call is in the notes. With JAX on a GPU the
rows are labelled ``jax-gpu`` and compared with the device's L (and, in the same run, with
torch's fused kernel when the torch rows run too): ``scripts/gpu-check.sh`` runs them.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from run import SCALES, Case, make_arrays, nbytes

import ampscale
from ampscale.backends import jax as jax_backend

LOOP_STEPS = 4  # steps per call of the jitted loop (an even number: the scales alternate)


def _arrays(workload: str) -> list[jax.Array]:
    return [jnp.asarray(a) for a in make_arrays(workload)]


def _compiled(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn`` jitted with its first argument donated and compiled for ``args``, and the seconds it took."""
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=0).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _first_call(fn: Any, data: dict[str, Any], state: Any) -> tuple[Any, float]:
    """Run ``fn`` once on ``data``'s gradients (jmp's state cannot be lowered from abstract
    values, so its first call compiles it); the new state and the seconds it took."""
    start = time.perf_counter()
    data["grads"], state = fn(data["grads"], state)
    jax.block_until_ready(data["grads"])
    return state, time.perf_counter() - start


def _per_step(compiled: Any, data: dict[str, Any], states: list[Any]) -> tuple[Any, Any]:
    """A Case step running one compiled step per call on the donated gradients in ``data``.

    The cases of a workload share one ``data``: each call donates the arrays and stores the
    results there for the next case, so every row works on the same memory.
    """

    def step(i: int) -> None:
        data["grads"], states[i % 2] = compiled(data["grads"], states[i % 2])

    return step, lambda: jax.block_until_ready(data["grads"])


def _looped(compiled: Any, data: dict[str, Any], states: tuple[Any, Any]) -> tuple[Any, Any]:
    """A Case step running one compiled loop of LOOP_STEPS steps per call on ``data``'s gradients."""
    holder = {"states": states}

    def step(i: int) -> None:
        data["grads"], holder["states"] = compiled(data["grads"], holder["states"])

    return step, lambda: jax.block_until_ready(data["grads"])


def _loop(one_step: Any) -> Any:
    """``(grads, (a, b)) -> (grads, (a, b))``: LOOP_STEPS steps, alternating the two states."""

    def run(grads: Any, states: Any) -> Any:
        def body(_: Any, carry: Any) -> Any:
            grads, (a, b) = carry
            grads, a = one_step(grads, a)  # scale 16
            grads, b = one_step(grads, b)  # scale 1/16: the data is back where it was
            return grads, (a, b)

        return jax.lax.fori_loop(0, LOOP_STEPS // 2, body, (grads, states))

    return run


def cases(workload: str) -> list[Case]:
    out: list[Case] = []
    grads = _arrays(workload)
    data = {"grads": grads}
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
    saved["ampscale"]["state"]["scale"] = saved["ampscale"]["state"]["last_scale"] = saved["scale"] = SCALES[1]
    scalers = [first, first.load_state_dict(saved)]

    status = jax_backend.custom_call_status()
    if not status.active:
        fused_note = f"no custom call: {status.reason}"
    elif device == "cpu":
        fused_note = f"custom call ({status.kernel_isa})"
    else:
        fused_note = (
            f"custom call (CUDA, {status.cuda_reason})"
            if status.cuda_available
            else f"no custom call: {status.cuda_reason}"
        )

    def row(name: str, step_and_sync: tuple[Any, Any], **extra: Any) -> None:
        step, sync = step_and_sync
        out.append(Case(label, workload, name, step, moved, device=device, sync=sync, **extra))

    compiled, seconds = _compiled(ampscale_step, data["grads"], scalers[0])
    row(
        "ampscale jax (jit, donated)",
        _per_step(compiled, data, list(scalers)),
        note=f"compile {seconds:.1f} s; {fused_note}",
    )

    def xla_step(g: Any, scaler: Any) -> Any:  # a function of its own: jit caches traces per function
        return ampscale_step(g, scaler)

    # scripts/gpu-check.sh (--gpu-only) has seconds, not minutes: W2's pure-XLA path alone takes
    # about 10 s to compile (its figure before the custom call, 19.4 ms, is in benchmarks/README.md)
    if not (workload == "W2" and os.environ.get("AMPSCALE_BENCH_GPU_ONLY") == "1"):
        with jax_backend.use_custom_call(False):
            compiled, seconds = _compiled(xla_step, data["grads"], scalers[0])
        row(
            "ampscale jax, pure-XLA path (jit, donated)",
            _per_step(compiled, data, list(scalers)),
            note=f"compile {seconds:.1f} s",
        )

    compiled, seconds = _compiled(_loop(ampscale_step), data["grads"], tuple(scalers))
    row(
        f"ampscale jax in a jitted loop ({LOOP_STEPS} steps per call)",
        _looped(compiled, data, tuple(scalers)),
        note=f"compile {seconds:.1f} s",
        steps_per_call=LOOP_STEPS,
    )

    # The floor of a jitted call that takes and returns the same donated arrays (and a state).
    compiled, _ = _compiled(lambda g, s: (g, s), data["grads"], scalers[0])
    row(f"floor: jitted identity on {len(grads)} donated arrays", _per_step(compiled, data, list(scalers)))

    if importlib.util.find_spec("jmp") is not None:
        import jmp

        def jmp_step(g: Any, loss_scale: Any) -> Any:
            g = loss_scale.unscale(g)
            return g, loss_scale.adjust(jmp.all_finite(g))

        states = [jmp.DynamicLossScale(jnp.float32(s), period=10**9) for s in SCALES]
        note = "; promotes float16 to float32" if workload == "W1h" else ""
        # jmp changes float16 gradients to float32: on W1h it works on arrays of its own
        jmp_data = {"grads": _arrays(workload)} if workload == "W1h" else data
        jmp_jit = jax.jit(jmp_step, donate_argnums=0)
        states[0], seconds = _first_call(jmp_jit, jmp_data, states[0])
        row(
            "jmp (jit, donated)",
            _per_step(jmp_jit, jmp_data, states),
            anchor=True,
            note=f"compile {seconds:.1f} s{note}",
        )
        if workload != "W1h":  # a loop cannot carry float16 gradients that jmp returns as float32
            looped = jax.jit(_loop(jmp_step), donate_argnums=0)
            loop_states, seconds = _first_call(looped, data, tuple(states))
            row(
                f"jmp in a jitted loop ({LOOP_STEPS} steps per call)",
                _looped(looped, data, loop_states),
                note=f"compile {seconds:.1f} s",
                steps_per_call=LOOP_STEPS,
            )
    return out
