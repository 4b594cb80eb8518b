"""``Scaler.step`` and in-place updates: refused where they could corrupt, and a correct path.

On a device ``step`` computes the update before it knows whether the step overflowed and
keeps the old arrays where it did, so an ``update_fn`` that writes in place (``p -= lr * g``, the
usual CuPy habit) would already hold the overflowed step: through the array-API backend a
skipped step turned the parameters into -inf. Such an ``update_fn`` is refused on every backend
whose arrays can be written, where it can be detected (NumPy-backed arrays refuse the write
itself; torch's version counters see it; CuPy, which can see neither, refuses an ``update_fn``
returning the arrays it was given). The flag-aware path, ``step(..., in_place=True)`` with
``ampscale.masked_add_`` / ``masked_copy_``, updates in place on finite steps only, with no host
sync. CuPy's own class runs here against a NumPy-backed stand-in for the ``cupy`` module (its
arrays, streams and an NCCL communicator); only a GPU runs the real one.
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
def test_an_update_that_writes_in_place_is_refused(mfw, overflow: bool) -> None:
    """Refused on a finite step and (where ``update_fn`` runs on one: every device backend) on
    an overflowing one. NumPy-backed arrays refuse the write itself, so nothing has changed;
    torch sees it after the call, by the version counters, and says which leaf."""
    scaler = ampscale.create_scaler(backend=mfw.backend, init_scale=4.0)
    params = [mfw.array([1.0, 2.0]), mfw.array([3.0])]
    grads = [mfw.array([4.0, 8.0]), mfw.array([float("inf") if overflow else 4.0])]
    before = _values(mfw, params)
    runs_on_overflow = mfw.name not in ("numpy", "torch")  # host backends skip the call
    if overflow and not runs_on_overflow:
        new_params, _, after = scaler.step(_in_place_sgd, params, grads, ())
        assert _values(mfw, new_params) == before  # not called at all: nothing to refuse
        assert after.get_stats()["skipped_steps"] == 1
        return
    with pytest.raises(ampscale.InPlaceUpdateError, match="in_place=True") as caught:
        scaler.step(_in_place_sgd, params, grads, ())
    if mfw.name in ("numpy", "array_api_strict"):
        assert "wrote into one of" in str(caught.value)
        assert _values(mfw, params) == before  # the write itself was refused
    elif mfw.name.startswith("torch"):
        assert "wrote into params[0], params[1] in place" in str(caught.value)
    else:  # CuPy cannot see writes: it refuses the returned arrays
        assert "returned params[0], params[1]" in str(caught.value)
    assert scaler.get_stats()["steps"] == 0  # and the scaler was not updated


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


def test_a_backend_that_cannot_see_writes_refuses_the_arrays_it_gave(monkeypatch) -> None:
    """CuPy's situation, with a NumPy-backed namespace whose guard is turned off: an update in
    place is caught by the arrays it returns; a functional one runs; so does one that returns
    new arrays after writing in place (undetectable, as on CuPy: documented)."""
    xp = pytest.importorskip("array_api_strict")
    from ampscale.backends._base import Backend

    monkeypatch.setattr(array_api_backend.ArrayApiBackend, "guard_writes", Backend.guard_writes)
    scaler = ampscale.create_scaler(backend=xp, init_scale=2.0)
    params, grads = [xp.asarray([1.0])], [xp.asarray([2.0])]
    with pytest.raises(ampscale.InPlaceUpdateError, match="cannot see whether they were written in place"):
        scaler.step(_in_place_sgd, params, grads, ())
    new_params, _, _ = scaler.step(_sgd, [xp.asarray([1.0])], [xp.asarray([2.0])], ())
    assert np.asarray(new_params[0]).tolist() == [0.5]


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
    for kind in ("functional", "in place"):
        scaler = ampscale.create_scaler(backend=fw.backend, init_scale=8.0, growth_interval=3)
        params = [fw.array(np.linspace(-1, 1, 5)), fw.array(np.ones(5))]
        state = [fw.array(np.zeros(5)), fw.array(np.zeros(5))]
        for step in values:
            grads = [fw.array(g * scaler.get_scale()) for g in step]
            before = _values(fw, params + state)
            if kind == "functional":
                params, state, scaler = scaler.step(_momentum(0.1, 0.9), params, grads, state)
            else:
                params, state, scaler = scaler.step(_momentum_in_place(0.1, 0.9), params, grads, state, in_place=True)
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
    from ampscale._scaler import _checked_update

    params = [_fake(np.array([1.0, 2.0], np.float32))]
    grads = [_fake(np.array([np.inf, 2.0], np.float32))]
    flag = _fake(np.bool_(False))
    checked = _checked_update(_in_place_sgd, cupy_backend, params, ())
    with pytest.raises(ampscale.InPlaceUpdateError, match="on the cupy backend ampscale cannot see"):
        cupy_backend.apply_if(flag, checked, params, grads, ())
    fresh = [_fake(np.array([1.0, 2.0], np.float32))]
    new, _ = cupy_backend.apply_if(flag, _checked_update(_sgd, cupy_backend, fresh, ()), fresh, grads, ())
    assert np.asarray(new[0]).tolist() == [1.0, 2.0]  # the overflowing step was not applied
    cupy_backend.masked_add_(flag, fresh, grads, -0.5)
    assert np.asarray(fresh[0]).tolist() == [1.0, 2.0]
    cupy_backend.masked_add_(_fake(np.bool_(True)), fresh, [_fake(np.array([2.0, 2.0], np.float32))], -0.5)
    assert np.asarray(fresh[0]).tolist() == [0.0, 1.0]
