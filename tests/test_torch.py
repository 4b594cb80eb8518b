"""ampscale.torch.GradScaler against torch.amp.GradScaler, side by side, and what torch lacks."""

from __future__ import annotations

import contextlib
import copy
import os
import pickle

import pytest

torch = pytest.importorskip("torch")

import ampscale  # noqa: E402
import ampscale.torch as amp_torch  # noqa: E402
from ampscale import _torch_scaler  # noqa: E402
from ampscale.backends import _torch_cpu  # noqa: E402
from ampscale.backends import torch as torch_backend  # noqa: E402


def make_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)


def batches(n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 8, generator=g, dtype=dtype), torch.randn(32, 4, generator=g, dtype=dtype)) for _ in range(n)
    ]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


def train_step(model, optimizer, scaler, x, y, inject: bool):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if inject:
        model[0].weight.grad[3, 5] = float("inf")
    scaler.step(optimizer)
    scaler.update()


SIDE_BY_SIDE = [
    ({"growth_interval": 1}, {0, 1, 5}),
    ({"growth_interval": 2}, {3, 4, 9, 17}),
    ({"growth_interval": 3, "init_scale": 2.0**10}, {7}),
    ({"growth_interval": 7, "growth_factor": 1.5, "backoff_factor": 0.75}, {2, 11, 12, 13}),
    ({"growth_interval": 1, "init_scale": 2.0**125}, set()),  # growth reaches the float32 ceiling
    ({"growth_interval": 5, "growth_factor": 1.1, "backoff_factor": 0.3}, {1, 8}),
]
# the device path on a few of them (the same transition, so fewer cases suffice)
DEVICE_SIDE_BY_SIDE = [(o, *SIDE_BY_SIDE[k], "device") for o in ("sgd", "adam-fused") for k in (1, 3, 4)]


@pytest.mark.parametrize(
    ("optimizer", "settings", "inject_at", "state"),
    [(o, *case, "host") for o in sorted(OPTIMIZERS) for case in SIDE_BY_SIDE] + DEVICE_SIDE_BY_SIDE,
)
def test_side_by_side_with_torch_grad_scaler(
    monkeypatch, optimizer: str, settings: dict, inject_at: set, state: str
) -> None:
    """``state="device"`` runs the accelerator path (0-d tensor state, tensor transition) on CPU tensors."""
    if state == "device":
        monkeypatch.setattr(_torch_scaler, "_DEVICE_PATH_EVERYWHERE", True)
    ours_model, torch_model = make_model(), make_model()
    ours_opt, torch_opt = (
        OPTIMIZERS[optimizer](ours_model.parameters()),
        OPTIMIZERS[optimizer](torch_model.parameters()),
    )
    ours = amp_torch.GradScaler("cpu", **settings)
    theirs = torch.amp.GradScaler("cpu", **settings)
    for step, (x, y) in enumerate(batches(24)):
        train_step(ours_model, ours_opt, ours, x, y, step in inject_at)
        train_step(torch_model, torch_opt, theirs, x, y, step in inject_at)
        assert ours.get_scale() == theirs.get_scale(), step
        assert ours._get_growth_tracker() == theirs._get_growth_tracker(), step
        for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=False):
            assert torch.equal(a, b), step
        assert ours.state_dict() == theirs.state_dict()


@pytest.mark.parametrize("direction", ["torch->ampscale", "ampscale->torch"])
def test_state_dicts_cross_load_and_continue_identically(direction: str) -> None:
    settings = {"growth_interval": 2, "init_scale": 2.0**12}
    first = (
        amp_torch.GradScaler("cpu", **settings)
        if direction == "ampscale->torch"
        else torch.amp.GradScaler("cpu", **settings)
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(20)
    for step, (x, y) in enumerate(data[:7]):
        train_step(model, opt, first, x, y, step == 3)
    saved = first.state_dict()
    ours = amp_torch.GradScaler("cpu")
    theirs = torch.amp.GradScaler("cpu")
    ours.load_state_dict(saved)
    theirs.load_state_dict(saved)
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.05), torch.optim.SGD(m2.parameters(), lr=0.05)
    for step, (x, y) in enumerate(data[7:]):
        train_step(m1, o1, ours, x, y, step == 5)
        train_step(m2, o2, theirs, x, y, step == 5)
        assert ours.get_scale() == theirs.get_scale()
        assert ours.state_dict() == theirs.state_dict()


def test_fp16_and_bf16_gradients_are_accepted() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        model = make_model(dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = amp_torch.GradScaler("cpu", init_scale=2.0**8)
        x, y = batches(1, dtype)[0]
        before = [p.detach().clone() for p in model.parameters()]
        train_step(model, opt, scaler, x, y, False)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
        assert all(p.grad.dtype == dtype for p in model.parameters())
    theirs = torch.amp.GradScaler("cpu")
    model = make_model(dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="FP16"):
        train_step(model, opt, theirs, *batches(1, torch.float16)[0], False)


def test_step_returns_torchs_value_and_keeps_the_outcome() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp_torch.GradScaler("cpu")
    assert scaler.last_step is None
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    assert scaler.step(opt) is None  # SGD.step() returns None, and so does torch's scaler
    result = scaler.last_step
    assert result.applied is True
    assert bool(result)
    scaler.update()
    assert scaler.last_step is result  # kept through update(), until the next step()
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    model[2].bias.grad[0] = float("nan")
    assert scaler.step(opt) is None
    result = scaler.last_step
    assert result.applied is False
    assert float(result.found_inf) == 1.0
    scaler.update()
    assert scaler.scaler.outcome.to_dict()["reason"] == "gradients"
    # step() builds its result without the class's __new__: it is the same immutable value
    same = amp_torch.StepResult(result.applied, result.found_inf)
    assert type(result) is amp_torch.StepResult
    assert result == same
    assert repr(result) == repr(same)
    assert repr(result).startswith("StepResult(applied=False, found_inf=tensor(1.")
    with pytest.raises(AttributeError):
        result.applied = True  # type: ignore[misc]
    applied, found_inf = result  # a named tuple: it unpacks
    assert (applied, found_inf) == (False, result.found_inf)
    assert result._asdict() == {"applied": False, "found_inf": result.found_inf}
    copied = pickle.loads(pickle.dumps(result))
    assert (copied.applied, float(copied.found_inf)) == (False, 1.0)


def test_scaled_loss_overflow_skips_the_step() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp_torch.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y) + torch.tensor(float("inf"))  # not differentiated
    scaler.scale(loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert scaler.step(opt) is None
    assert scaler.last_step.applied is False
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
    assert scaler.get_scale() == 2.0**15
    assert scaler.scaler.outcome.to_dict()["reason"] == "loss"
    off = amp_torch.GradScaler("cpu", check_loss=False)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y) + torch.tensor(float("inf"))
    off.scale(loss).backward()
    off.step(opt)
    assert off.last_step.applied is True


def test_multiple_optimizers_skip_independently_and_back_off_once() -> None:
    a, b = make_model(0), make_model(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ours, theirs = amp_torch.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    opt_a2, opt_b2 = torch.optim.SGD(a2.parameters(), lr=0.1), torch.optim.SGD(b2.parameters(), lr=0.1)
    x, y = batches(1)[0]
    for scaler, ma, mb, oa, ob in ((ours, a, b, opt_a, opt_b), (theirs, a2, b2, opt_a2, opt_b2)):
        oa.zero_grad()
        ob.zero_grad()
        loss = torch.nn.functional.mse_loss(ma(x), y) + torch.nn.functional.mse_loss(mb(x), y)
        scaler.scale(loss).backward()
        mb[0].bias.grad[1] = float("inf")
        scaler.step(oa)
        scaler.step(ob)
        scaler.update()
    assert ours.get_scale() == theirs.get_scale() == 2.0**15
    for p, q in zip([*a.parameters(), *b.parameters()], [*a2.parameters(), *b2.parameters()], strict=False):
        assert torch.equal(p, q)


def test_accumulation_and_clipping_after_unscale_match_torch() -> None:
    results = []
    for scaler in (amp_torch.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches(6):
            for micro in (x[:16], x[16:]):
                loss = torch.nn.functional.mse_loss(model(micro), y[:16]) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results, strict=False))


def test_sparse_gradients_match_torch() -> None:
    results = []
    for scaler in (amp_torch.GradScaler("cpu", growth_interval=1), torch.amp.GradScaler("cpu", growth_interval=1)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 8, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        for step in range(5):
            idx = torch.tensor([1, 3, 3, 7, step])
            opt.zero_grad()
            scaler.scale(emb(idx).pow(2).sum()).backward()
            if step == 2:
                emb.weight.grad = emb.weight.grad.coalesce()
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        results.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


def test_disabled_and_cuda_fallback_behave_like_torch() -> None:
    off = amp_torch.GradScaler("cpu", enabled=False)
    loss = torch.tensor(2.0)
    assert off.scale(loss) is loss
    assert off.get_scale() == 1.0
    assert off.state_dict() == {}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off.unscale_(opt)
    assert off.step(opt) is None
    assert off.last_step.applied is True
    off.update()
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = amp_torch.GradScaler()
        assert not scaler.is_enabled()


def test_call_order_errors_match_torch() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    for scaler in (amp_torch.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        with pytest.raises(AssertionError, match="_scale is None"):
            scaler.unscale_(opt)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            scaler.update()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="Closure"):
            scaler.step(opt, closure=lambda: None)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            scaler.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="pickled"):
            pickle.dumps(scaler)
        scaler.update()
        opt.zero_grad()


def test_bad_settings_raise_value_and_assertion_errors() -> None:
    for kwargs in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 2.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            amp_torch.GradScaler("cpu", **kwargs)
        with pytest.raises(AssertionError):
            amp_torch.GradScaler("cpu", **kwargs)


def test_setters_getters_update_new_scale_and_pickle() -> None:
    ours, theirs = amp_torch.GradScaler("cpu", growth_interval=3), torch.amp.GradScaler("cpu", growth_interval=3)
    model = make_model()
    for scaler in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for x, y in batches(2):
            train_step(model, opt, scaler, x, y, False)
        scaler.update(1024.0)
        scaler.set_growth_factor(4.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(3)
        for x, y in batches(4):
            train_step(model, opt, scaler, x, y, False)
    assert ours.state_dict() == theirs.state_dict()
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (4.0, 0.25, 3)
    clone = pickle.loads(pickle.dumps(ours))
    assert clone.state_dict() == ours.state_dict()


def test_a_pickle_names_only_the_public_module_and_older_pickles_load() -> None:
    import pickletools

    scaler = amp_torch.GradScaler("cpu", growth_interval=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for x, y in batches(2):
        train_step(model, opt, scaler, x, y, False)
    data = pickle.dumps(scaler)
    # what a pickle names is where it must be found again: the drop-in's public module, never the
    # private one that a reorganisation may move (pickles made before GradScaler moved to
    # ampscale._torch_scaler name ampscale.torch), beside the settings' own home
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    named = {s for s in strings if s.startswith("ampscale")}
    assert named == {"ampscale.torch", "ampscale._config"}, named
    assert {"_fresh_state", "_HostView", "GradScaler"} <= set(strings)
    # a pickle from before the device record: its state lacks ``_record``
    state = scaler.__getstate__()
    del state["_record"]
    older = amp_torch.GradScaler.__new__(amp_torch.GradScaler)
    older.__setstate__(state)
    clone = pickle.loads(pickle.dumps(older))
    for x, y in batches(2):
        train_step(model, opt, clone, x, y, False)
        train_step(model, opt, scaler, x, y, False)
    assert clone.state_dict() == scaler.state_dict()


def test_what_torch_lacks_presets_floors_hysteresis() -> None:
    scaler = amp_torch.GradScaler("cpu", preset="megatron", init_scale=4.0, min_scale=2.0, on_floor="raise")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = batches(1)[0]
    scales = []
    for _ in range(2):
        train_step(model, opt, scaler, x, y, True)
        scales.append(scaler.get_scale())
    assert scales == [4.0, 2.0]  # hysteresis 2 absorbs the first overflow, the second backs off
    with pytest.raises(ampscale.ScaleAtFloorError):  # the third overflows at the floor
        train_step(model, opt, scaler, x, y, True)
    sd = scaler.state_dict()
    assert sd["ampscale"]["preset"] == "megatron"
    assert "ampscale" not in amp_torch.GradScaler("cpu").state_dict()


def test_fused_optimizer_path_reads_nothing_on_the_host(monkeypatch) -> None:
    """With device-resident state (as on a GPU), a fused step and update never read a value."""
    monkeypatch.setattr(_torch_scaler, "_DEVICE_PATH_EVERYWHERE", True)  # the device path, on CPU tensors
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = amp_torch.GradScaler("cpu", growth_interval=2)
    x, y = batches(1)[0]

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor")

    before = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        opt.zero_grad()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", forbidden)
            m.setattr(torch.Tensor, "__bool__", forbidden)
            m.setattr(torch.Tensor, "__float__", forbidden)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 1:
                model[0].bias.grad[0] = float("inf")
            assert scaler.step(opt) is None
            result = scaler.last_step
            scaler.update()
        assert isinstance(result.applied, torch.Tensor)
        assert isinstance(scaler._rest[0], torch.Tensor)  # ampscale's counters are tensors too
    assert scaler.get_scale() == 2.0**15 * 2  # one backoff, then growth after two finite steps
    assert scaler.scaler.get_stats()["skipped_steps"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))


def test_functional_api_with_torch_tensors() -> None:
    scaler = ampscale.create_scaler(backend="torch", growth_interval=1)
    grads = {"w": torch.full((3,), 2.0**15, dtype=torch.float16), "b": torch.full((2,), 2.0**17)}
    out, finite = scaler.unscale(grads, loss=scaler.scale(torch.tensor(1.0)))
    assert out["w"] is grads["w"]
    assert torch.equal(out["w"], torch.full((3,), 0.5, dtype=torch.float16))
    assert bool(finite)
    scaler = scaler.update(finite)
    assert scaler.get_scale() == 2.0**17
    assert isinstance(scaler.state.scale, torch.Tensor)
    assert scaler.state.scale.dtype == torch.float32


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
        ),
        "cpu-host",  # CPU tensors down the drop-in's CUDA code path, the kernels' host build
    ],
)
def test_cuda_side_by_side_and_bf16_grads(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop-in against torch.amp.GradScaler, fused Adam, with injected infs: the same scale and
    the same parameters, bit for bit, every step; then bfloat16 gradients (torch's CUDA kernel
    lacks them). On a GPU (``cuda``); and (``cpu-host``) with CPU tensors taking the drop-in's
    CUDA code path (its one-launch update on the host build of the kernels, tests/fake_cuda.py),
    where torch's CPU kernels stand in for its CUDA ones."""
    from tests.fake_cuda import Launches, torch_on_host

    device = "cuda" if where == "cuda" else "cpu"
    with contextlib.ExitStack() as stack:
        if where == "cpu-host":
            stack.enter_context(torch_on_host(monkeypatch))
        ours_model, torch_model = make_model().to(device), make_model().to(device)
        ours_opt = torch.optim.Adam(ours_model.parameters(), lr=1e-2, fused=True)
        torch_opt = torch.optim.Adam(torch_model.parameters(), lr=1e-2, fused=True)
        ours, theirs = amp_torch.GradScaler(device, growth_interval=2), torch.amp.GradScaler(device, growth_interval=2)
        for step, (x, y) in enumerate(batches(12)):
            train_step(ours_model, ours_opt, ours, x.to(device), y.to(device), step in {3, 4})
            train_step(torch_model, torch_opt, theirs, x.to(device), y.to(device), step in {3, 4})
            assert ours.get_scale() == theirs.get_scale()
            assert all(
                torch.equal(a, b) for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True)
            )
        if where == "cpu-host":  # the drop-in's update() went through its one-launch kernel
            assert Launches.names().count("ampscale_update_fields") == 12
        model = make_model(dtype=torch.bfloat16).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = amp_torch.GradScaler(device)
        x, y = batches(1, torch.bfloat16)[0]
        train_step(model, opt, scaler, x.to(device), y.to(device), False)
        assert scaler.get_scale() == 2.0**16


@pytest.mark.parametrize("widened", [True, False], ids=["widened-fused", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fallback_for_dtypes_the_fused_kernel_lacks_is_bit_exact(monkeypatch, dtype, widened: bool) -> None:
    # torch's CUDA kernel has no bfloat16; the fallback must give the kernel's bits (float32
    # opmath, round to nearest even), not those of a multiply by the factor rounded to bf16.
    cpu = torch.device("cpu")
    lacking = {(cpu, dtype): False} if widened else {(cpu, dtype): False, (cpu, torch.float32): False}
    monkeypatch.setattr(torch_backend, "_fused_support", dict(lacking))
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=gen) * 300 for n in (1, 1000, 70_001)]
    expected = [(v.to(dtype).float() * torch.tensor(1 / 3, dtype=torch.float32)).to(dtype) for v in values]
    grads = [v.to(dtype) for v in values]
    scaler = ampscale.create_scaler(backend="torch", init_scale=3.0)
    out, finite = scaler.unscale(grads)
    assert bool(finite)
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    factor_rounded = (values[1].to(dtype) * torch.tensor(1 / 3, dtype=torch.float32).to(dtype)).to(dtype)
    assert not torch.equal(factor_rounded, expected[1])  # the test can tell the two apart
    grads[1][500] = float("nan")
    assert not bool(scaler.unscale(grads)[1])
    assert torch_backend._fused_support[(cpu, dtype)] is False  # the fallback really ran


# ------------------------------------------------------------------------------ CPU groups split across threads

needs_two_threads = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the split needs two cores")


@pytest.fixture
def torch_kernel_only(monkeypatch) -> None:
    """CPU tensors through torch's fused kernel (its thread split included), not ampscale's
    native kernel: the path taken where that one does not apply (tests/test_torch_native.py)."""
    monkeypatch.setattr(_torch_cpu, "_native_enabled", [False])


def _many(dtype, seed: int = 0, count: int = 600) -> list:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5000, (count,), generator=g).tolist()
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _one_kernel_call(tensors: list, inv: float) -> tuple[list, float]:
    copies = [t.clone() for t in tensors]
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(copies, found, torch.tensor(inv))
    return copies, float(found)


@needs_two_threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad_at", [None, 0, 1, 599])
def test_cpu_groups_split_across_threads_give_the_kernels_bits(torch_kernel_only, monkeypatch, dtype, bad_at) -> None:
    """Hundreds of small CPU tensors are unscaled by torch's kernel in parallel parts: the
    result is bit for bit one kernel call's, and an overflow in any part is found."""
    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    grads = _many(dtype)
    if bad_at is not None:
        grads[bad_at][len(grads[bad_at]) // 2] = float("nan") if bad_at % 2 else float("inf")
    assert _torch_cpu._split_ways(grads, dtype) == 2
    expected, found = _one_kernel_call(grads, 1 / 1024)
    scaler = ampscale.create_scaler(backend="torch", init_scale=1024.0)
    scaler.unscale(grads[:1])  # the first call learns that the kernel has this dtype
    grads[0].mul_(1024)  # undo it exactly (a power of two)
    out, finite = scaler.unscale(grads)
    assert bool(finite) == (found == 0.0) == (bad_at is None)
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_two_threads
def test_split_with_sparse_gradients_takes_the_sparse_path_for_their_part(torch_kernel_only, monkeypatch) -> None:
    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    dense = _many(torch.float32, count=300)
    sparse = torch.sparse_coo_tensor([[1, 3, 3]], [2.0, 4.0, 8.0], (10,), check_invariants=True)  # uncoalesced
    grads = [*dense, sparse]
    expected = [t.clone() for t in dense]
    torch._amp_foreach_non_finite_check_and_unscale_(expected, torch.zeros(()), torch.tensor(0.5))
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    scaler.unscale(dense[:1])
    dense[0].mul_(2)
    out, finite = scaler.unscale(grads)
    assert bool(finite)
    assert all(torch.equal(a, b) for a, b in zip(out[:-1], expected, strict=True))
    assert out[-1].coalesce().values().tolist() == [1.0, 6.0]


@needs_two_threads
def test_split_never_leaves_work_half_done_on_uncoalesced_float16(torch_kernel_only, monkeypatch) -> None:
    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    dense = _many(torch.float16, count=300)
    values = torch.tensor([1.0, 2.0], dtype=torch.float16)
    sparse = torch.sparse_coo_tensor([[1, 1]], values, (4,), check_invariants=True)  # uncoalesced
    before = [t.clone() for t in dense]
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    with pytest.raises(torch_backend.UncoalescedSparseError):
        scaler.unscale([*dense, sparse])
    assert all(torch.equal(a, b) for a, b in zip(dense, before, strict=True))


def test_no_split_where_worker_threads_would_lose_torch_state(monkeypatch) -> None:
    """Modes and inference mode are thread-local in torch: with one active the group stays in
    the calling thread."""
    from torch.overrides import TorchFunctionMode

    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_torch_cpu.os, "cpu_count", lambda: 2)
    grads = _many(torch.float32, count=300)
    assert _torch_cpu._split_ways(grads, torch.float32) == 2
    with TorchFunctionMode():
        assert _torch_cpu._split_ways(grads, torch.float32) == 1
    with torch.inference_mode():
        assert _torch_cpu._split_ways(grads, torch.float32) == 1
    assert _torch_cpu._split_ways(grads[:100], torch.float32) == 1  # too few to pay off
    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 1)  # the user's setting
    assert _torch_cpu._split_ways(grads, torch.float32) == 1


class _Marked(torch.Tensor):
    """A tensor subclass: its __torch_function__ would run in the worker thread."""


@needs_two_threads
def test_no_split_for_tensor_subclasses(torch_kernel_only, monkeypatch) -> None:
    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_torch_cpu.os, "cpu_count", lambda: 2)
    used = []
    real_pool = _torch_cpu._split_pool
    monkeypatch.setattr(_torch_cpu, "_split_pool", lambda workers: used.append(workers) or real_pool(workers))
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    scaler.unscale([torch.ones(1)])  # the first call learns that the kernel has float32

    def fresh() -> list:
        return [torch.full((64,), 2.0) for _ in range(300)]

    out, finite = scaler.unscale(fresh())
    assert bool(finite)
    assert used == [1]  # a plain list is split
    assert all(torch.equal(t, torch.full((64,), 1.0)) for t in out)
    one_marked = fresh()
    one_marked[150] = one_marked[150].as_subclass(_Marked)
    for grads in (one_marked, tuple(t.as_subclass(_Marked) for t in fresh())):
        used.clear()
        out, finite = scaler.unscale(grads)
        assert bool(finite)
        assert used == []  # one subclass anywhere keeps the work in this thread
        assert all(torch.equal(t.as_subclass(torch.Tensor), torch.full((64,), 1.0)) for t in out)


def _unscale_in_child(queue) -> None:
    grads = [torch.full((100,), 4.0) for _ in range(300)]
    out, finite = ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(grads)
    queue.put((bool(finite), sum(float(t.sum()) for t in out)))


@needs_two_threads
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child touches no JAX
def test_split_still_works_in_a_forked_child(torch_kernel_only, monkeypatch) -> None:
    """Threads do not survive fork: a child makes its own pool instead of waiting forever."""
    import multiprocessing

    monkeypatch.setattr(torch_backend.torch, "get_num_threads", lambda: 2)
    grads = [torch.full((100,), 4.0) for _ in range(300)]
    ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(grads)  # the parent's pool
    ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(grads)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_unscale_in_child, args=(queue,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (True, 300 * 100.0)


# ------------------------------------------------------------------------- torch's private surface, on both classes

BOTH = pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, amp_torch.GradScaler], ids=["torch", "ampscale"])


def _one_backward(model, scaler, poisoned: bool = False) -> None:
    x, y = batches(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if poisoned:
        model[0].weight.grad[1, 1] = float("inf")


@BOTH
def test_scale_and_growth_tracker_are_tensors_updated_in_place(scaler_class) -> None:
    scaler = scaler_class("cpu", init_scale=1024.0, growth_interval=2)
    assert scaler._enabled
    assert scaler._scale is None
    assert scaler._growth_tracker is None
    assert (scaler._init_scale, scaler._init_growth_tracker) == (1024.0, 0)
    assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (2.0, 0.5, 2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_backward(model, scaler)
    scale, tracker = scaler._scale, scaler._growth_tracker
    assert (scale.dtype, scale.shape, tracker.dtype, tracker.shape) == (torch.float32, (), torch.int32, ())
    assert scaler._get_scale_async() is scale
    seen = []
    for poisoned in (False, False, True, False):
        if seen:
            opt.zero_grad()
            _one_backward(model, scaler, poisoned)
        scaler.step(opt)
        scaler.update()
        assert scaler._scale is scale  # the same tensors, updated in place
        assert scaler._growth_tracker is tracker
        seen.append((scale.item(), tracker.item()))
    assert seen == [(1024.0, 1), (2048.0, 0), (1024.0, 0), (1024.0, 1)]


def _write_the_state_tensors(scaler_class) -> list:
    scaler = scaler_class("cpu", init_scale=1024.0, growth_interval=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    scaler._scale.fill_(8.0)  # in place
    loss = torch.tensor(3.0, requires_grad=True)
    assert scaler.scale(loss).item() == 24.0
    scaler._growth_tracker.fill_(2)  # one finite step from growing
    opt.zero_grad()
    _one_backward(model, scaler)
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler._get_growth_tracker()) == (16.0, 0)
    scaler._scale = torch.full((), 4.0)  # assigned
    scaler._growth_tracker = torch.full((), 1, dtype=torch.int32)
    assert scaler.scale(loss).item() == 12.0
    opt.zero_grad()
    _one_backward(model, scaler, poisoned=True)
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler._get_growth_tracker()) == (2.0, 0)
    assert scaler.state_dict()["scale"] == 2.0
    scaler._scale.set_(torch.full((), 64.0))  # new memory under the same tensor objects
    scaler._growth_tracker.set_(torch.full((), 2, dtype=torch.int32))
    opt.zero_grad()
    _one_backward(model, scaler)
    grads += [p.grad.clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler._get_growth_tracker()) == (128.0, 0)
    return grads


def test_writing_the_state_tensors_changes_the_scale() -> None:
    """In place or by assignment, as code in the wild does; unscaled by the written scale."""
    ours = _write_the_state_tensors(amp_torch.GradScaler)
    theirs = _write_the_state_tensors(torch.amp.GradScaler)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@BOTH
def test_init_values_set_before_the_first_scale_are_used(scaler_class) -> None:
    scaler = scaler_class("cpu")
    scaler._init_scale = 512.0
    scaler._init_growth_tracker = 3
    assert scaler.get_scale() == 512.0
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert (scaler._scale.item(), scaler._growth_tracker.item()) == (512.0, 3)
    with pytest.raises(AssertionError, match="_growth_tracker initialized before _scale"):
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert scaler.scale(torch.tensor(2.0)).item() == 1024.0


@BOTH
def test_settings_written_as_attributes_take_effect(scaler_class) -> None:
    scaler = scaler_class("cpu", init_scale=8.0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler._growth_interval = 1  # as torch's setters do, and code that skips them
    scaler._growth_factor = 4.0
    scaler._backoff_factor = 0.25
    for poisoned, expected in ((False, 32.0), (True, 8.0)):
        opt.zero_grad()
        _one_backward(model, scaler, poisoned)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == expected
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 1)


def test_settings_written_as_attributes_are_checked() -> None:
    scaler = amp_torch.GradScaler("cpu")
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler._backoff_factor = 0.0
    assert scaler.get_backoff_factor() == 0.5  # unchanged
    off = amp_torch.GradScaler("cpu", enabled=False)
    with pytest.raises(AttributeError, match="_growth_factor"):
        off._growth_factor  # torch's disabled scaler has no settings
    off._growth_factor = -1.0  # stored unchecked and unused, as torch's
    assert off.get_growth_factor() == -1.0


@BOTH
def test_per_optimizer_states_are_keyed_by_id(scaler_class) -> None:
    from torch.amp.grad_scaler import OptState

    scaler = scaler_class("cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_backward(model, scaler)
    scaler.unscale_(opt)
    states = scaler._per_optimizer_states
    assert list(states) == [id(opt)]
    assert states[id(opt)]["stage"] is OptState.UNSCALED
    found = scaler._found_inf_per_device(opt)
    assert found is states[id(opt)]["found_inf_per_device"]
    assert {device: flag.item() for device, flag in found.items()} == {torch.device("cpu"): 0.0}
    scaler.step(opt)
    assert states[id(opt)]["stage"] is OptState.STEPPED
    scaler.update()
    assert scaler._per_optimizer_states is not states  # a new dict; the old one is left as it was
    assert len(scaler._per_optimizer_states) == 0
    assert states[id(opt)]["stage"] is OptState.STEPPED


@BOTH
def test_flags_changed_in_place_after_unscale_are_honoured(scaler_class) -> None:
    """What a distributed wrapper does: all-reduce the flags in place between unscale_ and step."""
    scaler = scaler_class("cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    _one_backward(model, scaler)
    scaler.unscale_(opt)
    for flag in scaler._found_inf_per_device(opt).values():
        flag.fill_(1.0)  # another rank overflowed
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**15


@BOTH
def test_check_inf_per_device_records_without_unscaling(scaler_class) -> None:
    scaler = scaler_class("cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_backward(model, scaler, poisoned=True)
    grads = [p.grad.clone() for p in model.parameters()]
    found = scaler._check_inf_per_device(opt)
    assert {device: flag.item() for device, flag in found.items()} == {torch.device("cpu"): 1.0}
    assert scaler._found_inf_per_device(opt) is found
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)  # checked, not unscaled


@BOTH
def test_overridden_unscale_grads_and_maybe_opt_step_are_called(scaler_class) -> None:
    """FSDP's ShardedGradScaler overrides _unscale_grads_; torch_xla's, _maybe_opt_step."""
    calls = []

    class Recording(scaler_class):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls.append(("unscale", inv_scale.item(), found_inf.item(), allow_fp16))
            found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            for flag in found.values():
                flag.fill_(1.0)  # pretend an overflow somewhere else
            return found

        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            calls.append(("maybe_step", sum(v.item() for v in optimizer_state["found_inf_per_device"].values())))
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    scaler = Recording("cpu", init_scale=4.0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    _one_backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    # torch's unscale_ refuses float16 gradients (allow_fp16=False); the drop-in accepts them
    assert calls == [("unscale", 0.25, 0.0, scaler_class is amp_torch.GradScaler), ("maybe_step", 1.0)]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0
    opt.zero_grad()
    _one_backward(model, scaler)
    calls.clear()
    scaler._check_inf_per_device(opt)
    assert calls == [("unscale", 1.0, 0.0, True)]


# ------------------------------------------------------------------------------ getters and settings as torch's


@BOTH
def test_getters_return_what_was_given(scaler_class) -> None:
    scaler = scaler_class("cpu", init_scale=1024, growth_factor=16, backoff_factor=0.25, growth_interval=10)
    got = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert got == (16, 0.25, 10)
    assert type(got[0]) is int
    assert scaler.get_scale() == 1024
    saved = scaler.state_dict()
    assert type(saved["growth_factor"]) is int
    scaler.set_growth_factor(4)
    assert type(scaler.get_growth_factor()) is int
    assert scaler.state_dict()["growth_factor"] == 4


def test_growth_interval_below_one_never_grows_as_in_torch() -> None:
    with pytest.warns(ampscale.AmpscaleWarning, match="never grows"):
        ours = amp_torch.GradScaler("cpu", init_scale=8.0, growth_interval=0)
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=0)
    models = make_model(), make_model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    for step, (x, y) in enumerate(batches(5)):
        for scaler, model, opt in zip((ours, theirs), models, opts, strict=True):
            train_step(model, opt, scaler, x, y, step == 3)
        assert ours.get_scale() == theirs.get_scale()
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
        assert ours.state_dict() == theirs.state_dict()
    assert ours.get_scale() == 4.0
    assert ours.get_growth_interval() == 0
    with pytest.warns(ampscale.AmpscaleWarning, match="never grows"):
        ours.set_growth_interval(-5)
    assert ours.get_growth_interval() == -5
    reloaded = amp_torch.GradScaler("cpu")
    with pytest.warns(ampscale.AmpscaleWarning, match="never grows"):
        reloaded.load_state_dict(theirs.state_dict())
    assert reloaded.state_dict() == theirs.state_dict()


# ------------------------------------------------------------------------------ the loss check holds nothing


def _tensors_held(value, seen=None) -> int:
    """How many tensors an object's attributes reach (through dicts, lists and tuples)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(_tensors_held(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensors_held(v, seen) for v in value)
    return 0


def test_the_loss_check_keeps_no_reference() -> None:
    import weakref

    scaler = amp_torch.GradScaler("cpu")
    model = make_model()
    x, y = batches(1)[0]
    scaled = scaler.scale(torch.nn.functional.mse_loss(model(x), y))
    held = _tensors_held(vars(scaler))
    ref = weakref.ref(scaled)
    del scaled
    assert ref() is None
    for _ in range(1000):  # scaled, never differentiated (logging, say)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y))
    assert _tensors_held(vars(scaler)) == held


def test_the_loss_rule_which_scale_calls_count_for_which_step() -> None:
    """A non-finite scaled output counts for the optimizers unscaled after it, until update();
    one scaled under no_grad never counts."""
    a, b = make_model(0), make_model(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = amp_torch.GradScaler("cpu")
    x, y = batches(1)[0]
    with torch.no_grad():
        scaler.scale(torch.tensor(float("inf")))  # for logging: never counts
    scaler.scale(torch.nn.functional.mse_loss(a(x), y)).backward()
    scaler.step(opt_a)
    assert scaler.last_step.applied is True  # stepped before the bad loss
    bad = torch.nn.functional.mse_loss(b(x), y) + torch.tensor(float("inf"))
    scaler.scale(bad).backward()
    scaler.step(opt_b)
    assert scaler.last_step.applied is False
    scaler.update()
    assert scaler.get_scale() == 2.0**15  # one backoff
    assert scaler.scaler.outcome.to_dict()["reason"] == "loss"
    for opt, model in ((opt_a, a), (opt_b, b)):  # the next iteration starts clean
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        assert scaler.last_step.applied is True
    scaler.update()


def _count_passes(monkeypatch) -> list[float]:
    """Record the inverse scale of every run of the fused kernel group (1.0: a check-only pass)."""
    passes: list[float] = []
    original = torch_backend.TorchBackend._check_and_unscale_group

    def counting(self, leaves, flag, inv, device, dtype, *rest):
        passes.append(float(inv))
        return original(self, leaves, flag, inv, device, dtype, *rest)

    monkeypatch.setattr(torch_backend.TorchBackend, "_check_and_unscale_group", counting)
    return passes


@pytest.mark.parametrize("state", ["host", "device"])
def test_drop_in_checks_what_it_wrote_only_below_a_scale_of_one(torch_kernel_only, monkeypatch, state: str) -> None:
    """At scales >= 1 one pass per step (the inputs' check is the outputs'); below 1 a second,
    check-only pass catches a finite float16 gradient that overflows when unscaled. On an
    accelerator (``state="device"``, run on CPU tensors) the scale is not read each step: a
    host bound, lowered by one backoff per update, decides, and one read refreshes it."""
    if state == "device":
        monkeypatch.setattr(_torch_scaler, "_DEVICE_PATH_EVERYWHERE", True)
    passes = _count_passes(monkeypatch)
    reads: list[int] = []
    item = torch.Tensor.item

    def counting_item(self):
        reads.append(1)
        return item(self)

    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = torch.optim.SGD([weight], lr=0.0)
    scaler = amp_torch.GradScaler("cpu", init_scale=4.0, growth_interval=10**6)
    scaler.scale(torch.ones((), requires_grad=True))
    for step in range(4):  # finite steps at scale 4: the bound reaches 4 / 2**3 < 1 at step 3
        weight.grad = torch.full((4,), 3.0, dtype=torch.float16)
        passes.clear()
        reads.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", counting_item)
            scaler.unscale_(opt)
        assert passes == [0.25], (step, passes)
        if state == "device":
            assert len(reads) == (1 if step in (0, 3) else 0), (step, reads)  # first use, then bound < 1
        scaler.step(opt)
        scaler.update()
    scaler.update(0.5)  # below 1: the bound is void (the scale tensor was written)
    weight.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # finite; x2 overflows float16
    passes.clear()
    scaler.unscale_(opt)
    assert passes == [2.0, 1.0]  # the unscale, then the check of what it wrote
    assert scaler._found_inf_per_device(opt)[torch.device("cpu")].item() == 1.0
    assert torch.isinf(weight.grad).all()
    scaler.step(opt)  # skipped: the weights stay finite
    scaler.update()
    assert torch.equal(weight.detach(), torch.zeros(4, dtype=torch.float16))


def test_drop_in_fused_optimizer_is_checked_once_without_a_read(torch_kernel_only, monkeypatch) -> None:
    """A fused optimizer unscales the gradients itself (as with torch's scaler): the scaler only
    checks them, one pass, no second one and no host read, even below a scale of 1."""
    monkeypatch.setattr(_torch_scaler, "_DEVICE_PATH_EVERYWHERE", True)
    passes = _count_passes(monkeypatch)
    weight = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([weight], lr=1e-3, fused=True)
    scaler = amp_torch.GradScaler("cpu", init_scale=2.0, growth_interval=10**6)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor")

    for step in range(3):
        opt.zero_grad()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", forbidden)
            scaler.scale((weight * 1.0).sum()).backward()
            passes.clear()
            scaler.step(opt)
            scaler.update()
        assert passes == [1.0], (step, passes)  # the check of the inputs alone: Adam unscales them
