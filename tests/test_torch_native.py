"""torch on the CPU through ampscale's own native kernel, bit for bit torch's fused kernel.

CPU gradients of the torch backend (the functional API and the ``GradScaler`` drop-in) are
checked and unscaled by the NumPy backend's kernel (``ampscale/_native/cpu``), reading the
tensors' memory through torch's DLPack C exchange API. Compared here with torch's own
``_amp_foreach_non_finite_check_and_unscale_``:

* every float16 and bfloat16 bit pattern, and drawn float32 / float64 bit patterns (infs,
  nans, subnormals, signed zeros), for inverse scales below, at and above 1, at alignments
  that put each value in the vector body and in the tail, split over threads: every value that
  is not a NaN has torch's bits, NaNs stay NaNs (torch's own NaN bits differ between its CPU
  vector widths and between the body and the tail of a tensor), and the flag is the backend's
  (an inf or nan in what is written);
* an inf or nan anywhere (first, middle, last element; first, middle, last tensor);
* the guarantees the torch backend gives: refusals before any write, shared memory, sparse,
  non-contiguous and subclassed tensors, requires_grad and version counters, inference mode,
  torch function / dispatch modes and ``torch.compile`` (torch's kernel runs: torch must see
  the op), threads (``torch.set_num_threads``), fork.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ampscale  # noqa: E402
import ampscale.torch as amp_torch  # noqa: E402
from ampscale.backends import _torch_cpu  # noqa: E402
from ampscale.backends import torch as torch_backend  # noqa: E402
from ampscale.backends._base import AliasedGradientsError  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch_backend.native_cpu_kernel() or _torch_cpu._EXCHANGE_API is None,
    reason="the native kernel is not built, or this torch has no DLPack exchange API",
)

UINT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
INVERSES = (1.0, 0.5, 2.0**-16, 2.0**-24, 1 / 3, 3.0, 2.0**16, float(np.float32(2.0**-140)))


class NativeSpy:
    """Counts the native kernel's runs (and torch's fused kernel's) while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.native = 0
        self.torch = 0
        real = _torch_cpu._native
        spy = self

        class Proxy:
            def __getattr__(self, name):
                return getattr(real, name)

            def check_and_unscale_tensors(self, *args):
                result = real.check_and_unscale_tensors(*args)
                if result is not None:
                    spy.native += 1
                return result

        fused = torch._amp_foreach_non_finite_check_and_unscale_

        def counting_fused(*args, **kwargs):
            spy.torch += 1
            return fused(*args, **kwargs)

        monkeypatch.setattr(_torch_cpu, "_native", Proxy())
        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting_fused)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> NativeSpy:
    return NativeSpy(monkeypatch)


def _torch_kernel(tensors: list, inv: float) -> tuple[list, bool]:
    """torch's own kernel on copies, and the backend's flag: no inf or nan in what is written."""
    copies = [t.clone() for t in tensors]
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(copies, found, torch.tensor(inv))
    finite = found.item() == 0 and all(bool(torch.isfinite(c).all()) for c in copies)
    return copies, finite


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """torch's bits for every value that is not a NaN; NaN exactly where torch has NaN."""
    got_nan, want_nan = torch.isnan(got), torch.isnan(want)
    assert torch.equal(got_nan, want_nan)
    keep = ~want_nan
    bits = UINT[got.dtype]
    mismatch = (got.view(bits) != want.view(bits)) & keep
    if mismatch.any():
        index = int(mismatch.nonzero()[0, 0])
        raise AssertionError(
            f"element {index}: {got[index].item()!r} ({int(got.view(bits)[index])}) where torch's kernel "
            f"writes {want[index].item()!r} ({int(want.view(bits)[index])})"
        )


def _every_pattern(dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _drawn(dtype, count: int = 1 << 16, seed: int = 0) -> torch.Tensor:
    """Uniform bit patterns (about 0.4% inf/nan for float32), plus the special values."""
    rng = np.random.default_rng(seed)
    if dtype == torch.float32:
        bits = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        bits = rng.integers(0, 2**63, count, dtype=np.int64).view(np.float64) * rng.choice([-1.0, 1.0], count)
    values = torch.from_numpy(bits.copy())
    info = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, float("inf"), -float("inf")],
        dtype=dtype,
    )
    return torch.cat([special, values, torch.tensor([float("nan")], dtype=dtype)])


def _pieces(values: torch.Tensor, offsets: tuple[int, ...] = (0, 1, 7, 31, 63)) -> list[torch.Tensor]:
    """The values in several tensors, each shifted so that every value is seen both in a vector
    body and in a tail; enough elements in all that the kernel splits them over threads."""
    out = []
    for offset in offsets:
        out.append(torch.cat([torch.ones(offset, dtype=values.dtype), values]).clone())
        out.append(values[offset:].clone())
    return out


@pytest.mark.parametrize("inv", INVERSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_every_half_precision_pattern_matches_torchs_kernel(spy: NativeSpy, dtype, inv: float) -> None:
    grads = _pieces(_every_pattern(dtype))
    assert sum(t.numel() for t in grads) > _torch_cpu._native.PARALLEL_THRESHOLD  # split over threads
    expected, want_finite = _torch_kernel(grads, inv)
    finite = torch_backend.BACKEND.check_and_unscale(grads, inv)[1]
    assert spy.native == 1
    assert bool(finite) == want_finite
    for got, want in zip(grads, expected, strict=True):
        _assert_same_bits(got, want)


@pytest.mark.parametrize("inv", INVERSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_drawn_float32_and_float64_patterns_match_torchs_kernel(spy: NativeSpy, dtype, inv: float) -> None:
    grads = _pieces(_drawn(dtype))
    expected, want_finite = _torch_kernel(grads, inv)
    finite = torch_backend.BACKEND.check_and_unscale(grads, inv)[1]
    assert spy.native == 1
    assert bool(finite) == want_finite
    for got, want in zip(grads, expected, strict=True):
        _assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_an_inf_or_nan_anywhere_is_found(spy: NativeSpy, dtype, bad: float) -> None:
    count = 0
    for tensor in (0, 17, 39):
        for element in (0, 500, 999):
            grads = [torch.full((1000,), 0.5, dtype=dtype) for _ in range(40)]
            grads[tensor][element] = bad
            scaler = ampscale.create_scaler(backend="torch", init_scale=4.0)
            _, finite = scaler.unscale(grads)
            count += 1
            assert not bool(finite), (tensor, element)
            other = 1 if tensor == 0 else 0
            assert torch.equal(grads[other], torch.full((1000,), 0.125, dtype=dtype))  # the rest unscaled
    assert spy.native == count
    _, finite = ampscale.create_scaler(backend="torch").unscale([torch.full((1000,), 0.5, dtype=dtype)] * 2)
    assert bool(finite)


def test_a_finite_value_that_overflows_when_unscaled_is_flagged_in_the_same_pass(spy: NativeSpy) -> None:
    """Below a scale of 1 the value written is what the flag tests: one pass, not two."""
    grads = [torch.full((8,), 60000.0, dtype=torch.float16), torch.ones(8, dtype=torch.float16)]
    scaler = ampscale.create_scaler(backend="torch", init_scale=0.5)
    _, finite = scaler.unscale(grads)
    assert not bool(finite)
    assert torch.isinf(grads[0]).all()
    assert (spy.native, spy.torch) == (1, 0)


def test_the_drop_in_grad_scaler_unscales_through_it(spy: NativeSpy) -> None:
    """``ampscale.torch.GradScaler`` on CPU gradients: ampscale's kernel, torch's numbers."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    scalers = [amp_torch.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for step in range(3):
        for model, scaler, opt in zip(models, scalers, opts, strict=True):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 1:
                model[0].weight.grad[3, 3] = float("inf")
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    assert spy.native == 3
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9


def test_memory_is_checked_before_any_change(spy: NativeSpy) -> None:
    base = torch.full((100,), 4.0)
    twice = [base, base, torch.full((10,), 4.0)]  # the same tensor twice: unscaled once
    _, finite = ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(twice)
    assert bool(finite)
    assert torch.equal(base, torch.ones(100))
    overlapping = [torch.full((10,), 4.0), base[10:60], base[50:90]]  # partial overlap: refused
    before = [t.clone() for t in overlapping]
    with pytest.raises(AliasedGradientsError, match=r"gradients \[1\] \(in tree order\) and \[2\] \(in tree order\)"):
        ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(overlapping)
    assert all(torch.equal(a, b) for a, b in zip(overlapping, before, strict=True))
    # a check-only call reads shared memory as it is
    assert bool(ampscale.all_finite(overlapping))
    mixed = [torch.full((10,), 4.0), torch.ones(3, dtype=torch.int32)]
    with pytest.raises(TypeError, match="int32"):
        ampscale.create_scaler(backend="torch", init_scale=4.0).unscale(mixed)
    assert torch.equal(mixed[0], torch.full((10,), 4.0))


def test_what_is_not_plain_dense_memory_goes_to_torchs_kernel(spy: NativeSpy) -> None:
    """Non-contiguous and subclassed tensors: torch's kernel, the same numbers; a sparse one's
    values (a dense tensor) may take either."""

    class Marked(torch.Tensor):
        pass

    cases = {
        "non-contiguous": [torch.full((4, 6), 8.0).t(), torch.full((5,), 8.0)],
        "sparse": [torch.full((5,), 8.0), torch.sparse_coo_tensor([[0, 2]], [8.0, 8.0], (4,)).coalesce()],
        "subclass": [torch.full((5,), 8.0).as_subclass(Marked), torch.full((5,), 8.0)],
    }
    for name, grads in cases.items():
        spy.native = spy.torch = 0
        out, finite = ampscale.create_scaler(backend="torch", init_scale=8.0).unscale(grads)
        assert bool(finite), name
        if name != "sparse":
            assert spy.native == 0, name
            assert spy.torch >= 1, name
        for t in out:
            dense = t.to_dense() if t.is_sparse else t.as_subclass(torch.Tensor)
            assert torch.equal(dense[dense != 0], torch.ones_like(dense[dense != 0])), name


def test_requires_grad_inference_mode_shared_memory_and_version_counters(spy: NativeSpy) -> None:
    """As torch's kernel: a leaf that requires grad is unscaled in place, the version counter
    is not bumped (torch's kernel does not bump it either), inference tensors and shared memory
    are plain memory."""
    leaf = torch.full((50,), 2.0, requires_grad=True)
    shared = torch.full((50,), 2.0).share_memory_()
    with torch.inference_mode():
        inference = torch.full((50,), 2.0)
    reference = [t.detach().clone() for t in (leaf, shared, inference)]
    torch._amp_foreach_non_finite_check_and_unscale_(reference, torch.zeros(()), torch.tensor(0.5))
    versions = [leaf._version, shared._version]
    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    _, finite = scaler.unscale([leaf, shared, inference])
    assert bool(finite)
    for got, want in zip((leaf, shared, inference), reference, strict=True):
        assert torch.equal(got.detach(), want)
    assert [leaf._version, shared._version] == versions
    assert leaf.requires_grad
    with torch.inference_mode():
        grads = [torch.full((50,), 2.0) for _ in range(3)]
        _, finite = scaler.unscale(grads)
    assert bool(finite)
    assert all(torch.equal(g, torch.ones(50)) for g in grads)
    assert spy.native == 2


def test_torch_sees_the_op_under_function_and_dispatch_modes_and_functorch(spy: NativeSpy) -> None:
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    scaler = ampscale.create_scaler(backend="torch", init_scale=2.0)
    for mode in (Functions, Dispatch):
        seen.clear()
        grads = [torch.full((10,), 2.0) for _ in range(3)]
        with mode():
            _, finite = scaler.unscale(grads)
        assert bool(finite)
        assert any("amp_foreach_non_finite_check_and_unscale" in name for name in seen), mode
        assert all(torch.equal(g, torch.ones(10)) for g in grads)
    assert spy.native == 0
    grads = [torch.full((10,), 2.0) for _ in range(3)]

    def functional(x):  # functionalization (a functorch transform): torch must see the op
        return scaler.unscale([x, *grads])[1]

    assert bool(torch.func.functionalize(functional)(torch.full((10,), 2.0)))
    assert spy.native == 0


def test_torch_compile_traces_torchs_kernel() -> None:
    scaler = ampscale.create_scaler(backend="torch", init_scale=4.0)

    def step(grads):
        return scaler.unscale(grads)

    compiled = torch.compile(step, backend="eager")
    grads = [torch.full((16,), 4.0) for _ in range(3)]
    out, finite = compiled(grads)
    assert bool(finite)
    assert all(torch.equal(g, torch.ones(16)) for g in out)


def test_the_native_kernel_follows_torchs_thread_setting(spy: NativeSpy, monkeypatch) -> None:
    seen = []
    real = _torch_cpu._native_threads
    monkeypatch.setattr(_torch_cpu, "_native_threads", lambda: seen.append(real()) or seen[-1])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        grads = [torch.full((1 << 16,), 2.0) for _ in range(20)]
        _, finite = ampscale.create_scaler(backend="torch", init_scale=2.0).unscale(grads)
    finally:
        torch.set_num_threads(previous)
    assert bool(finite)
    assert seen == [1]
    assert all(torch.equal(g, torch.ones(1 << 16)) for g in grads)


def test_it_can_be_turned_off(spy: NativeSpy) -> None:
    assert torch_backend.native_cpu_kernel() is True
    try:
        assert torch_backend.native_cpu_kernel(False) is False
        ampscale.create_scaler(backend="torch", init_scale=2.0).unscale([torch.ones(4), torch.ones(4)])
        assert (spy.native, spy.torch) == (0, 1)
    finally:
        torch_backend.native_cpu_kernel(True)
    with pytest.raises(TypeError, match="must be a bool or None; got 'no'"):
        torch_backend.native_cpu_kernel("no")  # type: ignore[arg-type]
    script = "import torch, ampscale\nfrom ampscale.backends import torch as tb\nprint(tb.native_cpu_kernel())\n"
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "AMPSCALE_TORCH_NATIVE": "0"},
        timeout=120,
        check=True,
    )
    assert run.stdout.strip() == "False"


def test_views_without_a_plain_layout_are_unscaled_right() -> None:
    """A negated view (torch's kernel refuses it) and a slice of a larger tensor."""
    base = torch.tensor([2.0, -4.0, 8.0, 16.0])
    negated = torch._neg_view(base)
    window = torch.full((10,), 4.0)[3:7]
    _, finite = ampscale.create_scaler(backend="torch", init_scale=2.0).unscale([negated, window])
    assert bool(finite)
    assert negated.tolist() == [-1.0, 2.0, -4.0, -8.0]
    assert window.tolist() == [2.0] * 4
