"""Issue 14's rules on torch's one-launch CUDA path, driven on the CPU (see test_cuda_glue.py).

torch's own kernel checks the inputs: while the host bound of the device scale says it may be
below 1, ampscale's kernel (which checks the values it writes, in the same pass) takes every
contiguous gradient instead, and torch's kernel with a check-only pass of the values written
only the non-contiguous ones; aliasing and refusals happen before any kernel runs. No GPU
here: the launches go to the host build of the same kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ampscale  # noqa: E402
from ampscale._core import initial_values  # noqa: E402
from ampscale._scaler import Scaler  # noqa: E402
from ampscale.backends import _torch_cuda  # noqa: E402
from ampscale.backends import torch as torch_backend  # noqa: E402
from tests.fake_cuda import Launches  # noqa: E402
from tests.test_cuda_glue import module  # noqa: E402, F401  (the fixture: kernels on the host)

pytestmark = pytest.mark.usefixtures("module")


def packed(scale: float, scale_floor: float | None) -> Scaler:
    config = ampscale.create_scaler(preset="torch", growth_interval=3).config
    values = initial_values(config)._replace(scale=scale, last_scale=scale)
    state = _torch_cuda._packed_from_values(values, config, torch.device("cpu"))
    return Scaler(config, state, torch_backend.BACKEND, scale_floor)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The inverse scale of every call of torch's fused kernel."""
    calls: list[float] = []
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(grads: Any, found_inf: Any, inv: Any) -> None:
        calls.append(float(inv))
        original(grads, found_inf, inv)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_below_one_the_fused_path_flags_values_that_overflow_when_unscaled(
    kernel_calls: list[float], dtype: Any
) -> None:
    big = 3e38 if dtype == torch.float32 else 60000.0
    scaler = packed(0.125, None)  # no bound known: ampscale's kernel, which checks what it writes
    _, finite = scaler.unscale([torch.ones(5, dtype=dtype), torch.tensor([big, 1.0], dtype=dtype)])
    assert not bool(finite)
    assert kernel_calls == []  # torch's kernel (checks its inputs) is not used below 1
    assert Launches.names() == ["ampscale_step"]  # one launch: check, unscale and the transition
    grads = [torch.ones(5, dtype=dtype)]
    _, finite = packed(0.125, 0.125).unscale(grads)
    assert bool(finite)
    assert grads[0].tolist() == [8.0] * 5


def test_below_one_a_non_contiguous_gradient_gets_torchs_kernel_and_the_second_pass(kernel_calls: list[float]) -> None:
    scaler = packed(0.125, None)
    strided = torch.tensor([[3e38, 1.0], [1.0, 1.0]]).t()  # not contiguous: not for ampscale's kernel
    _, finite = scaler.unscale([torch.ones(5), strided])
    assert not bool(finite)  # 3e38 * 8 overflows: the check-only pass of the values written sees it
    assert kernel_calls == [8.0, 1.0]
    assert Launches.names() == ["ampscale_step"]  # the contiguous gradient, then the transition


def test_a_host_bound_of_at_least_one_skips_the_second_pass(kernel_calls: list[float]) -> None:
    scaler = packed(4.0, 4.0)
    _, finite = scaler.unscale([torch.full((5,), 8.0)])
    assert bool(finite)
    assert kernel_calls == [0.25]  # one pass
    # the bound falls by one backoff per update (the host does not see the outcome): 4, 2, 1, 0.5
    for _ in range(3):
        scaler = scaler.update(scaler.unscale([torch.full((5,), 8.0)])[1])
    kernel_calls.clear()
    Launches.log.clear()
    scaler.unscale([torch.ones(3)])
    assert scaler._floor_hint() == 0.5
    # the scale grew to 8, but the bound says it may be below 1: ampscale's kernel, one launch
    assert kernel_calls == []
    assert Launches.names() == ["ampscale_step"]
    assert scaler.get_scale() == 8.0  # a read makes the bound exact again
    Launches.log.clear()
    scaler.unscale([torch.ones(3)])
    assert kernel_calls == [0.125]
    assert Launches.names() == ["ampscale_update"]


def test_the_fused_path_unscales_each_location_once_and_refuses_before_writing() -> None:
    scaler = packed(4.0, 4.0)
    g = torch.full((8,), 8.0)
    out, _ = scaler.unscale({"a": g, "b": g, "c": g.view(2, 4)})
    assert out["a"] is g
    assert g.tolist() == [2.0] * 8
    g = torch.full((8,), 8.0)
    with pytest.raises(ampscale.AliasedGradientsError):
        scaler.unscale([torch.full((3,), 8.0), g, g[2:]])
    assert g.tolist() == [8.0] * 8
    with pytest.raises(ampscale.AliasedGradientsError):
        scaler.unscale([g, torch.ones(1).expand(4)])
    assert g.tolist() == [8.0] * 8
    assert np.isfinite(scaler.get_scale())
