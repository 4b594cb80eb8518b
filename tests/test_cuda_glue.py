"""The torch CUDA step's host code, run on the CPU with the kernels emulated by the host harness.

The torch backend's one-launch path (packed state, torch's fused kernel writing into the
record's scratch, then ``ampscale_update`` or ``ampscale_step`` with the transition in its last
block) is driven here with CPU tensors: the module's launches go to the grid-emulating host
build of the very same kernel source (``tests/test_cuda_build.py``), so the launch arguments,
their order, the record views and the pending-state logic are exercised without a GPU. The
GPU itself is exercised by ``tests/test_cuda_gpu.py`` under ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ampscale  # noqa: E402
from ampscale._native.cuda._packed import PackedState  # noqa: E402
from ampscale._scaler import Scaler  # noqa: E402
from ampscale.backends import _torch_cuda  # noqa: E402
from ampscale.backends import torch as torch_backend  # noqa: E402
from tests.fake_cuda import HostModule, Launches, torch_on_host  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostModule]:
    """The torch backend's CUDA path on CPU tensors; the module of the tests' configuration."""
    with torch_on_host(monkeypatch, packed_on_cpu=False) as fake:
        config = ampscale.create_scaler(preset="torch", growth_interval=3).config
        yield fake.module(config, None)


def packed_scaler() -> Scaler:
    config = ampscale.create_scaler(preset="torch", growth_interval=3).config
    from ampscale._core import initial_values

    state = _torch_cuda._packed_from_values(initial_values(config), config, torch.device("cpu"))
    # the host bound of the scale, as create_scaler gives it: the scale itself
    return Scaler(config, state, torch_backend.BACKEND, config.initial_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_loss", [False, True])
def test_fused_steps_follow_the_host_scaler(module: HostModule, dtype: torch.dtype, with_loss: bool) -> None:
    rng = np.random.default_rng(1)
    ours, host = packed_scaler(), ampscale.create_scaler(backend="numpy", preset="torch", growth_interval=3)
    for step in range(24):
        values = [rng.standard_normal(n).astype(np.float32) * 100 for n in (7, 70_000, 1)]
        loss_value = np.float32(np.nan if with_loss and step % 5 == 4 else 1.5)
        if step % 4 == 1:
            values[1][int(rng.integers(70_000))] = np.inf
        grads = [torch.from_numpy(v).to(dtype) for v in values]
        reference = [g.float().clone().numpy() for g in grads]
        loss = torch.tensor(loss_value) if with_loss else None
        Launches.log.clear()
        # the host bound of the scale halves with every update (the host does not see the
        # outcome): from 2**16 it is below 1 from the 17th step on
        below_one = ours._floor_hint() < 1
        _, _, ours = ours.step(lambda p, g, s: (p, s), [], grads, (), loss=loss)
        finite = bool(np.all([np.isfinite(r).all() for r in reference])) and np.isfinite(loss_value)
        # torch's own kernel (on the CPU here) is not a module launch; then one launch: the
        # check kernel with the transition (bfloat16, a loss to check, or every gradient while
        # the scale may be below 1) or the update kernel
        own = dtype == torch.bfloat16 or with_loss or below_one
        assert module.launches == ["ampscale_step" if own else "ampscale_update"]
        host = host.update(bool(finite), loss_finite=bool(np.isfinite(loss_value)) if with_loss else None)
        assert ours.state_dict()["ampscale"]["state"] == host.state_dict()["ampscale"]["state"], step
        if finite:
            inv = np.float32(1.0 / np.float64(host.outcome.scale_before))
            for g, r in zip(grads, reference, strict=True):
                assert torch.equal(bits(g), bits(torch.from_numpy(r * inv).to(dtype)))


def test_update_with_the_returned_flag_launches_nothing(module: HostModule) -> None:
    scaler = packed_scaler()
    grads = [torch.full((100,), 2.0**16)]
    _, finite = scaler.unscale(grads)
    assert module.launches == ["ampscale_update"]  # torch's kernel, then the transition
    state = scaler._state
    assert isinstance(state, PackedState)
    nxt = scaler.update(finite)
    assert nxt._state is state.pending[2]
    assert module.launches == ["ampscale_update"]
    other = scaler.update(torch.tensor(True))  # another flag object: one update launch
    assert module.launches == ["ampscale_update", "ampscale_update"]
    assert other.state_dict() == nxt.state_dict()
    assert nxt.get_stats()["steps"] == 1
    assert float(grads[0][0]) == 1.0


def test_repeated_unscale_of_one_state_reuses_its_scratch_on_one_stream(module: HostModule) -> None:
    scaler = packed_scaler()
    bad = torch.tensor([1.0, float("inf")])
    good = torch.tensor([1.0, 2.0])
    assert not bool(scaler.unscale([bad])[1])
    assert bool(scaler.unscale([good])[1])  # the first call's flag was reset by its launch
    state = scaler._state
    assert state.scratch_stream == 0
    assert float(state.found_inf) == 0.0


def test_public_state_reads_the_record(module: HostModule) -> None:
    scaler = packed_scaler()
    scaler = scaler.update(scaler.unscale([torch.ones(3)])[1])
    public = scaler.state
    assert public is not None
    assert float(public.scale) == 65536.0
    assert int(public.steps) == 1
    assert scaler.get_stats()["steps"] == 1
    assert scaler.outcome.applied.dtype == torch.bool
