"""Amaxes and the loss scaler's flags agreed across ranks in ONE collective per step, nan kept.

* JAX on 8 CPU devices (a subprocess with ``--xla_force_host_platform_device_count=8``, as
  ``tests/test_jax_mesh.py``): ``unscale_and_update(..., group="data")`` under ``shard_map``
  emits one all-reduce (StableHLO) and runs one (the compiled HLO), and its states equal the
  single-device reference fed the max of the eight devices' amaxes;
* torch with 2 gloo processes (as ``tests/test_torch_distributed.py``): one
  ``torch.distributed.all_reduce`` per step (counted by wrapping it), a nan on one rank reaches
  every rank, both ranks skip a step only one overflowed, and ``Fp8Scaler.update(group=)``
  reduces in one all-reduce too; a run without a group is refused.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

JAX_SCRIPT = """
import json
import numpy as np
import jax, jax.numpy as jnp
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P
import ampscale, ampscale.fp8 as fp8

assert len(jax.devices()) == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("data",))
SLOTS = {"x": "forward", "w": "forward", "dy": "backward"}


def all_reduces(fn, *args):
    lowered = jax.jit(fn).lower(*args)
    emitted = lowered.as_text().count("stablehlo.all_reduce")
    text = lowered.compile().as_text()
    run = sum(line.count(" all-reduce(") + line.count(" all-reduce-start(") for line in text.splitlines())
    return [emitted, run]


def step(scaler, f8, grads, amax, loss):
    out = fp8.unscale_and_update(scaler, f8, {"w": grads[0]}, amax[0], loss=loss[0], group="data")
    return out.scaler, out.fp8_scaler, out.finite


mapped = jax.jit(shard_map(
    step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P("data")), out_specs=(P(), P(), P()), check_vma=True
))

rng = np.random.default_rng(0)
scaler = ampscale.create_scaler(backend="jax", init_scale=2.0**8, growth_interval=2)
f8 = fp8.create_fp8_scaler("te_delayed", SLOTS, backend="jax", history_len=4)
reference_scaler, reference_f8 = scaler, f8
results = []
for k in range(4):
    amax = rng.uniform(0.5, 60.0, (8, 3)).astype(np.float32)
    grads = np.full((8, 5), 2.0**8, np.float32)
    loss = np.full((8,), 3.0, np.float32)
    if k == 1:
        amax[5, 2] = np.nan          # one device's dy amax is nan
    if k == 2:
        grads[3, 1] = np.inf         # one device's gradient overflows
    if k == 3:
        loss[6] = np.inf             # one device's scaled loss overflows
    args = (jnp.asarray(grads), jnp.asarray(amax), jnp.asarray(loss))
    if k == 0:
        results.append({"counts": all_reduces(mapped, scaler, f8, *args)})
    scaler, f8, finite = mapped(scaler, f8, *args)
    # the single-device reference: every device's amax reduced by a nan-keeping max
    top = np.where(np.isnan(amax).any(0), np.nan, np.nanmax(amax, 0)).astype(np.float32)
    ok = bool(np.isfinite(grads).all() and np.isfinite(loss).all())
    reference_scaler = reference_scaler.update(jnp.asarray(ok))
    reference_f8 = reference_f8.update(jnp.asarray(top), step_ok=jnp.asarray(ok))
    same = all(
        np.array_equal(np.asarray(a).view(np.uint32) if np.asarray(a).dtype == np.float32 else np.asarray(a),
                       np.asarray(b).view(np.uint32) if np.asarray(b).dtype == np.float32 else np.asarray(b))
        for a, b in zip(f8.state, reference_f8.state)
    )
    results.append({
        "finite": bool(finite), "ok": ok, "same_fp8": same,
        "scale": scaler.get_scale(), "reference_scale": reference_scaler.get_scale(),
        "dy_history": np.asarray(f8.history(2)).tolist(),
    })
print(json.dumps(results))
"""


def test_jax_one_all_reduce_per_step_on_8_devices_and_the_single_device_reference() -> None:
    pytest.importorskip("jax")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JAX_SCRIPT)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results[0]["counts"] == [1, 1]  # one emitted, one run: amaxes, nan flags, both found-infs
    steps = results[1:]
    assert [s["finite"] for s in steps] == [s["ok"] for s in steps] == [True, True, False, False]
    assert all(s["same_fp8"] for s in steps), steps
    assert [s["scale"] for s in steps] == [s["reference_scale"] for s in steps] == [2.0**8, 2.0**9, 2.0**8, 2.0**7]
    assert any(math.isnan(v) for v in steps[1]["dy_history"])  # the nan of one device reached the state


# ------------------------------------------------------------------------------ torch, 2 processes

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _scenarios(rank: int) -> dict:
    import ampscale
    import ampscale.fp8 as fp8

    calls: list[tuple[int, ...]] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    out: dict = {}
    # what gloo's own MAX does with a nan on one rank (recorded, not relied on)
    plain = torch.tensor([math.nan if rank == 0 else 1.0])
    real(plain, op=dist.ReduceOp.MAX)
    out["plain_max_of_nan"] = plain.item()

    dist.all_reduce = counting
    try:
        slots = {"x": "forward", "w": "forward", "dy": "backward"}
        scaler = ampscale.create_scaler(backend="torch", init_scale=4.0, growth_interval=2)
        f8 = fp8.create_fp8_scaler("te_delayed", slots, backend="torch", history_len=4)
        steps = []
        # per step: (rank whose dy amax is nan, rank whose gradient overflows, rank whose loss overflows)
        for nan_rank, grad_rank, loss_rank in ((None, None, None), (0, None, None), (None, 1, None), (None, None, 0)):
            amax = torch.tensor([1.0 + rank, 3.0 - rank, 10.0 * (rank + 1)])
            if rank == nan_rank:
                amax[2] = math.nan
            grads = [torch.full((4,), 8.0), torch.full((2,), 4.0)]
            if rank == grad_rank:
                grads[1][0] = math.inf
            loss = torch.tensor(math.inf if rank == loss_rank else 3.0)
            start = len(calls)
            result = fp8.unscale_and_update(scaler, f8, grads, amax, loss=loss, group="world")
            scaler, f8 = result.scaler, result.fp8_scaler
            steps.append(
                {
                    "calls": calls[start:],
                    "finite": bool(result.finite),
                    "reason": scaler.outcome.reason_name(int(scaler.outcome.reason)),
                    "history": f8.history().tolist(),
                    "scale": scaler.get_scale(),
                }
            )
        out["steps"] = steps
        start = len(calls)
        alone = fp8.create_fp8_scaler("ampscale", ["a", "b"], backend="torch", history_len=2)
        alone = alone.update(torch.tensor([math.nan if rank == 1 else 2.0, 5.0 * (rank + 1)]), group="world")
        out["update_calls"] = calls[start:]
        out["update_state"] = {"nonfinite": alone.state.nonfinite.tolist(), "history": alone.history().tolist()}
        try:
            fp8.create_fp8_scaler("ampscale", ["a"], backend="torch").update(torch.tensor([1.0]))
        except ValueError as exc:
            out["no_group"] = str(exc)
        out["calls_total"] = len(calls)
    finally:
        dist.all_reduce = real
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = _scenarios(rank)
    finally:
        dist.destroy_process_group()
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]


def nan_as_text(rows):
    return [["nan" if v != v else v for v in row] for row in rows]


def test_torch_one_all_reduce_per_step_with_nan_and_flags_kept(ranks: list[dict]) -> None:
    for out in ranks:
        steps = out["steps"]
        # one float32 buffer per step: 3 amaxes, 3 nan flags, the gradients' and the loss's flags
        assert [s["calls"] for s in steps] == [[(8,)]] * 4
        assert [s["finite"] for s in steps] == [True, True, False, False]
        assert [s["reason"] for s in steps] == ["applied", "applied", "gradients", "loss"]
        assert [s["scale"] for s in steps] == [4.0, 8.0, 4.0, 2.0]
    # both ranks hold the same state, with the max of both ranks' amaxes and rank 0's nan
    assert nan_as_text(ranks[0]["steps"][-1]["history"]) == nan_as_text(ranks[1]["steps"][-1]["history"])
    dy = nan_as_text(ranks[1]["steps"][1]["history"])[2]
    assert dy[-2:] == [20.0, "nan"]  # rank 1's dy history got rank 0's nan
    assert ranks[1]["steps"][0]["history"][0][-1] == 2.0  # x: max(1, 2)
    assert ranks[0]["steps"][0]["history"][1][-1] == 3.0  # w: max(3, 2)


def test_torch_fp8_update_with_a_group_reduces_in_one_all_reduce_and_requires_a_group(ranks: list[dict]) -> None:
    for out in ranks:
        assert out["update_calls"] == [(4,)]  # 2 amaxes and their 2 nan flags
        assert out["update_state"]["nonfinite"] == [1, 0]  # rank 1's nan, counted on rank 0 too
        assert out["update_state"]["history"][1] == [0.0, 10.0]
        assert "group must be given while torch.distributed runs with 2 ranks" in out["no_group"]
        assert out["calls_total"] == 5  # nothing else communicated
    # gloo's own MAX, for the record: what a single plain all-reduce does with one rank's nan
    assert all(isinstance(out["plain_max_of_nan"], float) for out in ranks)


def test_reduce_amax_with_a_callable_group_keeps_nan_where_the_max_drops_it() -> None:
    """A group whose max ignores nan (NCCL's MAX): the separate nan flags bring it back."""
    import ampscale.fp8 as fp8

    others = [np.float32([5.0, 0.0, 0.0, 1.0])]  # another rank: amax 5, nan-as-0, and a nan flag

    def nan_ignoring_max(buffer: np.ndarray) -> np.ndarray:
        return np.fmax.reduce([buffer, *others])

    got = fp8.reduce_amax(np.float32([1.0, 2.0]), nan_ignoring_max)
    assert got[0] == 5.0
    assert np.isnan(got[1])
    with pytest.raises(ValueError, match=r"amax must be a 1-D array .* got shape \(2, 1\)"):
        fp8.reduce_amax(np.zeros((2, 1), np.float32), None)
    with pytest.raises(TypeError, match=r"group must be None, a callable .* got 'world' for numpy arrays"):
        fp8.reduce_amax(np.float32([1.0]), "world")


# ------------------------------------------------------------------------------ CuPy and NCCL


def test_cupy_one_nccl_all_reduce_per_update_with_nan_kept(monkeypatch) -> None:
    """Over the fake CuPy: ``Fp8Scaler.update(group=communicator)`` makes one NCCL all-reduce
    (MAX, float32, in place, on the current stream) of amaxes and nan flags; a second rank
    (played by the communicator) with a larger amax and a nan reaches the state."""
    import ctypes
    import types

    import ampscale.fp8 as fp8
    from ampscale.fp8 import _cuda
    from tests.fake_cuda import Launches, cupy_on_host

    monkeypatch.setattr(_cuda, "_cupy_functions", {})
    _cuda._cupy_fp8_max.cache_clear()
    calls = []

    class NcclCommunicator:
        def allReduce(self, send, receive, count, dtype, op, stream):
            calls.append((send == receive, count, dtype, op, stream))
            mine = np.ctypeslib.as_array((ctypes.c_float * count).from_address(receive))
            other = np.float32([5.0, 0.0, 0.0, 1.0])  # the other rank: amaxes 5 and nan (as 0 + its flag)
            mine[:] = np.maximum(mine, other)

    with cupy_on_host(monkeypatch) as (cp, _module):
        cp.cuda.nccl = types.SimpleNamespace(NCCL_FLOAT32=7, NCCL_MAX=2)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)  # for `from cupy.cuda import nccl`
        for name in ("concatenate", "where", "zeros_like", "full"):  # the fake returns NumPy arrays there
            function = getattr(np, name)
            monkeypatch.setattr(cp, name, lambda *a, f=function, **k: f(*a, **k).view(cp.ndarray), raising=False)
        with cp.cuda.Stream() as stream:
            f8 = fp8.create_fp8_scaler("ampscale", ["a", "b"], backend="cupy", history_len=2)
            before = len(Launches.log)
            f8 = f8.update(cp.asarray(np.float32([1.0, 2.0])), group=NcclCommunicator())
        assert calls == [(True, 4, 7, 2, stream.ptr)]
        assert [name for name, _, _ in Launches.log[before:]] == [_cuda.KERNEL]
        assert np.asarray(f8.history()).tolist() == [[0.0, 5.0], [0.0, 0.0]]
        assert np.asarray(f8.state.nonfinite).tolist() == [0, 1]  # the other rank's nan, counted here
        with pytest.raises(TypeError, match=r"group must be None, a callable .* got 'world' for cupy arrays"):
            f8.update(cp.asarray(np.float32([1.0, 2.0])), group="world")

        # with the loss scaler: still one all-reduce, now of 2 amaxes, 2 nan flags and 2 found-infs;
        # the other rank's gradients overflowed (its found-inf, the fifth value, is 1)
        calls.clear()

        class OverflowingRank(NcclCommunicator):
            def allReduce(self, send, receive, count, dtype, op, stream):
                calls.append((send == receive, count, dtype, op, stream))
                mine = np.ctypeslib.as_array((ctypes.c_float * count).from_address(receive))
                mine[:] = np.maximum(mine, np.float32([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))

        import ampscale

        scaler = ampscale.create_scaler(backend="cupy", init_scale=4.0)
        grads = [cp.asarray(np.full(3, 8.0, np.float32))]
        step = fp8.unscale_and_update(
            scaler,
            f8,
            grads,
            cp.asarray(np.float32([3.0, 1.0])),
            loss=cp.asarray(np.float32(12.0)),
            group=OverflowingRank(),
        )
        assert [c[1] for c in calls] == [6]
        assert not bool(step.finite)
        assert step.scaler.get_scale() == 2.0
        assert np.asarray(step.fp8_scaler.state.history).tolist() == np.asarray(f8.state.history).tolist()  # frozen
