"""``Scaler.step`` and in-place updates: refused before anything changes, and a correct path.

On a device ``step`` computes the update before it knows whether the step overflowed and
keeps the old arrays where it did, so an ``update_fn`` that writes in place (``p -= lr * g``, the
usual CuPy habit) would already hold the overflowed step: through the array-API backend a
skipped step turned the parameters into -inf, and on torch's CUDA path the refusal came after
the write. Now the first time ``step`` sees an ``update_fn`` it runs it once on copies of the
parameters, optimizer state and gradients, watched (NumPy-backed arrays refuse the write itself;
torch's version counters see it; CuPy, which can see neither, compares the copies bit for bit
and refuses returned arrays): such an ``update_fn`` is refused before anything changes. The
verdict is kept per function; every real call is watched too. The flag-aware path,
``step(..., in_place=True)`` with ``ampscale.masked_add_`` / ``masked_copy_``, updates in place on
finite steps only, with no host sync. CuPy's class runs here against NumPy-backed stand-ins for
the ``cupy`` module (its arrays, streams, kernels' host build and an NCCL communicator), and
torch's CUDA path on CPU tensors; only a GPU runs the real ones.
"""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import sys
import types

import numpy as np
import pytest

import ampscale
from ampscale.backends import array_api as array_api_backend

MUTABLE = ("numpy", "array_api_strict", "torch", "torch-cuda", "cupy")


@pytest.fixture
def mfw(fw):
    if fw.name not in MUTABLE:
        pytest.skip(f"{fw.name} arrays cannot be written in place")
    return fw


def _in_place_sgd(params, grads, state):
    for p, g in zip(params, grads, strict=True):
        p -= 0.5 * g
    return params, state


def _sgd(params, grads, state):
    return [p - 0.5 * g for p, g in zip(params, grads, strict=True)], state


def _values(fw, tree) -> list[bytes]:
    return [fw.to_numpy(x).tobytes() for x in tree]


# ------------------------------------------------------------------------------ refused


@pytest.mark.parametrize("overflow", [False, True])
def test_an_update_that_writes_in_place_is_refused_before_anything_changes(mfw, overflow: bool) -> None:
    """Refused on a finite step and on an overflowing one (where a host backend would not even
    call it), on its first run, on copies: the parameters, the gradients (still scaled) and the
    scaler are as they were, bit for bit. NumPy-backed arrays refuse the write itself; torch's
    version counters and CuPy's bit comparison name the leaves."""
    scaler = ampscale.create_scaler(backend=mfw.backend, init_scale=4.0)
    params = [mfw.array([1.0, 2.0]), mfw.array([3.0])]
    grads = [mfw.array([4.0, 8.0]), mfw.array([float("inf") if overflow else 4.0])]
    before = _values(mfw, params + grads)
    with pytest.raises(ampscale.InPlaceUpdateError, match="in_place=True") as caught:
        scaler.step(_in_place_sgd, params, grads, ())
    assert "nothing was changed" in str(caught.value)
    if mfw.name in ("numpy", "array_api_strict"):
        assert "wrote into one of" in str(caught.value)
    else:
        assert "wrote into params[0], params[1] in place" in str(caught.value)
    assert _values(mfw, params + grads) == before
    assert scaler.get_stats()["steps"] == 0


def test_the_array_api_overflow_that_turned_parameters_into_minus_inf_is_refused() -> None:
    """The reported failure: through the array-API backend an in-place update on a skipped
    step wrote -inf into the parameters. It is refused now, and the parameters are intact."""
    xp = pytest.importorskip("array_api_strict")
    scaler = ampscale.create_scaler(backend=xp, init_scale=2.0)
    params = [xp.asarray([1.0, -2.0])]
    with pytest.raises(ampscale.InPlaceUpdateError):
        scaler.step(_in_place_sgd, params, [xp.asarray([float("inf"), 1.0])], ())
    assert np.asarray(params[0]).tolist() == [1.0, -2.0]


def test_writes_into_the_optimizer_state_are_refused_too(mfw) -> None:
    def momentum(params, grads, state):
        (velocity,) = state
        velocity *= 0.9  # in place
        return [p - v for p, v in zip(params, [velocity], strict=True)], (velocity,)

    scaler = ampscale.create_scaler(backend=mfw.backend, init_scale=1.0)
    with pytest.raises(ampscale.InPlaceUpdateError, match="opt_state"):
        scaler.step(momentum, [mfw.array([1.0])], [mfw.array([1.0])], (mfw.array([0.5]),))


def test_a_no_op_update_is_fine_where_writes_are_seen(mfw) -> None:
    """Returning the arrays it was given, untouched, is harmless, and allowed where the backend
    sees writes (NumPy, NumPy-backed namespaces, torch); CuPy cannot tell it from an update in
    place and refuses it (return copies for leaves the update leaves as they are)."""
    scaler = ampscale.create_scaler(backend=mfw.backend, init_scale=2.0)
    params = [mfw.array([1.0, 2.0])]
    step = lambda: scaler.step(lambda p, g, s: (p, s), params, [mfw.array([2.0, 2.0])], ())  # noqa: E731
    if mfw.name == "cupy":
        with pytest.raises(ampscale.InPlaceUpdateError, match="returned params"):
            step()
    else:
        new_params, _, after = step()
        assert _values(mfw, new_params) == _values(mfw, params)
        assert after.get_stats()["steps"] == 1


def test_a_backend_that_cannot_see_writes_compares_the_copies(monkeypatch) -> None:
    """CuPy's situation, with a NumPy-backed namespace whose guard is turned off: the first
    run, on copies, compared bit for bit with the originals, finds an update in place, and one
    that writes in place and returns new arrays (which no check of the real call could see);
    returning the arrays it was given is refused too (later calls cannot be watched there); a
    functional one runs. Nothing changes before a refusal."""
    xp = pytest.importorskip("array_api_strict")
    from ampscale.backends._base import Backend

    monkeypatch.setattr(array_api_backend.ArrayApiBackend, "guard_writes", Backend.guard_writes)
    scaler = ampscale.create_scaler(backend=xp, init_scale=2.0)

    def writes_then_returns_new(params, grads, state):
        _in_place_sgd(params, grads, state)
        return [p * 1.0 for p in params], state

    params, grads = [xp.asarray([1.0, -2.0])], [xp.asarray([float("inf"), 2.0])]
    for update_fn, pattern in (
        (_in_place_sgd, r"wrote into params\[0\] in place"),
        (writes_then_returns_new, r"wrote into params\[0\] in place"),
        (lambda p, g, s: (p, s), r"returned params\[0\], the arrays it was given"),
    ):
        with pytest.raises(ampscale.InPlaceUpdateError, match=pattern):
            scaler.step(update_fn, params, grads, ())
        assert np.asarray(params[0]).tolist() == [1.0, -2.0]
        assert np.asarray(grads[0]).tolist() == [float("inf"), 2.0]
    new_params, _, _ = scaler.step(_sgd, [xp.asarray([1.0])], [xp.asarray([2.0])], ())
    assert np.asarray(new_params[0]).tolist() == [0.5]


def test_the_torch_device_path_refuses_before_the_write(monkeypatch) -> None:
    """The reported failure: on torch's CUDA path (CPU tensors down it here) the version
    counters saw the write after the call, and the overflowed step was in the parameters
    ([-inf, 1.875]). Refused now on the first run, on copies: parameters and gradients intact."""
    torch = pytest.importorskip("torch")
    from tests.fake_cuda import torch_on_host

    with torch_on_host(monkeypatch):
        scaler = ampscale.create_scaler(backend="torch", init_scale=4.0)
        params = [torch.tensor([1.0, 2.0])]
        grads = [torch.tensor([float("inf"), 0.5])]
        with pytest.raises(ampscale.InPlaceUpdateError, match=r"wrote into params\[0\] in place.*nothing was changed"):
            scaler.step(_in_place_sgd, params, grads, ())
        assert params[0].tolist() == [1.0, 2.0]
        assert grads[0].tolist() == [float("inf"), 0.5]
        assert scaler.get_stats()["steps"] == 0
        # the same program, functional: the overflowing step is skipped, the next applied
        params, _, scaler = scaler.step(_sgd, params, grads, ())
        assert params[0].tolist() == [1.0, 2.0]
        params, _, scaler = scaler.step(_sgd, params, [torch.tensor([2.0, 2.0])], ())
        assert params[0].tolist() == [0.5, 1.5]  # scale 2 after the backoff


def test_cupy_refuses_before_anything_changes_end_to_end(monkeypatch) -> None:
    """``Scaler.step`` on CuPy (a NumPy-backed ``cupy`` running the kernels' host build): an
    update in place, and one that writes in place but returns new arrays, are refused on the
    first run, on copies compared bit for bit: parameters, momentum, gradients and scaler
    intact. A functional one runs, and is checked once."""
    from tests.fake_cuda import cupy_on_host

    with cupy_on_host(monkeypatch) as (cp, module):
        scaler = ampscale.create_scaler(backend="cupy", init_scale=4.0)
        params = [cp.asarray(np.array([1.0, 2.0], np.float32))]
        momentum = [cp.asarray(np.array([0.5, 0.5], np.float32))]
        grads = [cp.asarray(np.array([np.inf, 2.0], np.float32))]

        def momentum_in_place(p, g, m):
            for v, gradient in zip(m, g, strict=True):
                v *= 0.9
                v += gradient
            return [a - 0.1 * v for a, v in zip(p, m, strict=True)], [v.copy() for v in m]

        def writes_then_returns_new(p, g, m):
            _in_place_sgd(p, g, m)
            return [a.copy() for a in p], [v.copy() for v in m]

        for update_fn, pattern in (
            (_in_place_sgd, r"wrote into params\[0\] in place"),
            (momentum_in_place, r"wrote into opt_state\[0\] in place"),
            (writes_then_returns_new, r"wrote into params\[0\] in place"),
        ):
            with pytest.raises(ampscale.InPlaceUpdateError, match=pattern):
                scaler.step(update_fn, params, grads, momentum)
            assert cp.asnumpy(params[0]).tolist() == [1.0, 2.0]
            assert cp.asnumpy(momentum[0]).tolist() == [0.5, 0.5]
            assert cp.asnumpy(grads[0]).tolist() == [np.inf, 2.0]
            assert scaler.get_stats()["steps"] == 0

        copies = []
        real_copy = module.CupyBackend.copy_leaf
        monkeypatch.setattr(module.CupyBackend, "copy_leaf", lambda self, x: copies.append(x) or real_copy(self, x))

        def sgd_momentum(p, g, m):
            m = [0.9 * v + gradient for v, gradient in zip(m, g, strict=True)]
            return [a - 0.1 * v for a, v in zip(p, m, strict=True)], m

        for step in range(3):
            grads = [cp.asarray(np.array([np.inf if step == 0 else 4.0, 4.0], np.float32))]
            params, momentum, scaler = scaler.step(sgd_momentum, params, grads, momentum)
        assert len(copies) == 3  # params, momentum and gradients, copied once: on the first step
        assert scaler.get_stats()["skipped_steps"] == 1


def test_a_verdict_is_kept_per_function_and_rechecked_for_a_new_one(monkeypatch) -> None:
    """What is checked when: a function made once is run on copies once; a lambda made anew in
    the loop with the same code and the same closure cells is the same function for the check;
    a method of one instance once per instance; a closure over new variables (a factory called
    again) is checked again, and a PerformanceWarning says to make it once."""
    import ampscale._in_place

    monkeypatch.setattr(ampscale._in_place, "_RECHECKS", {})  # the warning comes once per code and process
    calls = []

    def sgd(params, grads, state):
        calls.append("sgd")
        return _sgd(params, grads, state)

    def step(update_fn, value=1.0):
        scaler = ampscale.create_scaler(backend="numpy", init_scale=1.0)
        scaler.step(update_fn, [np.array([value], np.float32)], [np.array([1.0], np.float32)], ())

    for _ in range(3):
        step(sgd)
    assert calls == ["sgd"] * 4  # one run on copies, then the three real ones

    calls.clear()
    for _ in range(3):
        step(lambda p, g, s: sgd(p, g, s))  # a new function object, the same code and cells
    assert calls == ["sgd"] * 4

    class Optimizer:
        def update(self, params, grads, state):
            calls.append(id(self))
            return _sgd(params, grads, state)

    calls.clear()
    first, second = Optimizer(), Optimizer()
    for optimizer in (first, first, second):
        step(optimizer.update)  # a new bound method at every access
    assert calls == [id(first)] * 3 + [id(second)] * 2

    def make(lr):
        def update(params, grads, state):
            calls.append(lr)
            return [p - lr * g for p, g in zip(params, grads, strict=True)], state

        return update

    calls.clear()
    for lr in (0.1, 0.2, 0.3):
        step(make(lr))
    with pytest.warns(ampscale.PerformanceWarning, match="Make it once, outside the training loop"):
        step(make(0.4))  # the third check again of one code, in a row
    assert calls == [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]
    # made once per training run: checked again once per run, and no warning (they error here)
    calls.clear()
    for run in range(5):
        update = make(run)
        for _ in range(2):
            step(update)
    assert calls == [run for run in range(5) for _ in range(3)]


def test_an_update_that_starts_writing_in_place_later_is_found_after_the_write(fw) -> None:
    """The documented limit: the verdict of the first run holds for the function; one that
    writes in place only from its second call on is found by the watch on the real call, on
    torch after the write (the message says so), on NumPy by the write refused."""
    if fw.name not in ("numpy", "torch"):
        pytest.skip("the watch on real calls: NumPy refuses the write, torch counts it")
    calls = []

    def sometimes_in_place(params, grads, state):
        calls.append(1)
        if len(calls) > 2:  # the run on copies and the first real call are functional
            return _in_place_sgd(params, grads, state)
        return _sgd(params, grads, state)

    scaler = ampscale.create_scaler(backend=fw.backend, init_scale=1.0)
    params = [fw.array([1.0, 2.0])]
    params, _, scaler = scaler.step(sometimes_in_place, params, [fw.array([2.0, 2.0])], ())
    with pytest.raises(ampscale.InPlaceUpdateError) as caught:
        scaler.step(sometimes_in_place, params, [fw.array([2.0, 2.0])], ())
    if fw.name == "numpy":
        assert "The write itself was refused" in str(caught.value)
        assert _values(fw, params) == _values(fw, [fw.array([0.0, 1.0])])
    else:
        assert "may hold what this call wrote" in str(caught.value)
        assert _values(fw, params) == _values(fw, [fw.array([-1.0, 0.0])])  # written: the limit


def test_jax_arrays_need_no_check_and_in_place_is_refused() -> None:
    jnp = pytest.importorskip("jax.numpy")
    scaler = ampscale.create_scaler(backend="jax", init_scale=2.0)
    params = [jnp.ones(2)]
    new_params, _, _ = scaler.step(lambda p, g, s: (p, s), params, [jnp.ones(2)], ())  # returned as is: fine
    assert new_params[0].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="jax arrays do not allow"):
        scaler.step(lambda p, g, s, f: (p, s), params, [jnp.ones(2)], (), in_place=True)
    with pytest.raises(TypeError, match="cannot be written in place"):
        ampscale.masked_add_(jnp.bool_(True), params, [jnp.ones(2)])
    with pytest.raises(TypeError, match="in_place must be True or False"):
        scaler.step(lambda p, g, s: (p, s), params, [jnp.ones(2)], (), in_place=1)


# ------------------------------------------------------------------------------ the flag-aware path


def _momentum_in_place(lr: float, beta: float):
    def update(params, grads, state, finite):
        for p, g, v in zip(params, grads, state, strict=True):
            ampscale.masked_copy_(finite, [v], [beta * v + g])  # v = beta * v + g
            ampscale.masked_add_(finite, [p], [v], alpha=-lr)  # p -= lr * v
        return params, state

    return update


def _momentum(lr: float, beta: float):
    def update(params, grads, state):
        state = [beta * v + g for v, g in zip(state, grads, strict=True)]
        return [p - lr * v for p, v in zip(params, state, strict=True)], state

    return update


def test_in_place_updates_with_the_flag_give_the_functional_bits(fw) -> None:
    """``step(..., in_place=True)`` with ``masked_add_``/``masked_copy_``: over a run with
    overflows, the parameters and momentum are those of the functional update bit for bit, and
    on each overflowing step they keep their bits although the gradients hold inf and nan."""
    if fw.name not in MUTABLE:
        pytest.skip(f"{fw.name} arrays cannot be written in place")
    rng = np.random.default_rng(0)
    values = rng.normal(size=(12, 2, 5)).astype(np.float32)
    values[3, 0, 1], values[7, 1, 4], values[8, 0, 0] = np.inf, np.nan, -np.inf
    results = {}
    functional, in_place = _momentum(0.1, 0.9), _momentum_in_place(0.1, 0.9)  # made once, as in a loop
    for kind in ("functional", "in place"):
        scaler = ampscale.create_scaler(backend=fw.backend, init_scale=8.0, growth_interval=3)
        params = [fw.array(np.linspace(-1, 1, 5)), fw.array(np.ones(5))]
        state = [fw.array(np.zeros(5)), fw.array(np.zeros(5))]
        for step in values:
            grads = [fw.array(g * scaler.get_scale()) for g in step]
            before = _values(fw, params + state)
            if kind == "functional":
                params, state, scaler = scaler.step(functional, params, grads, state)
            else:
                params, state, scaler = scaler.step(in_place, params, grads, state, in_place=True)
            if not np.isfinite(step).all():
                assert _values(fw, params + state) == before
        results[kind] = (_values(fw, params + state), scaler.get_stats())
    assert results["in place"] == results["functional"]
    assert results["functional"][1]["skipped_steps"] == 3


def test_the_in_place_path_reads_nothing_on_the_host(monkeypatch) -> None:
    """On a device the flag stays there: with the array-API backend (a device backend's path),
    converting an array to a Python bool is forbidden during the steps, and they still run."""
    xp = pytest.importorskip("array_api_strict")
    scaler = ampscale.create_scaler(backend=xp, init_scale=4.0)
    params, state = [xp.asarray([1.0, 2.0])], [xp.asarray([0.0, 0.0])]
    scaler = scaler.update(scaler.unscale([xp.asarray([4.0])])[1])  # the state exists

    def forbidden(self, *args):
        raise AssertionError("host read of a device flag")

    array_type = type(xp.asarray(1.0))
    with monkeypatch.context() as m:
        m.setattr(array_type, "__bool__", forbidden)
        for g in ([4.0, 4.0], [float("inf"), 4.0], [8.0, 0.0]):
            params, state, scaler = scaler.step(
                _momentum_in_place(0.5, 0.0), params, [xp.asarray(g)], state, in_place=True
            )
    assert np.asarray(params[0]).tolist() == [1.0 - 0.5 * 1.0 - 0.5 * 4.0, 2.0 - 0.5 * 1.0]  # scales 4, skip, 2
    assert scaler.get_stats()["skipped_steps"] == 1


def test_masked_add_is_sgd_bit_for_bit_and_keeps_every_bit_on_overflow(fw) -> None:
    if fw.name not in MUTABLE:
        pytest.skip(f"{fw.name} arrays cannot be written in place")
    rng = np.random.default_rng(1)
    p = rng.normal(size=64).astype(np.float32)
    p[:3] = [-0.0, 0.0, np.float32(1e-40)]
    g = rng.normal(size=64).astype(np.float32)
    target = fw.array(p)
    ampscale.masked_add_(_flag(fw, True), [target], [fw.array(g)], alpha=-0.01)
    expected = fw.array(p)
    expected -= 0.01 * fw.array(g)
    assert _values(fw, [target]) == _values(fw, [expected])
    kept = _values(fw, [target])
    bad = g.copy()
    bad[::7] = np.nan
    bad[1::7] = np.inf
    ampscale.masked_add_(_flag(fw, False), [target], [fw.array(bad)], alpha=-0.01)
    ampscale.masked_copy_(_flag(fw, False), [target], [fw.array(bad)])
    assert _values(fw, [target]) == kept


def _flag(fw, value: bool):
    return ampscale.all_finite([fw.array([1.0 if value else float("inf")])])


def test_masked_updates_check_everything_before_writing() -> None:
    target = np.ones(3, np.float32)
    for args, error, pattern in (
        ((np.bool_(True), [target], [np.ones(2, np.float32)]), ValueError, "shape"),
        ((np.bool_(True), [target], [np.ones(3, np.float32)] * 2), ValueError, "leaves"),
        ((np.ones(2, bool), [target], [target]), TypeError, "0-d"),
        ((np.bool_(True), [target], [np.ones(3, np.int32)]), TypeError, "floating point"),
    ):
        with pytest.raises(error, match=pattern):
            ampscale.masked_add_(*args)
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ampscale.masked_copy_(np.bool_(True), [frozen], [np.zeros(3, np.float32)])
    with pytest.raises(TypeError, match="alpha must be a real number"):
        ampscale.masked_add_(np.bool_(True), [target], [target], alpha="0.1")
    assert target.tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------ CuPy's class, on a stand-in


class _Memory:
    def __init__(self, array: np.ndarray) -> None:
        self.ptr = array.ctypes.data
        self.device_id = 0


class _FakeArray(np.ndarray):
    """A NumPy array with CuPy's ``data.ptr`` and ``data.device_id``."""

    @property
    def data(self):
        return _Memory(self)


def _fake(x):
    return np.asarray(x).view(_FakeArray)


class _Communicator:
    """An NCCL communicator of a world of two: the other rank's flags are ``peer``."""

    def __init__(self, peer: list[float]) -> None:
        self.peer = peer
        self.calls: list[int] = []

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        assert (dtype, op, send) == ("float32", "max", recv)
        self.calls.append(count)
        buffer = np.ctypeslib.as_array(ctypes.cast(recv, ctypes.POINTER(ctypes.c_float)), shape=(count,))
        buffer[...] = np.maximum(buffer, np.asarray(self.peer[:count], np.float32))


@pytest.fixture
def cupy_backend(monkeypatch):
    """ampscale/backends/cupy.py loaded against a NumPy-backed ``cupy`` module."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NCCL_FLOAT32, nccl.NCCL_MAX = "float32", "max"

    class Device:
        def __init__(self, device_id: int = 0) -> None:
            self.id = device_id

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    cuda.Device, cuda.nccl = Device, nccl
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
    for name in ("float16", "float32", "float64", "int32", "uint8", "bool_"):
        setattr(cupy, name, getattr(np, name))
    cupy.ndarray, cupy.cuda = _FakeArray, cuda
    cupy.__getattr__ = lambda name: getattr(np, name)  # the rest of the namespace: NumPy's
    cupy.asarray = _fake
    cupy.logical_not = lambda x: _fake(np.logical_not(x))
    cupy.stack = lambda xs: _fake(np.stack([np.asarray(x) for x in xs]))
    cupy.full = lambda shape, value, dtype=None: _fake(np.full(shape, value, dtype))
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    path = pathlib.Path(ampscale.__file__).parent / "backends" / "cupy.py"
    spec = importlib.util.spec_from_file_location("_cupy_backend_on_numpy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backend = module.BACKEND
    # CuPy's namespace is array_api_compat.cupy (where, setitem): NumPy's here
    monkeypatch.setattr(type(backend), "namespace", lambda self: np)
    return backend


def test_cupy_agrees_on_both_flags_in_one_nccl_call(cupy_backend) -> None:
    """One all-reduce of a 2-element float32 buffer (the gradients' flag, the loss's) per step,
    on the current stream; each flag comes back agreed (false if either rank's was)."""
    comm = _Communicator(peer=[0.0, 1.0])  # the other rank: gradients finite, loss overflowed
    finite, loss_finite = cupy_backend.agree_flags(_fake(np.bool_(True)), _fake(np.bool_(True)), comm)
    assert comm.calls == [2]
    assert (bool(finite), bool(loss_finite)) == (True, False)
    comm = _Communicator(peer=[1.0])
    assert not bool(cupy_backend.agree(_fake(np.bool_(True)), comm))
    assert comm.calls == [1]


def test_cupy_refuses_an_update_returning_its_arrays_and_takes_the_flag_aware_path(cupy_backend) -> None:
    """CuPy's class inherits the device path: ``update_fn`` runs, its result is selected by the
    flag, and (CuPy seeing no writes) an ``update_fn`` that returns the arrays it was given is
    refused before the select; ``masked_add_`` selects on the device."""
    from ampscale._in_place import checked_update as _checked_update

    params = [_fake(np.array([1.0, 2.0], np.float32))]
    grads = [_fake(np.array([np.inf, 2.0], np.float32))]
    flag = _fake(np.bool_(False))
    checked = _checked_update(_in_place_sgd, cupy_backend, params, ())
    with pytest.raises(ampscale.InPlaceUpdateError, match="on the cupy backend ampscale cannot watch writes"):
        cupy_backend.apply_if(flag, checked, params, grads, ())
    fresh = [_fake(np.array([1.0, 2.0], np.float32))]
    new, _ = cupy_backend.apply_if(flag, _checked_update(_sgd, cupy_backend, fresh, ()), fresh, grads, ())
    assert np.asarray(new[0]).tolist() == [1.0, 2.0]  # the overflowing step was not applied
    cupy_backend.masked_add_(flag, fresh, grads, -0.5)
    assert np.asarray(fresh[0]).tolist() == [1.0, 2.0]
    cupy_backend.masked_add_(_fake(np.bool_(True)), fresh, [_fake(np.array([2.0, 2.0], np.float32))], -0.5)
    assert np.asarray(fresh[0]).tolist() == [0.0, 1.0]
