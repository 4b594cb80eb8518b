"""Overflow agreed across ranks: torch's scalers and ampscale's, side by side on 2 CPU processes.

One spawn (gloo, 2 ranks) runs every scenario; each rank saves what it saw and the test checks
it here:

* hand-sharded gradients (each rank steps only the parameters it owns, dense and a float16
  sparse embedding, and one rank has an optimizer with no gradient at all): torch's
  ``ShardedGradScaler`` and ``ampscale.torch.ShardedGradScaler`` give bitwise the same
  parameters, scales, trackers and flags, and both ranks skip a step only one rank overflowed;
* FSDP2 (``fully_shard`` runs on the CPU): ``torch.amp.GradScaler``, both ``ShardedGradScaler``
  and ``ampscale.torch.GradScaler`` give the same trajectory;
* ``ampscale.torch.GradScaler(process_group="world")``: both ranks skip a step only one
  overflowed;
* the documented differences: with a fused optimizer and no ``unscale_`` torch's sharded
  scaler lets the ranks disagree, and after ``unscale_`` its flags are refused by the
  optimizer; ampscale's agree and work; on the CPU torch's grows to inf.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _dense(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _data(rank: int, steps: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(steps)]


POISON_AT = {2, 3}  # steps at which rank 0 alone overflows


def _hand_sharded(rank: int, world: int, scaler_class: type) -> dict:
    """ZeRO-like: replicated forward, gradients averaged, each rank steps the parameters it owns."""
    model = _dense()
    embedding = torch.nn.Embedding(10, 4, sparse=True).half()
    with torch.no_grad():
        embedding.weight.copy_(torch.linspace(-1, 1, 40).reshape(10, 4))
    params = list(model.parameters())
    owned = params[rank::world]
    opt = torch.optim.SGD([*owned, *embedding.parameters()], lr=0.05)
    unused = torch.nn.Parameter(torch.zeros(3))  # rank 1: an optimizer without any gradient
    extra = torch.nn.Parameter(torch.ones(3))
    opt_extra = torch.optim.SGD([extra if rank == 0 else unused], lr=0.05)
    scaler = scaler_class("cpu", init_scale=2.0**10, growth_interval=2)
    seen = []
    for step, (x, y) in enumerate(_data(rank, 6)):
        opt.zero_grad()
        opt_extra.zero_grad()
        index = torch.tensor([1, 3, 3, 3, step % 10])  # duplicates: an uncoalesced gradient
        loss = torch.nn.functional.mse_loss(model(x), y) + embedding(index).float().pow(2).sum() * 1e-2
        if rank == 0:
            loss = loss + extra.sum() * 1e-3
        scaler.scale(loss).backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world
        if rank == 0 and step in POISON_AT:
            owned[0].grad[0, 0] = float("inf") if step == 2 else float("nan")
        before = [p.detach().clone() for p in owned]
        scaler.unscale_(opt)
        flags = {str(d): f.item() for d, f in scaler._found_inf_per_device(opt).items()}
        scaler.step(opt)
        scaler.step(opt_extra)
        scaler.update()
        applied = not all(torch.equal(a, b) for a, b in zip(before, owned, strict=True))
        for i, p in enumerate(params):  # every rank gets the parameters the others own
            dist.broadcast(p.data, src=i % world)
        seen.append(
            {
                "applied": applied,
                "flags": flags,
                "scale": scaler.get_scale(),
                "tracker": scaler._get_growth_tracker(),
                "params": [p.detach().clone() for p in params],
                "embedding": embedding.weight.detach().clone(),
                "extra": extra.detach().clone(),
            }
        )
    return {"seen": seen}


def _fsdp2(rank: int, scaler_class: type) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _dense()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = scaler_class("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step, (x, y) in enumerate(_data(rank, 5)):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if rank == 0 and step == 2:
            next(iter(model.parameters())).grad.to_local()[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return {"scales": scales, "params": [p.full_tensor().detach().clone() for p in model.parameters()]}


def _world_group(rank: int) -> dict:
    import ampscale.torch as amp_torch

    model = _dense()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp_torch.GradScaler("cpu", process_group="world", growth_interval=2)
    x, y = _data(rank, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if rank == 0:
        model[0].weight.grad[0, 0] = float("inf")  # only rank 0 overflows
    scaler.step(opt)
    applied = bool(scaler.last_step.applied)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"applied": applied, "unchanged": unchanged, "scale": scaler.get_scale()}


def _fused(rank: int, scaler_class: type, unscale: bool) -> dict:
    model = _dense()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = scaler_class("cpu")
    x, y = _data(rank, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if rank == 0:
        model[0].weight.grad[0, 0] = float("inf")
    if unscale:
        scaler.unscale_(opt)
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        return {"error": str(exc)}
    scaler.update()
    return {"applied": any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))}


def _cpu_growth_near_the_ceiling(rank: int, scaler_class: type) -> dict:
    model = _dense()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = scaler_class("cpu", init_scale=2.0**127, growth_interval=1)
    x, y = _data(rank, 1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y) * 0).backward()
    scaler.step(opt)
    scaler.update()
    return {"scale": scaler.get_scale()}


def _collectives(rank: int) -> dict:
    """The core scaler with ``loss=`` on ``axis_name="world"``: the all-reduces each step makes
    (counted by wrapping ``torch.distributed.all_reduce``) and what the ranks decided."""
    import ampscale

    calls: list[tuple[int, ...]] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    def sgd(params, grads, state):
        return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], state

    dist.all_reduce = counting
    try:
        scaler = ampscale.create_scaler(backend="torch", axis_name="world", init_scale=4.0, growth_interval=2)
        params = [torch.zeros(5), torch.zeros(3)]
        steps = []
        # (rank whose gradient overflows, rank whose scaled loss overflows), per step
        for grad_rank, loss_rank in ((None, None), (0, None), (None, 1), (None, None), (1, 0)):
            grads = [torch.full((5,), 8.0), torch.full((3,), 4.0)]
            if rank == grad_rank:
                grads[1][2] = float("inf")
            loss = torch.tensor(float("inf") if rank == loss_rank else 3.0)
            start = len(calls)
            params, _, scaler = scaler.step(sgd, params, grads, (), loss=loss)
            steps.append({"calls": calls[start:], "reason": scaler.outcome.reason_name(int(scaler.outcome.reason))})
        start = len(calls)
        _, _finite = scaler.unscale([torch.full((2,), 1.0)])  # no loss: the gradients' flag alone
        steps.append({"calls": calls[start:], "reason": "unscale only"})
        return {"steps": steps, "stats": scaler.get_stats(), "params": [p.tolist() for p in params]}
    finally:
        dist.all_reduce = real


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import warnings

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import ampscale.torch as amp_torch

    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    for name, cls in (("torch", ShardedGradScaler), ("ampscale", amp_torch.ShardedGradScaler)):
        out[f"sharded-{name}"] = _hand_sharded(rank, world, cls)
        out[f"fused-{name}"] = _fused(rank, cls, unscale=False)
        out[f"fused-unscaled-{name}"] = _fused(rank, cls, unscale=True)
        out[f"ceiling-{name}"] = _cpu_growth_near_the_ceiling(rank, cls)
    for name, cls in (
        ("torch", torch.amp.GradScaler),
        ("torch-sharded", ShardedGradScaler),
        ("ampscale", amp_torch.GradScaler),
        ("ampscale-sharded", amp_torch.ShardedGradScaler),
    ):
        out[f"fsdp2-{name}"] = _fsdp2(rank, cls)
    out["world"] = _world_group(rank)
    out["collectives"] = _collectives(rank)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]


def test_sharded_scalers_agree_bit_for_bit_on_hand_sharded_gradients(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        theirs, ours = out["sharded-torch"]["seen"], out["sharded-ampscale"]["seen"]
        assert len(theirs) == len(ours) == 6
        for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
            where = f"rank {rank} step {step}"
            assert o["applied"] == t["applied"] == (step not in POISON_AT), where  # both ranks skip
            assert o["flags"] == t["flags"], where  # summed over the ranks, as torch's
            assert (o["scale"], o["tracker"]) == (t["scale"], t["tracker"]), where
            for a, b in zip(o["params"], t["params"], strict=True):
                assert torch.equal(a, b), where
            assert torch.equal(o["embedding"], t["embedding"]), where
            assert torch.equal(o["extra"], t["extra"]), where
    scales = [s["scale"] for s in ranks[0]["sharded-ampscale"]["seen"]]
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**9, 2.0**9, 2.0**10]
    flags = [s["flags"] for s in ranks[1]["sharded-ampscale"]["seen"]]
    assert flags[2] == {"cpu": 1.0}  # rank 1's own gradients were finite: the flag came from rank 0


def test_fsdp2_trajectories_match_across_the_four_scalers(ranks: list[dict]) -> None:
    for out in ranks:
        reference = out["fsdp2-torch"]
        assert reference["scales"][1:3] == [(2.0**11, 0), (2.0**10, 0)]  # rank 0 alone overflowed at step 2
        for name in ("torch-sharded", "ampscale", "ampscale-sharded"):
            got = out[f"fsdp2-{name}"]
            assert got["scales"] == reference["scales"], name
            for a, b in zip(got["params"], reference["params"], strict=True):
                assert torch.equal(a, b), name


def test_process_group_setting_makes_the_ranks_agree(ranks: list[dict]) -> None:
    assert [r["world"]["applied"] for r in ranks] == [False, False]
    assert all(r["world"]["unchanged"] for r in ranks)
    assert ranks[0]["world"]["scale"] == ranks[1]["world"]["scale"] == 2.0**15


def test_documented_differences_from_torchs_sharded_scaler(ranks: list[dict]) -> None:
    # fused optimizer, no unscale_: torch's ranks disagree (rank 1 steps), ampscale's both skip
    assert [r["fused-torch"]["applied"] for r in ranks] == [False, True]
    assert [r["fused-ampscale"]["applied"] for r in ranks] == [False, False]
    # fused optimizer after unscale_: torch's 1-element flags are refused, ampscale's 0-d ones work
    assert all("shape" in r["fused-unscaled-torch"]["error"] for r in ranks)
    assert [r["fused-unscaled-ampscale"]["applied"] for r in ranks] == [False, False]
    # CPU update: torch's sharded scaler multiplies in float32 without the finiteness check
    assert [r["ceiling-torch"]["scale"] for r in ranks] == [float("inf")] * 2
    assert [r["ceiling-ampscale"]["scale"] for r in ranks] == [2.0**127] * 2


def test_one_all_reduce_per_step_for_both_flags(ranks: list[dict]) -> None:
    """The core scaler with ``loss=`` and a process group: one blocking all-reduce per step,
    of a 2-element buffer holding both flags (it was two, the gradients' then the loss's), and
    the ranks still agree on both: the same reasons, counters, scale and parameters."""
    for out in ranks:
        steps = out["collectives"]["steps"]
        assert [s["calls"] for s in steps[:-1]] == [[(2,)]] * 5
        assert steps[-1]["calls"] == [()]  # unscale without a loss: the one flag
        assert [s["reason"] for s in steps[:-1]] == ["applied", "gradients", "loss", "applied", "loss"]
    assert ranks[0]["collectives"]["stats"] == ranks[1]["collectives"]["stats"]
    assert ranks[0]["collectives"]["stats"]["loss_overflows"] == 2
    assert ranks[0]["collectives"]["params"] == ranks[1]["collectives"]["params"]


def test_sharded_scalers_keep_the_outputs_dtype() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import ampscale.torch as amp_torch

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        loss = torch.tensor(3.0, dtype=dtype, requires_grad=True)
        ours = amp_torch.ShardedGradScaler("cpu", init_scale=4.0).scale([loss, (loss * 2,)])
        theirs = ShardedGradScaler("cpu", init_scale=4.0).scale([loss, (loss * 2,)])
        assert ours[0].dtype == theirs[0].dtype == ours[1][0].dtype == dtype
        assert ours[0].item() == theirs[0].item() == 12.0
        assert amp_torch.ShardedGradScaler("cpu", init_scale=4.0).scale(loss).dtype == dtype
    # float16 overflows where float32 would not: the returned (float16) value is what is checked
    scaler = amp_torch.ShardedGradScaler("cpu", init_scale=2.0**16)
    assert scaler.scale(torch.tensor(2.0, dtype=torch.float16, requires_grad=True)).isinf()
    assert scaler._loss_bad_on_host


def test_copy_of_the_sharded_scaler_keeps_its_class() -> None:
    import ampscale.torch as amp_torch

    scaler = amp_torch.ShardedGradScaler("cpu", init_scale=8.0)
    clone = copy.deepcopy(scaler)
    assert type(clone) is amp_torch.ShardedGradScaler
    assert clone.get_scale() == 8.0
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(scaler, ShardedGradScaler)
    assert isinstance(scaler, torch.amp.GradScaler)
