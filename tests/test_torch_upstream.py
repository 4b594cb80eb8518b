"""What PyTorch's own GradScaler tests check, checked on ``torch.amp.GradScaler`` and the drop-in.

Every test here is parametrized over ``scaler_class``: ``torch`` (``torch.amp.GradScaler``, the
control: each test must pass with it, or the test is wrong) and ``ampscale``
(``ampscale.torch.GradScaler``). The behaviours are those that PyTorch's device-generic tests
check on the CPU: ``test/test_torch.py`` (``test_pickle_gradscaler``, the ``test_grad_scal*``
tests, ``test_params_invalidated_*`` and their helpers ``_create_scaling_models_optimizers``,
``_create_scaling_case`` and ``_run_scaling_case``) and ``test/test_cuda.py`` (``TestCudaOptims``:
fused Adam, AdamW, SGD and Adagrad, which run on the CPU too). The tests are written anew; the
upstream names are given for reference.

==== ===========================================================================================================
id   behaviour; upstream test -> test here
==== ===========================================================================================================
B1   A pickled (or copied) scaler, before or after its first ``scale()``, keeps the scale, factors and interval,
     restarts lazily (``_init_growth_tracker`` 0) and scales with the saved scale; its ``_per_optimizer_states``
     gives torch's fresh entry for any key; ``_scale`` lives on the device of the first scaled output.
     upstream: ``test_pickle_gradscaler``
     here: ``test_pickled_and_copied_scalers_restart``
B2   "cuda" without CUDA disables the scaler with a warning, decided by torch's
     ``amp_definitely_not_available``.
     upstream: ``test_pickle_gradscaler``
     here: ``test_cuda_without_cuda_is_decided_by_torchs_check``
B3   ``_unscale_grads_(opt, inv_scale, found_inf, allow_fp16)`` groups gradients by device and dtype (float32 or
     float64 with float16, contiguous or not), unscales them exactly, returns one flag per device and finds an
     inf or nan in any of them; ``allow_fp16=False`` refuses float16.
     upstream: ``test_grad_scaling_unscale``
     here: ``test_unscale_grads_finds_an_inf_or_nan_anywhere``
B4   Sparse gradients are unscaled through their values, inf and nan are found, float16 ones pass with
     ``allow_fp16``, and an uncoalesced float16 one whose duplicates overflow when summed is an overflow.
     upstream: ``test_grad_scaling_unscale_sparse``
     here: ``test_sparse_gradients``
B5   ``load_state_dict`` into a fresh or a lazily initialised scaler: the getters return the saved values,
     ``_init_growth_tracker`` is overwritten, ``_scale`` is a ``torch.FloatTensor``.
     upstream: ``test_grad_scaling_state_dict``
     here: ``test_state_dict_loads_into_fresh_or_initialised``
B6   The update rule: growth after ``growth_interval`` finite steps (tracker back to 0), backoff on an overflow
     (tracker to 0).
     upstream: ``test_grad_scaling_update_scale (on the kernel)``
     here: ``test_growth_and_backoff``
B7   Clipping scaled gradients at ``max_norm * get_scale()``: the poisoned step is skipped, the final scale is
     128 * 2**unskipped * 0.5**skipped, the model matches an unscaled control; a disabled scaler changes nothing
     in the loop.
     upstream: ``test_grad_scaling_clipping``
     here: ``test_scaling_matches_an_unscaled_control[clip_scaled]``
B8   ``unscale_``, then clipping (``error_if_nonfinite=False``), then ``step``.
     upstream: ``test_grad_scaling_clipping_separate_unscale``
     here: ``test_scaling_matches_an_unscaled_control[clip_unscaled]``
B9   A gradient penalty: ``autograd.grad`` of a scaled loss with ``create_graph``, unscaled by hand.
     upstream: ``test_grad_scaling_penalty``
     here: ``test_scaling_matches_an_unscaled_control[penalty]``
B10  Gradient accumulation over two micro-batches.
     upstream: ``test_grad_scaling_accumulation``
     here: ``test_scaling_matches_an_unscaled_control[accumulate]``
B11  Two models, two optimizers, two losses (a retained graph), ``unscale_`` of one optimizer only: only the
     overflowing optimizer skips, the scale backs off once.
     upstream: ``test_grad_scaling_multiple``
     here: ``test_two_models_two_optimizers_two_losses``
B12  float16 autocast on the CPU with SGD, Adam and AdamW (for-loop, foreach, fused), also with the scaler
     pickled after every ``update()``: the trajectory, and for SGD parameters within 1e-3 of a float32 control
     (upstream expects Adam and AdamW to miss that tolerance, and so do these tests).
     upstream: ``test_grad_scaling_autocast``
     here: ``test_float16_autocast``
B13  Gradients made non-finite *after* ``unscale_`` are applied: the flags are those of ``unscale_``.
     upstream: ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step (and
     ..._and_graph_partition)``
     here: ``test_grads_broken_after_unscale_are_applied``
B14  A growth that would overflow float32 is skipped: ``_scale`` stays finite.
     upstream: ``test_grad_scale_will_not_overflow``
     here: ``test_growth_past_float32_is_skipped``
B15  An optimizer with ``_step_supports_amp_scaling`` whose ``step`` takes ``grad_scaler`` gets the scaler (an
     instance of ``torch.amp.GradScaler``) with a ``FutureWarning``, and no ``grad_scale`` or ``found_inf``.
     upstream: ``test_grad_scaler_pass_itself``
     here: ``test_optimizer_taking_grad_scaler_gets_the_scaler``
B16  One whose ``step`` does not take it gets ``grad_scale`` and ``found_inf`` tensors for the step (a
     ``grad_scale`` it set is multiplied in; both are removed afterwards).
     upstream: ``test_grad_scaler_pass_itself``
     here: ``test_amp_aware_optimizer_gets_grad_scale_and_found_inf``
B17  Fused Adam, AdamW, SGD and Adagrad (which unscale in their own kernel, and not at all on a skipped step)
     match their unfused twins, with and without a separate ``unscale_``.
     upstream: ``TestCudaOptims.test_grad_scaling_autocast_fused_optimizers``
     here: ``test_fused_optimizer_matches_its_unfused_twin``
B18  A scaler cannot be pickled or copied between ``unscale_``/``step`` and ``update``.
     upstream: (the assertion in ``__getstate__`` that test_pickle_gradscaler relies on)
     here: ``test_a_scaler_mid_iteration_is_not_copied``
==== ===========================================================================================================

Not applicable, see ``docs/migration.md``: ``test_grad_scaler_deprecated_warning`` (the
``torch.cpu.amp.GradScaler`` and ``torch.cuda.amp.GradScaler`` aliases, which ampscale does
not provide), and the CUDA-only tests (CUDA graphs, several GPUs).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch.amp.grad_scaler import OptState  # noqa: E402

import ampscale.torch as amp_torch  # noqa: E402

CLASSES = {"torch": torch.amp.GradScaler, "ampscale": amp_torch.GradScaler}


@pytest.fixture(params=sorted(CLASSES))
def scaler_class(request: pytest.FixtureRequest) -> type:
    return CLASSES[request.param]


# ------------------------------------------------------------------------------ a control and a scaled twin


def twins(optimizer: type = torch.optim.SGD, **kwargs: object) -> tuple:
    """Two identical two-layer models (control, scaled) with an optimizer each (lr 1 by default)."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    kwargs = {"lr": 1.0, **kwargs}
    return control, scaled, optimizer(control.parameters(), **kwargs), optimizer(scaled.parameters(), **kwargs)


def data(seed: int = 0, steps: int = 4) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]


SKIP_AT = 2  # the iteration whose gradients get an inf


def poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


def assert_close_models(control, scaled, opt_control, opt_scaled, atol: float) -> None:
    for c, s in zip(control.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
        for key, value in opt_control.state[c].items():
            torch.testing.assert_close(opt_scaled.state[s][key], value, atol=atol, rtol=1e-5)
        torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


# ------------------------------------------------------------------------------ B1, B2


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
@pytest.mark.parametrize("initialised", [False, True])
def test_pickled_and_copied_scalers_restart(scaler_class: type, initialised: bool, how: str) -> None:
    scaler = scaler_class("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    assert scaler.is_enabled()
    if initialised:
        scaler.scale(torch.tensor([4.0]))
        assert scaler._scale.device.type == "cpu"
    clone = {"pickle": lambda s: pickle.loads(pickle.dumps(s)), "copy": copy.copy, "deepcopy": copy.deepcopy}[how](
        scaler
    )
    assert clone.is_enabled()
    assert (clone.get_scale(), clone.get_growth_factor(), clone.get_backoff_factor()) == (3.0, 4.0, 0.5)
    assert clone.get_growth_interval() == 2
    assert clone._init_growth_tracker == 0
    assert clone._scale is None  # re-created lazily
    assert clone._per_optimizer_states["any key"] == {"stage": OptState.READY, "found_inf_per_device": {}}
    assert clone.scale(torch.tensor([4.0])).item() == 12.0
    if initialised:
        assert scaler._scale is not clone._scale


@pytest.mark.parametrize("cuda_present", [False, True])
def test_cuda_without_cuda_is_decided_by_torchs_check(scaler_class: type, monkeypatch, cuda_present: bool) -> None:
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: not cuda_present)
    if cuda_present:  # e.g. torch_xla installed: torch keeps the scaler on, and so must the drop-in
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler = scaler_class()
        assert scaler.is_enabled()
    else:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = scaler_class()
        assert not scaler.is_enabled()
        clone = pickle.loads(pickle.dumps(scaler))
        assert not clone.is_enabled()
        assert clone.get_scale() == 1.0


# ------------------------------------------------------------------------------ B3, B4


def _mixed_grads(dtype: torch.dtype, bad_at: int, bad: float) -> list:
    g = torch.full((12, 12), 8.0, dtype=dtype)
    grads = [g.clone(), g.clone()[:, :5], g.clone().t(), g.to(torch.float16), g.to(torch.float16)[::2]]
    if bad_at >= 0:
        grads[bad_at][3, 1] = bad
    return grads


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscale_grads_finds_an_inf_or_nan_anywhere(scaler_class: type, dtype: torch.dtype, bad: float) -> None:
    scaler = scaler_class("cpu")
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in _mixed_grads(dtype, -1, bad)]
    opt = torch.optim.SGD(params, lr=1.0)
    inv_scale = torch.full((), 0.125)
    for bad_at in range(-1, len(params)):
        grads = _mixed_grads(dtype, bad_at, bad)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        found = scaler._unscale_grads_(opt, inv_scale, torch.zeros(()), True)
        assert list(found) == [torch.device("cpu")]
        assert sum(v.item() for v in found.values()) == (0.0 if bad_at < 0 else 1.0), bad_at
        if bad_at < 0:
            for p, g in zip(params, grads, strict=True):
                assert p.grad is g  # in place
                assert torch.equal(g, torch.ones_like(g))
    with pytest.raises(ValueError, match="FP16"):  # what torch's own unscale_ passes
        scaler._unscale_grads_(opt, inv_scale, torch.zeros(()), False)


def test_sparse_gradients(scaler_class: type) -> None:
    scaler = scaler_class("cpu")
    inv_scale = torch.full((1,), 0.25)
    index = torch.tensor([[0, 1, 1], [2, 0, 2]])
    values = torch.tensor([16.0, 32.0, 64.0])
    grad = torch.sparse_coo_tensor(index, values, (2, 3), check_invariants=True)
    param = torch.nn.Parameter(grad.clone())
    opt = torch.optim.SGD([param], lr=1.0)

    def check(grad: torch.Tensor, allow_fp16: bool = False) -> float:
        param.grad = grad
        (flag,) = scaler._unscale_grads_(opt, inv_scale, torch.zeros(1), allow_fp16).values()
        return flag.item()

    assert check(grad.clone()) == 0.0
    assert torch.equal(param.grad.to_dense(), (grad / 4).to_dense())
    for bad in (float("inf"), float("nan")):
        assert (
            check(torch.sparse_coo_tensor(index, torch.tensor([16.0, bad, 64.0]), (2, 3), check_invariants=True)) == 1.0
        )
    half = torch.nn.Parameter(grad.clone().half())
    opt = torch.optim.SGD([half], lr=1.0)
    param = half
    assert check(grad.clone().half(), allow_fp16=True) == 0.0
    assert torch.equal(param.grad.to_dense(), (grad.half() / 4).to_dense())
    # each value fits float16, their sum at the duplicated index (0, 2) does not
    duplicated = torch.sparse_coo_tensor(
        [[0, 1, 0], [2, 0, 2]], torch.tensor([60000.0, 32.0, 60000.0]), (2, 3), check_invariants=True
    )
    assert check(duplicated.half(), allow_fp16=True) == 1.0


# ------------------------------------------------------------------------------ B5, B6


@pytest.mark.parametrize("initialised", [False, True])
def test_state_dict_loads_into_fresh_or_initialised(scaler_class: type, initialised: bool) -> None:
    source = scaler_class("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    target = scaler_class("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    target._init_growth_tracker = 7  # scribbled on: the load must overwrite it
    if initialised:
        target.scale(torch.full((1,), 4.0))
        assert isinstance(target._scale, torch.FloatTensor)
        held = target._scale
    target.load_state_dict(source.state_dict())
    assert target.get_scale() == 3.0
    assert (target.get_growth_factor(), target.get_backoff_factor(), target.get_growth_interval()) == (4.0, 0.5, 2)
    assert target._init_growth_tracker == 0
    if initialised:
        assert target._scale is held  # filled in place
        assert target._get_growth_tracker() == 0


def test_growth_and_backoff(scaler_class: type) -> None:
    scaler = scaler_class("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    for overflow in (False, False, True):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if overflow:
            model.bias.grad.fill_(float("nan"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler._scale.item(), scaler._growth_tracker.item()))
    assert seen == [(4.0, 1), (8.0, 0), (2.0, 0)]


# ------------------------------------------------------------------------------ B7 to B11


def _run(kind: str, model, opt, scaler, batches: list, scaling: bool) -> None:
    """One training run of ``kind``; the control (``scaling`` False) skips the poisoned step itself."""
    loss_fn = torch.nn.MSELoss()
    max_norm = 0.2
    for i, (x, y) in enumerate(batches):
        poisoned = i == SKIP_AT and scaler.is_enabled()
        if kind == "accumulate":
            loss = loss_fn(model(x), y) / 2
            (scaler.scale(loss) if scaling else loss).backward()
            if i % 2 == 1:
                if scaling:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
            continue
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if kind == "penalty":
            if scaling:
                scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                grads = [g * (1.0 / scaler.get_scale()) for g in scaled_grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + torch.sqrt(sum(g.pow(2).sum() for g in grads))
        if not scaling:
            loss.backward()
            if kind.startswith("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not poisoned:
                opt.step()
            continue
        scaler.scale(loss).backward()
        if kind == "clip_scaled":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
        if poisoned:
            poison(model)
        if kind == "clip_unscaled":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(
    ("kind", "unskipped", "skipped", "atol"),
    [("clip_scaled", 3, 1, 1e-5), ("clip_unscaled", 3, 1, 1e-7), ("penalty", 3, 1, 1e-7), ("accumulate", 2, 0, 1e-7)],
)
def test_scaling_matches_an_unscaled_control(
    scaler_class: type, kind: str, unskipped: int, skipped: int, atol: float, enabled: bool
) -> None:
    torch.manual_seed(0)
    control, scaled, opt_control, opt_scaled = twins()
    scaler = scaler_class("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
    batches = data()
    _run(kind, control, opt_control, scaler, batches, scaling=False)
    _run(kind, scaled, opt_scaled, scaler, batches, scaling=True)
    expected = 128.0 * 2.0**unskipped * 0.5**skipped if enabled else 1.0
    assert scaler.get_scale() == expected
    assert_close_models(control, scaled, opt_control, opt_scaled, atol)


@pytest.mark.parametrize("enabled", [True, False])
def test_two_models_two_optimizers_two_losses(scaler_class: type, enabled: bool) -> None:
    torch.manual_seed(0)
    control0, scaled0, opt_control0, opt_scaled0 = twins()
    control1, scaled1, opt_control1, opt_scaled1 = twins()
    scaler = scaler_class("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
    loss_fn = torch.nn.MSELoss()

    def run(model0, model1, opt0, opt1, scaling: bool) -> None:
        for i, (x, y) in enumerate(data()):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
            poisoned = i == SKIP_AT and scaler.is_enabled()
            if scaling:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if poisoned:
                    poison(model1)
                scaler.unscale_(opt0)  # one optimizer unscaled separately
                scaler.step(opt0)
                scaler.step(opt1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()
                if not poisoned:
                    opt1.step()

    run(control0, control1, opt_control0, opt_control1, scaling=False)
    run(scaled0, scaled1, opt_scaled0, opt_scaled1, scaling=True)
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
    controls, scaled = [*control0.parameters(), *control1.parameters()], [*scaled0.parameters(), *scaled1.parameters()]
    for c, s in zip(controls, scaled, strict=True):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ B12, B13

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("pickled", [False, True])
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_float16_autocast(scaler_class: type, optimizer: str, implementation: str, pickled: bool) -> None:
    torch.manual_seed(0)
    control, scaled, opt_control, opt_scaled = twins(OPTIMIZERS[optimizer], **IMPLEMENTATIONS[implementation])
    scaler = scaler_class("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data()):
        opt_control.zero_grad()
        loss_fn(control(x), y).backward()
        if i != SKIP_AT:
            opt_control.step()
        opt_scaled.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(scaled(x), y)
        scaler.scale(loss).backward()
        if i == SKIP_AT:
            poison(scaled)
        before = [p.detach().clone() for p in scaled.parameters()]
        scaler.step(opt_scaled)
        scaler.update()
        if i == SKIP_AT:
            assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters(), strict=True))
        if pickled:
            scaler = pickle.loads(pickle.dumps(scaler))
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5
    if optimizer == "sgd":
        assert_close_models(control, scaled, opt_control, opt_scaled, atol=1e-3)
    else:  # as upstream expects: Adam's normalised steps amplify the float16 rounding
        with pytest.raises(AssertionError):
            assert_close_models(control, scaled, opt_control, opt_scaled, atol=1e-3)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_grads_broken_after_unscale_are_applied(scaler_class: type, optimizer: str, implementation: str) -> None:
    torch.manual_seed(0)
    _, model, _, opt = twins(OPTIMIZERS[optimizer], **IMPLEMENTATIONS[implementation])
    scaler = scaler_class("cpu", init_scale=128.0)
    for x, y in data():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.fill_(float("inf") if j % 2 else float("nan"))
        scaler.step(opt)
        scaler.update()
    assert all(not torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------ B14 to B16


def test_growth_past_float32_is_skipped(scaler_class: type) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    scaler = scaler_class("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    loss = (model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler._scale != float("inf")  # the upstream checks, on the tensor itself
    assert scaler._scale == scaler._scale
    assert scaler.get_scale() == torch.tensor(1e38).item()
    assert scaler._get_growth_tracker() == 0  # the interval was reached: the counter restarts


class _AmpAware(torch.optim.Optimizer):
    """An optimizer that handles the scale itself (``_step_supports_amp_scaling``)."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.seen: list = []


class _TakesScaler(_AmpAware):
    def step(self, closure=None, *, grad_scaler=None):
        self.seen.append((grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf")))


class _ReadsAttributes(_AmpAware):
    def step(self, closure=None):
        self.seen.append((self.grad_scale.clone(), self.found_inf.clone()))


def _backward(model: torch.nn.Module, scaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 4)).mean()
    scaler.scale(loss).backward()


def test_optimizer_taking_grad_scaler_gets_the_scaler(scaler_class: type) -> None:
    model = torch.nn.Linear(4, 1)
    opt = _TakesScaler(model.parameters())
    scaler = scaler_class("cpu", init_scale=2.0)
    _backward(model, scaler)
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    ((given, has_scale, has_found),) = opt.seen
    assert given is scaler
    assert isinstance(given, torch.amp.GradScaler)
    assert not has_scale
    assert not has_found


def test_amp_aware_optimizer_gets_grad_scale_and_found_inf(scaler_class: type) -> None:
    model = torch.nn.Linear(4, 1)
    opt = _ReadsAttributes(model.parameters())
    scaler = scaler_class("cpu", init_scale=2.0)
    _backward(model, scaler)
    model.bias.grad.fill_(float("inf"))
    scaler.step(opt)
    ((grad_scale, found_inf),) = opt.seen
    assert grad_scale.item() == 2.0
    assert found_inf.item() == 1.0
    assert not hasattr(opt, "grad_scale")  # removed after the step
    assert not hasattr(opt, "found_inf")
    scaler.update()
    assert scaler.get_scale() == 1.0
    opt.grad_scale = torch.tensor(3.0)  # a scale the optimizer holds itself is multiplied in
    opt.zero_grad()
    _backward(model, scaler)
    scaler.step(opt)
    assert opt.seen[-1][0].item() == 3.0
    assert opt.seen[-1][1].item() == 0.0
    scaler.update()


# ------------------------------------------------------------------------------ B17

FUSED = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


@pytest.mark.parametrize("separate_unscale", [False, True])
@pytest.mark.parametrize("optimizer", sorted(FUSED))
def test_fused_optimizer_matches_its_unfused_twin(scaler_class: type, optimizer: str, separate_unscale: bool) -> None:
    cls, kwargs = FUSED[optimizer]
    torch.manual_seed(20)
    unfused_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fused_model = copy.deepcopy(unfused_model)
    unfused = cls(unfused_model.parameters(), **kwargs, foreach=False)
    fused = cls(fused_model.parameters(), **kwargs, fused=True)
    scalers = scaler_class("cpu", init_scale=128.0), scaler_class("cpu", init_scale=128.0)
    for i, (x, y) in enumerate(data(steps=5)):
        used = []
        for model, opt, scaler in ((unfused_model, unfused, scalers[0]), (fused_model, fused, scalers[1])):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if i == SKIP_AT:
                poison(model)
            if separate_unscale and opt is fused:
                scaler.unscale_(opt)
            scaler.step(opt)
            used.append(scaler.get_scale())
            scaler.update()
        assert used[0] == used[1]
        for a, b in zip(unfused_model.parameters(), fused_model.parameters(), strict=True):
            # without unscale_, the fused kernel unscales .grad itself, and not at all on a skipped step
            skipped_in_kernel = i == SKIP_AT and not separate_unscale
            torch.testing.assert_close(b.grad, a.grad * used[0] if skipped_in_kernel else a.grad)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
            for key, value in unfused.state[a].items():
                got = fused.state[b][key]
                torch.testing.assert_close(got.squeeze() if key == "step" else got, value, atol=2e-5, rtol=2e-5)
    assert scalers[1].get_scale() == 128.0 / 2  # one backoff, growth interval not reached


def test_a_scaler_mid_iteration_is_not_copied(scaler_class: type) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_class("cpu")
    _backward(model, scaler)
    scaler.unscale_(opt)
    for how in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(AssertionError, match="pickled"):
            how(scaler)
    with contextlib.suppress(Exception):
        scaler.step(opt)
    scaler.update()
    assert copy.copy(scaler).get_scale() == scaler.get_scale()
