"""Trust, round three, checked again: what a review of the fixes to issue 24's sections 1-4 found.

- Every message that quotes a value the user gave (an argument, a checkpoint's entry) quotes it
  through ``ampscale._config.shown``: an integer of any length is named, abbreviated, and never
  replaces the error with Python's own ``ValueError`` (its 4300-digit limit for printing ints).
- ``update()`` twice with one step's flag is refused on every backend, and only then (NumPy's
  booleans are two shared objects; a step's flag must be its own).
- ``jax.export`` of an ``update()`` that reacts at the floor is refused naming ``on_floor``.
- Without the native NumPy kernel, a buffer given twice is unscaled once and overlapping
  buffers are refused, as with it.
- A callable ``axis_name`` (the documented way to agree over mpi4py) works on NumPy and the
  array-API backend too (found by making the docs' blocks check their results).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ampscale
from ampscale.backends import numpy as numpy_backend
from tests.conftest import without_native_numpy_kernel

GIANT = 10**5000  # beyond the 4300 digits Python prints (sys.get_int_max_str_digits)
HUGE = 10**400  # printable, and 401 digits long


def _messages(action: Callable[[], object]) -> tuple[BaseException | None, list[str]]:
    """The exception ``action`` raised (or None), and every message it raised or warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
            error = None
        except Exception as exc:
            error = exc
    texts = [str(w.message) for w in caught] + ([] if error is None else [str(error)])
    return error, texts


def _abbreviated(texts: list[str]) -> None:
    for text in texts:
        assert "int_max_str_digits" not in text, text
        assert not re.search(r"\d{25}", text), f"a value printed in full: {text[:300]}"


def _saved() -> dict:
    return ampscale.create_scaler(backend="numpy").update(True).state_dict()


def _top(key: str) -> Callable[[int], dict]:
    def make(value: int) -> dict:
        saved = _saved()
        saved[key] = value
        return saved

    return make


def _version(value: int) -> dict:
    saved = _saved()
    saved["ampscale"]["version"] = value
    return saved


def _torch_dict(value: int) -> dict:
    return {"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": value, "_growth_tracker": 0}


#: checkpoints with a huge integer where the loader quotes it: the key each message names
CHECKPOINTS: dict[str, tuple[Callable[[int], dict], str]] = {
    "scale beside the 'ampscale' entry": (_top("scale"), "'scale'"),
    "_growth_tracker beside the 'ampscale' entry": (_top("_growth_tracker"), "'_growth_tracker'"),
    "growth_interval beside the 'ampscale' entry": (_top("growth_interval"), "'growth_interval'"),
    "growth_factor beside the 'ampscale' entry": (_top("growth_factor"), "'growth_factor'"),
    "ampscale.version": (_version, "version"),
}


@pytest.mark.parametrize("value", [GIANT, -GIANT, HUGE], ids=["10**5000", "-10**5000", "10**400"])
@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_a_huge_integer_in_a_checkpoint_is_named_abbreviated(case: str, value: int) -> None:
    make, key = CHECKPOINTS[case]
    scaler = ampscale.create_scaler(backend="numpy")
    error, texts = _messages(lambda: scaler.load_state_dict(make(value)))
    assert isinstance(error, ampscale.StateDictError), error
    assert key in str(error)
    _abbreviated(texts)


@pytest.mark.parametrize("value", [-GIANT, -HUGE], ids=["-10**5000", "-10**400"])
def test_torchs_never_growing_interval_warns_with_the_value_abbreviated(value: int) -> None:
    """torch's checkpoints may hold any interval below 1 ("never grows"): loaded, with a warning."""
    error, texts = _messages(lambda: ampscale.create_scaler(backend="numpy").load_state_dict(_torch_dict(value)))
    assert error is None
    assert any("growth_interval=" in text and "never grows" in text for text in texts)
    _abbreviated(texts)


def _fp8_saved() -> dict:
    import ampscale.fp8

    return ampscale.fp8.create_fp8_scaler().state_dict()


def _fp8_load(change: Callable[[dict, int], None]) -> Callable[[int], object]:
    def load(value: int) -> object:
        import ampscale.fp8

        saved = _fp8_saved()
        change(saved["ampscale_fp8"], value)
        return ampscale.fp8.create_fp8_scaler().load_state_dict(saved)

    return load


def _drop_in_update(value: int) -> object:
    torch = pytest.importorskip("torch")
    import ampscale.torch

    scaler = ampscale.torch.GradScaler("cpu")
    scaler.scale(torch.ones(1))
    return scaler.update(value)


def _drop_in_interval(value: int) -> object:
    pytest.importorskip("torch")
    import ampscale.torch

    return ampscale.torch.GradScaler("cpu", growth_interval=value)


def _jax(build: Callable[[Any, int], object]) -> Callable[[int], object]:
    def call(value: int) -> object:
        pytest.importorskip("jax")
        import ampscale.jax

        return build(ampscale.jax, value)

    return call


#: every other entry point that quotes a number it was given: (call, error type, the name it gives)
ARGUMENTS: dict[str, tuple[Callable[[int], object], type[BaseException], str]] = {
    "Scaler.scale(loss)": (lambda v: ampscale.create_scaler().scale(v), TypeError, "loss"),
    "Scaler.unscale(loss=)": (lambda v: ampscale.create_scaler().unscale([np.ones(1)], loss=v), TypeError, "loss"),
    "Scaler.update(finite)": (lambda v: ampscale.create_scaler().update(v), TypeError, "finite"),
    "masked_add_(alpha=)": (
        lambda v: ampscale.masked_add_(np.True_, [np.ones(2)], [np.ones(2)], alpha=v),
        ValueError,
        "alpha",
    ),
    "create_scaler(backend=)": (lambda v: ampscale.create_scaler(backend=v), ValueError, "backend"),
    "create_scaler(init_scale=[...])": (lambda v: ampscale.create_scaler(init_scale=[v]), ValueError, "init_scale"),
    "GradScaler.update(new_scale)": (_drop_in_update, ValueError, "new_scale"),
    "GradScaler(growth_interval=)": (_drop_in_interval, ValueError, "growth_interval"),
    "fp8 version": (_fp8_load(lambda d, v: d.__setitem__("version", v)), ampscale.StateDictError, "version"),
    "fp8 slot scale": (
        _fp8_load(lambda d, v: d["slots"][0].__setitem__("scale", v)),
        ampscale.StateDictError,
        "slots[0].scale",
    ),
    "fp8 history_len": (_fp8_load(lambda d, v: d["settings"].__setitem__("history_len", v)), ValueError, "history_len"),
    "create_fp8_scaler(margin=)": (
        lambda v: __import__("ampscale.fp8").fp8.create_fp8_scaler(margin=v),
        ValueError,
        "margin",
    ),
    "create_fp8_scaler(eps=)": (lambda v: __import__("ampscale.fp8").fp8.create_fp8_scaler(eps=v), ValueError, "eps"),
    "jax DynamicScale(scale=)": (_jax(lambda m, v: m.DynamicScale(scale=v)), ValueError, "scale"),
    "jax DynamicScale(minimum_scale=)": (
        _jax(lambda m, v: m.DynamicScale(minimum_scale=v)),
        ValueError,
        "minimum_scale",
    ),
    "jax DynamicScale(fin_steps=)": (_jax(lambda m, v: m.DynamicScale(fin_steps=v)), ValueError, "fin_steps"),
    "jmp DynamicLossScale(period=)": (
        _jax(lambda m, v: m.DynamicLossScale(np.float32(1), period=v)),
        ValueError,
        "period",
    ),
    "jmp DynamicLossScale(factor=)": (
        _jax(lambda m, v: m.DynamicLossScale(np.float32(1), factor=v)),
        ValueError,
        "factor",
    ),
}


@pytest.mark.parametrize("value", [GIANT, -GIANT, HUGE], ids=["10**5000", "-10**5000", "10**400"])
@pytest.mark.parametrize("case", sorted(ARGUMENTS))
def test_a_huge_integer_argument_is_named_abbreviated(case: str, value: int) -> None:
    call, kind, name = ARGUMENTS[case]
    if case == "GradScaler(growth_interval=)" and value < 0:
        value = -value  # below 1 is torch's "never grows", accepted: the warning is tested above
    error, texts = _messages(lambda: call(value))
    assert isinstance(error, kind), f"{case}: {error!r}"
    assert name in str(error)
    _abbreviated(texts)


def test_shown_abbreviates_what_would_be_huge_and_keeps_the_rest() -> None:
    from ampscale._config import shown

    assert shown(3) == "3"
    assert shown("warn") == "'warn'"
    assert shown(10**30) == "100000000000...0000 (an integer of 31 digits)"
    assert shown(GIANT) == "an integer of about 5000 digits"
    assert shown(-GIANT) == "a negative integer of about 5000 digits"
    assert shown([GIANT]) == "a list holding an integer too long to print"
    assert shown([HUGE, 1.5]) == "[100000000000...0000 (401 digits), 1.5]"
    long_text = shown("x" * 1000)
    assert len(long_text) < 220
    assert long_text.endswith("(str, 1002 characters)")


def test_the_foreign_rules_warning_reads_right() -> None:
    apex = {"loss_scale": 2.0, "unskipped": 0}
    with pytest.warns(ampscale.AmpscaleWarning) as caught:
        ampscale.create_scaler(backend="numpy").load_state_dict(apex)
    text = str(caught[0].message)
    assert text.startswith("loading an apex LossScaler state dict"), text
    with pytest.warns(ampscale.AmpscaleWarning, match="^loading a torch.amp.GradScaler state dict"):
        ampscale.create_scaler(backend="numpy", preset="megatron").load_state_dict(_torch_dict(2000))


# ------------------------------------------------------------------------------ update() twice


def _flag_sources(backend: str) -> list[Callable[[], Any]]:
    """Flags of other steps on ``backend``: all_finite, a plain NumPy bool, a second unscale."""
    ones = _ones(backend)
    scaler = ampscale.create_scaler(backend)
    return [
        lambda: ampscale.all_finite([ones]),
        lambda: np.True_,
        lambda: np.bool_(True),
        lambda: scaler.unscale([ones])[1],
        lambda: ampscale.create_scaler(backend).unscale([ones])[1],
    ]


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_update_after_update_takes_any_other_steps_flag(backend: str) -> None:
    """A scaler made by ``update(f)`` counts the next step's flag, whatever object it is; only
    ``f`` itself is refused (it would count its step twice)."""
    for source in _flag_sources(backend):
        scaler = ampscale.create_scaler(backend, growth_interval=3)
        _, flag = scaler.unscale([_ones(backend)])
        once = scaler.update(flag)
        twice = once.update(source())
        assert twice.get_stats()["steps"] == 2
        with pytest.raises(ValueError, match="count twice"):
            once.update(flag)


def _ones(backend: str) -> Any:
    if backend == "numpy":
        return np.ones(3, np.float32)
    if backend == "torch":
        return pytest.importorskip("torch").ones(3)
    return pytest.importorskip("jax.numpy").ones(3)


def test_numpys_flag_is_a_0d_bool_array_of_its_own_step() -> None:
    scaler = ampscale.create_scaler(backend="numpy")
    _, first = scaler.unscale([np.ones(3, np.float32)])
    _, second = scaler.unscale([np.ones(3, np.float32)], loss=np.float32(2.0))
    _, empty = scaler.unscale([])
    for flag in (first, second, empty):
        assert isinstance(flag, np.ndarray)
        assert flag.shape == ()
        assert flag.dtype == np.bool_
        assert bool(flag)
    assert first is not second
    _, bad = scaler.unscale([np.full(3, np.inf, np.float32)])
    assert not bool(bad)


# ------------------------------------------------------------------------------ jax.export


@pytest.mark.parametrize("on_floor", ["warn", "raise", "callback"])
def test_jax_export_of_an_update_that_reacts_at_the_floor_is_refused_by_name(on_floor: str) -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import export

    import ampscale.backends.jax  # registers the scaler's serialization (for deserialize)

    reaction: Any = (lambda event: None) if on_floor == "callback" else on_floor

    def train_step(scaler: ampscale.Scaler, grads: dict) -> tuple:
        grads, finite = scaler.unscale(grads)
        return grads, scaler.update(finite)

    grads = {"w": jnp.full(4, 2.0**16)}
    scaler = ampscale.create_scaler(backend="jax", on_floor=reaction)
    with pytest.raises(ValueError, match=r"on_floor=.*on_floor='ignore'"):
        export.export(jax.jit(train_step))(scaler, grads)
    # jit keeps the reaction; an export of the same step with on_floor="ignore" serializes
    out, after = jax.jit(train_step)(scaler, grads)
    assert after.get_scale() == 65536.0
    exported = export.export(jax.jit(train_step))(scaler.replace(on_floor="ignore"), grads)
    again = export.deserialize(exported.serialize())
    out, after = again.call(scaler.replace(on_floor="ignore"), {"w": jnp.full(4, 2.0**16)})
    np.testing.assert_array_equal(np.asarray(out["w"]), np.ones(4, np.float32))


def test_the_deepspeed_presets_export_is_refused_naming_its_default() -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import export

    def train_step(scaler: ampscale.Scaler, grads: list) -> ampscale.Scaler:
        return scaler.update(scaler.unscale(grads)[1])

    scaler = ampscale.create_scaler(backend="jax", preset="deepspeed")
    with pytest.raises(ValueError, match="on_floor='raise'"):
        export.export(jax.jit(train_step))(scaler, [jnp.ones(2)])


# ------------------------------------------------------------------------------ no native kernel


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "without the kernel"])
def test_overlapping_gradients_are_refused_untouched_with_or_without_the_kernel(native: bool) -> None:
    if native and not numpy_backend.NATIVE:
        pytest.skip("the native kernel is not built here")
    shared = np.full(10, 4.0, np.float32)
    tree = {"w": shared[:6], "v": [np.ones(2, np.float32), shared[4:]]}
    refused = pytest.raises(ampscale.AliasedGradientsError, match=r"\['w'\].*\['v'\]\[1\]")
    with without_native_numpy_kernel(not native), refused:
        ampscale.create_scaler().unscale(tree)
    np.testing.assert_array_equal(shared, np.full(10, 4.0, np.float32))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "without the kernel"])
@pytest.mark.parametrize("writable", [True, False], ids=["writable", "read-only"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one dtype", "two dtypes"])
def test_a_buffer_given_twice_is_unscaled_once_and_returned_unscaled_twice(
    native: bool, writable: bool, mixed: bool
) -> None:
    if native and not numpy_backend.NATIVE:
        pytest.skip("the native kernel is not built here")
    grad = np.full(3, 4.0, np.float32)
    grad.flags.writeable = writable
    tree = [grad, grad, grad[:]] + ([np.full(2, 4.0, np.float16)] if mixed else [])
    with without_native_numpy_kernel(not native):
        out, finite = ampscale.create_scaler(init_scale=2.0).unscale(tree)
    assert bool(finite)
    for leaf in out:
        np.testing.assert_array_equal(leaf, np.full(leaf.shape, 2.0, leaf.dtype))
    np.testing.assert_array_equal(grad, np.full(3, 2.0 if writable else 4.0, np.float32))


# ------------------------------------------------------------------------------ a callable agreement


@pytest.mark.parametrize("backend", ["numpy", "array_api_strict", "torch", "jax"])
def test_a_callable_axis_name_agrees_the_flag_on_every_backend(backend: str) -> None:
    """docs/backends.md: on host backends ``axis_name`` may be any callable ``bool -> bool`` (an
    mpi4py all-reduce): the flag it returns is the step's, on every backend."""
    if backend == "numpy":
        namespace: Any = "numpy"
        grads = [np.full(2, 4.0, np.float32)]
    elif backend == "array_api_strict":
        namespace = pytest.importorskip("array_api_strict")
        grads = [namespace.asarray([4.0, 4.0])]
    else:
        namespace = backend
        grads = [_ones(backend)]
    seen: list[bool] = []

    def another_rank_overflowed(finite: Any) -> bool:
        seen.append(bool(finite))
        return False

    scaler = ampscale.create_scaler(backend=namespace, init_scale=2.0, axis_name=another_rank_overflowed)
    _, finite = scaler.unscale(grads)
    assert seen == [True]
    assert not bool(finite)
    assert scaler.update(finite).get_scale() == 1.0
    _, finite = scaler.unscale(grads, axis_name=lambda finite: bool(finite))
    assert bool(finite)
