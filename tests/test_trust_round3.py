"""Trust, round three: checkpoints and settings, diagnostics that see every leaf, a torch step
that returns what torch returns.

Each test pins one class of fault found by review (issue 24, sections 1, 3 and 4): the general
mechanism, checked over every setting, key, backend or path it covers.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import warnings

import numpy as np
import pytest

import ampscale
from ampscale._config import INT_SETTINGS, NEVER_GROWS, PRESETS, REAL_SETTINGS

torch = pytest.importorskip("torch")

import ampscale.torch as amp_torch  # noqa: E402

HUGE = 10**400


# ------------------------------------------------------------------------------ section 1: settings

#: a valid value of every numeric setting (with the preset it needs), and the setting's kind
VALID = {
    "init_scale": 1024.0,
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "min_scale": 2.0,
    "max_scale": 2.0**20,
    "growth_interval": 3,
    "hysteresis": 2,
    "floor_patience": 2,
    "interval_offset": 1,
    "first_growth_delay": 1,
}
NUMPY_INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64)
NUMPY_REALS = (np.float16, np.float32, np.float64, *NUMPY_INTS)
STEPS = [True, True, False, True, True, True, True, False, False, True, True, True, True, True]


def _numpy_forms(name: str) -> list[object]:
    value = VALID[name]
    kinds = NUMPY_INTS if name in INT_SETTINGS else NUMPY_REALS
    forms: list[object] = []
    for kind in kinds:
        if value != int(value) and not issubclass(kind, np.floating):
            continue
        info = np.finfo(kind) if issubclass(kind, np.floating) else np.iinfo(kind)
        if float(info.min) <= value <= float(info.max) and kind(value) == value:  # the type holds the value
            forms += [kind(value), np.asarray(value, dtype=kind)]  # a scalar, and a 0-d array (.npz)
    return forms


def _trajectory(scaler: ampscale.Scaler) -> list[tuple[float, int]]:
    out = []
    for finite in STEPS:
        scaler = scaler.update(finite)
        out.append((scaler.get_scale(), scaler.get_stats()["growth_tracker"]))
    return out


@pytest.mark.parametrize("name", sorted(VALID))
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_every_numeric_setting_takes_numpy_numbers_and_works(name: str, backend: str) -> None:
    """NumPy scalars and 0-d arrays (a sweep grid, an .npz) are plain numbers from validation on:
    the same trajectory through update() (the host transition and the code generator), a
    JSON-serialisable state dict, plain types in the config."""
    if backend == "jax":
        pytest.importorskip("jax")
    reference = ampscale.create_scaler(backend, **{name: VALID[name]})
    expected = _trajectory(reference)
    for form in _numpy_forms(name):
        scaler = ampscale.create_scaler(backend, **{name: form})
        value = getattr(scaler.config, name)
        assert type(value) is (int if name in INT_SETTINGS else float), (form, type(value))
        assert _trajectory(scaler) == expected, form
        json.dumps(scaler.state_dict())


def test_settings_from_an_npz_file_work() -> None:
    buffer = io.BytesIO()
    np.savez(buffer, growth_interval=2, growth_factor=np.float32(2.0), init_scale=8.0)
    buffer.seek(0)
    grid = dict(np.load(buffer))  # 0-d arrays
    scaler = ampscale.create_scaler(**grid)
    assert scaler.update(True).update(True).get_scale() == 16.0
    assert json.loads(json.dumps(scaler.state_dict()))["ampscale"]["settings"]["growth_interval"] == 2


@pytest.mark.parametrize("name", sorted(VALID))
@pytest.mark.parametrize("flag", [True, np.True_, np.array(True)], ids=["bool", "np.bool_", "0-d bool"])
def test_bools_are_refused_for_every_numeric_setting(name: str, flag: object) -> None:
    with pytest.raises(ValueError, match=name):
        ampscale.create_scaler(**{name: flag})


@pytest.mark.parametrize("name", [*REAL_SETTINGS, *INT_SETTINGS])
def test_a_huge_integer_setting_is_a_value_error_naming_it(name: str) -> None:
    for value in (HUGE, -HUGE):
        with pytest.raises(ValueError, match=name) as caught:
            ampscale.create_scaler(**{name: value})
        assert not isinstance(caught.value, OverflowError)
        assert "401 digits" in str(caught.value)  # named, not printed in full


def test_the_drop_in_takes_numpy_settings_and_writes_plain_ones() -> None:
    ours = amp_torch.GradScaler(
        "cpu", init_scale=np.float32(8.0), growth_interval=np.int64(2), growth_factor=np.float64(2)
    )
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2, growth_factor=2.0)
    for step in range(5):
        for scaler in (ours, theirs):
            _train_step(scaler, poison=step == 3)
        assert ours.get_scale() == theirs.get_scale()
    saved = ours.state_dict()
    assert saved == theirs.state_dict()
    assert all(type(v) in (int, float) for v in saved.values())
    json.dumps(saved)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == saved  # no NumPy global in the checkpoint
    with pytest.raises(ValueError, match="growth_interval"):
        amp_torch.GradScaler("cpu", growth_interval=True)
    with pytest.raises(ValueError, match="init_scale"):
        amp_torch.GradScaler("cpu", init_scale=HUGE)


# ------------------------------------------------------------------------------ section 1: checkpoints


def _torch_dict(**changes: object) -> dict:
    base = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 3}
    return {**base, **changes}


def _ampscale_dict(section: str, key: str, value: object) -> dict:
    saved = ampscale.create_scaler().update(True).state_dict()
    if section == "top":
        saved[key] = value
    else:
        saved["ampscale"][section][key] = value
    return saved


HUGE_DICTS = {
    **{f"torch.{key}": _torch_dict(**{key: HUGE}) for key in ("scale", "growth_factor", "backoff_factor")},
    "torch.growth_interval": _torch_dict(growth_interval=HUGE),
    "torch._growth_tracker": _torch_dict(_growth_tracker=HUGE),
    "torch.-_growth_tracker": _torch_dict(_growth_tracker=-HUGE),
    **{f"state.{key}": ("state", key) for key in ("scale", "last_scale", "growth_tracker", "steps", "last_reason")},
    **{f"settings.{key}": ("settings", key) for key in ("init_scale", "growth_factor", "growth_interval", "min_scale")},
    "version": ("top-ampscale", "version"),
    "apex.loss_scale": {"loss_scale": HUGE, "unskipped": 0},
    "apex.unskipped": {"loss_scaler0": {"loss_scale": 2.0, "unskipped": HUGE}},
}


@pytest.mark.parametrize("case", sorted(HUGE_DICTS))
def test_a_huge_integer_anywhere_in_a_checkpoint_is_a_state_dict_error(case: str) -> None:
    spec = HUGE_DICTS[case]
    if isinstance(spec, tuple):
        section, key = spec
        if section == "top-ampscale":
            state_dict = ampscale.create_scaler().state_dict()
            state_dict["ampscale"][key] = HUGE
        else:
            state_dict = _ampscale_dict(section, key, HUGE)
    else:
        state_dict = spec
    key = case.split(".", 1)[-1].lstrip("-")
    for loader in (ampscale.create_scaler(preset="apex"), amp_torch.GradScaler("cpu", preset="apex")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ampscale.AmpscaleWarning)
            with pytest.raises(ampscale.StateDictError, match=key) as caught:
                loader.load_state_dict(state_dict)
        assert not isinstance(caught.value, OverflowError)


def _train_step(scaler: object, model: object = None, poison: bool = False, optimizer: object = None) -> object:
    """One scaled step of a small model (made once per scaler); returns what step() returned."""
    # keyed by id(), each entry holding its scaler alive: a dead scaler's id, reused by a new
    # one, would hand that one another test's trained model
    owner, kept_model, kept_optimizer = _MODELS.get(id(scaler), (None, None, None))
    if owner is not scaler:
        torch.manual_seed(0)  # every scaler's model starts the same: twins see the same losses
        kept_model = torch.nn.Linear(3, 1)
        kept_optimizer = torch.optim.SGD(kept_model.parameters(), lr=0.01)
        _MODELS[id(scaler)] = (scaler, kept_model, kept_optimizer)
    if model is None:
        model = kept_model
    if optimizer is None:
        optimizer = kept_optimizer if model is kept_model else torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.zero_grad()
    loss = model(torch.ones(2, 3)).pow(2).mean()
    scaler.scale(loss).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")
    result = scaler.step(optimizer)
    scaler.update()
    return result


_MODELS: dict[int, tuple[object, object, object]] = {}


def _snapshot(scaler: amp_torch.GradScaler) -> tuple:
    return (
        scaler.state_dict(),
        scaler._scale,
        None if scaler._scale is None else (scaler._scale.dtype, scaler._scale.item()),
        scaler._rest,
        scaler.config,
    )


def test_load_state_dict_of_only_the_ampscale_entry_is_all_or_nothing() -> None:
    source = ampscale.create_scaler(preset="megatron").update(False).update(True)
    entry = {"ampscale": source.state_dict()["ampscale"]}
    scaler = amp_torch.GradScaler("cpu")
    _train_step(scaler)
    scaler.load_state_dict(entry)
    assert scaler.get_scale() == source.get_scale()
    assert scaler.config == source.config
    assert scaler.state_dict()["ampscale"] == source.state_dict()["ampscale"]
    assert (scaler.get_growth_factor(), scaler.get_growth_interval()) == (2.0, 1000)
    # a bad value anywhere: nothing changes, the state tensors included
    for key, value in (("scale", float("nan")), ("steps", -1), ("last_reason", 7), ("hysteresis_tracker", 5)):
        bad = json.loads(json.dumps(entry))
        bad["ampscale"]["state"][key] = value
        other = amp_torch.GradScaler("cpu", preset="apex")
        _train_step(other)
        before = _snapshot(other)
        with pytest.raises(ampscale.StateDictError, match=key):
            other.load_state_dict(bad)
        after = _snapshot(other)
        assert after[0] == before[0]
        assert after[1] is before[1]
        assert after[2:] == before[2:]


@pytest.mark.parametrize("started", [False, True])
@pytest.mark.parametrize("direction", ["float64 into float32", "float32 into float64"])
def test_a_checkpoint_of_another_scale_dtype_resumes_exactly(started: bool, direction: str) -> None:
    """The loaded scaler goes on exactly as the saved one, whether or not it had started: its
    scale tensor takes the loaded settings' dtype (a float64 scale above float32's range)."""
    if direction == "float64 into float32":
        source = amp_torch.GradScaler("cpu", preset="deepspeed", init_scale=3e38, growth_interval=1)
        loader = amp_torch.GradScaler("cpu")
    else:
        source = amp_torch.GradScaler("cpu", init_scale=2.0**100, growth_interval=1, hysteresis=2)
        loader = amp_torch.GradScaler("cpu", preset="deepspeed")
    for _ in range(3):
        _train_step(source)
    if started:
        _train_step(loader)
    loader.load_state_dict(source.state_dict())
    assert loader._scale is None or loader._scale.dtype == source._scale.dtype
    for step in range(6):
        _train_step(source, poison=step in (2, 3))
        _train_step(loader, poison=step in (2, 3))
        assert loader.get_scale() == source.get_scale(), step
        assert loader.state_dict() == source.state_dict()
    if direction == "float64 into float32":
        assert source.get_scale() > 3.5e38  # past float32: only a float64 scale holds it


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("interval", [0, -3])
def test_growth_interval_below_one_round_trips_through_the_drop_ins_state_dict(preset: str, interval: int) -> None:
    offset = PRESETS[preset].defaults["interval_offset"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampscale.AmpscaleWarning)
        source = amp_torch.GradScaler("cpu", preset=preset, growth_interval=interval)
        for step in range(4):
            _train_step(source, poison=step == 1)
        saved = source.state_dict()
        assert saved["growth_interval"] == interval  # torch's value, as given
        for started in (False, True):
            loader = amp_torch.GradScaler("cpu", preset=preset)
            if started:
                _train_step(loader)
            loader.load_state_dict(saved)
            assert loader.state_dict() == saved
            assert loader.config.growth_interval == (interval if interval >= 1 - offset else NEVER_GROWS)
            assert ampscale.create_scaler(preset=preset).load_state_dict(saved).config == loader.config


ODD_BUT_ACCEPTED = [
    {"preset": "deepspeed", "init_scale": 1e300},
    {"preset": "deepspeed", "init_scale": 1e-300, "min_scale": 1e-300},
    {"preset": "apex", "init_scale": 2.0**-1000},
    {"interval_offset": 1, "growth_interval": 0},
    {"preset": "flax", "growth_interval": 0},
    {"scale_dtype": "float64", "init_scale": 1e-310 * 1e10},
    {"first_growth_delay": 1, "growth_interval": 1},
    {"mode": "guard"},
    {"mode": "static", "init_scale": 3.0},
    {"on_floor": print, "floor_patience": 3},
]


@pytest.mark.parametrize("settings", ODD_BUT_ACCEPTED, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_state_dict_never_raises_for_a_scaler_the_constructor_accepted(settings: dict) -> None:
    scaler = amp_torch.GradScaler("cpu", **settings)
    saved = scaler.state_dict()
    _train_step(scaler)
    saved = scaler.state_dict()
    again = amp_torch.GradScaler("cpu", **settings)
    again.load_state_dict(saved)
    assert again.state_dict() == saved


def test_torchs_own_growth_interval_zero_checkpoints_load_and_never_grow() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=0)
    for step in range(3):
        _train_step(theirs, poison=step == 1)
    saved = theirs.state_dict()
    assert saved["growth_interval"] == 0
    with pytest.warns(ampscale.AmpscaleWarning, match="never grows"):
        functional = ampscale.create_scaler().load_state_dict(saved)
    assert functional.config.growth_interval == NEVER_GROWS
    ours = amp_torch.GradScaler("cpu")
    with pytest.warns(ampscale.AmpscaleWarning, match="never grows"):
        ours.load_state_dict(saved)
    for step in range(5):
        _train_step(theirs, poison=step == 2)
        _train_step(ours, poison=step == 2)
        functional = functional.update(step != 2)
        assert ours.state_dict() == theirs.state_dict()
        assert functional.get_scale() == theirs.get_scale()


BAD_NEW_SCALES = {
    "zero": (0.0, ValueError),
    "negative": (-2.0, ValueError),
    "nan": (float("nan"), ValueError),
    "inf": (float("inf"), ValueError),
    "-inf": (-float("inf"), ValueError),
    "float32 zero": (1e-50, ValueError),
    "float32 inf": (1e39, ValueError),
    "huge int": (HUGE, ValueError),
    "bool": (True, TypeError),
    "str": ("2.0", TypeError),
    "list": ([2.0], TypeError),
    "tensor zero": (torch.tensor(0.0), ValueError),
    "tensor nan": (torch.tensor(float("nan")), ValueError),
    "tensor inf": (torch.tensor([float("inf")]), ValueError),
    "tensor two elements": (torch.tensor([1.0, 2.0]), AssertionError),
    "tensor requires grad": (torch.tensor(2.0, requires_grad=True), AssertionError),
    "tensor on meta": (torch.tensor(2.0, device="meta"), AssertionError),
    "bool tensor": (torch.tensor(True), TypeError),
    "complex tensor": (torch.tensor(2.0 + 0j), TypeError),
}


@pytest.mark.parametrize("case", sorted(BAD_NEW_SCALES))
def test_update_new_scale_refuses_what_would_break_training_and_changes_nothing(case: str) -> None:
    value, kind = BAD_NEW_SCALES[case]
    scaler = amp_torch.GradScaler("cpu")
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.step(optimizer)
    before = (scaler.get_scale(), scaler._get_growth_tracker(), scaler._scale._version)
    with pytest.raises(kind) as caught:
        scaler.update(value)
    if kind is not AssertionError:
        assert "new_scale" in str(caught.value)
    assert (scaler.get_scale(), scaler._get_growth_tracker(), scaler._scale._version) == before
    scaler.update()  # the iteration's flags are still there: the plain update works
    assert scaler._get_growth_tracker() == before[1] + 1


def test_update_new_scale_respects_the_presets_bounds_and_accepts_what_torch_accepts() -> None:
    scaler = amp_torch.GradScaler("cpu", preset="megatron")  # min_scale 1
    _train_step(scaler)
    with pytest.raises(ValueError, match=r"new_scale.*\[1\.0"):
        scaler.update(0.5)
    for value, expected in (
        (256.0, 256.0),
        (8, 8.0),
        (torch.tensor(4.0), 4.0),
        (torch.tensor([2], dtype=torch.int32), 2.0),
    ):
        scaler.update(value)
        assert scaler.get_scale() == expected


def test_loading_a_torch_or_apex_dict_into_other_rules_warns_naming_them() -> None:
    torch_dict = torch.amp.GradScaler("cpu").state_dict()
    with pytest.warns(ampscale.AmpscaleWarning) as caught:
        ampscale.create_scaler(preset="megatron").load_state_dict(torch_dict)
    message = str(caught[0].message)
    for part in ("hysteresis=2", "min_scale=1.0", "preset='torch'", "'megatron'"):
        assert part in message
    with pytest.warns(ampscale.AmpscaleWarning, match="hysteresis=3"):
        amp_torch.GradScaler("cpu", hysteresis=3).load_state_dict(torch_dict)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampscale.create_scaler().load_state_dict(torch_dict)  # torch's own rules: no word
        amp_torch.GradScaler("cpu").load_state_dict(torch_dict)
        ampscale.create_scaler(preset="apex").load_state_dict({"loss_scale": 8.0, "unskipped": 1})
    with pytest.warns(ampscale.AmpscaleWarning, match="apex LossScaler.*hysteresis_mode='cumulative'"):
        ampscale.create_scaler().load_state_dict({"loss_scale": 8.0, "unskipped": 1})


def _apex_update(scale: float, unskipped: int, overflow: bool, window: int, max_scale: float) -> tuple[float, int]:
    """apex.amp's LossScaler.update_scale (dynamic, no min_loss_scale), as a plain model."""
    if overflow:
        scale, unskipped = scale / 2.0, 0
    else:
        unskipped += 1
    if unskipped == window:
        scale, unskipped = min(max_scale, scale * 2.0), 0
    return scale, unskipped


@pytest.mark.parametrize("wrapped", [False, True], ids=["LossScaler", "amp.state_dict"])
def test_apex_loss_scaler_checkpoints_load_into_the_apex_preset(wrapped: bool) -> None:
    entry = {"loss_scale": 2.0**23, "unskipped": 1}
    saved = {"loss_scaler0": entry} if wrapped else entry
    scaler = ampscale.create_scaler(preset="apex", growth_interval=3).load_state_dict(saved)
    drop_in = amp_torch.GradScaler("cpu", preset="apex", growth_interval=3)
    drop_in.load_state_dict(saved)
    scale, unskipped = entry["loss_scale"], entry["unskipped"]
    for step, overflow in enumerate([False, False, False, False, True, False, False, False, False]):
        scale, unskipped = _apex_update(scale, unskipped, overflow, 3, 2.0**24)
        scaler = scaler.update(not overflow)
        _train_step(drop_in, poison=overflow)
        assert (scaler.get_scale(), scaler.get_stats()["growth_tracker"]) == (scale, unskipped), step
        assert drop_in.get_scale() == scale
    two = {"loss_scaler0": entry, "loss_scaler1": entry}
    for bad, key in (
        (two, "2 apex loss scalers"),
        ({"loss_scale": 8.0}, "unskipped"),
        ({"loss_scale": 8.0, "unskipped": 0, "extra": 1}, "extra"),
        ({"loss_scale": 0.0, "unskipped": 0}, "loss_scale"),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": -1}}, "loss_scaler0.unskipped"),
        ({"loss_scaler0": entry, "optimizer": {}}, "optimizer"),
    ):
        with pytest.raises(ampscale.StateDictError, match=key):
            ampscale.create_scaler(preset="apex").load_state_dict(bad)


# ------------------------------------------------------------------------------ section 3: diagnostics


def _mostly_zero_numpy_trees() -> dict[str, list]:
    base = np.zeros((200, 20), np.float32)
    base[:, 1::2] = 0.0
    read_only = np.zeros(400, np.float32)
    read_only.flags.writeable = False
    ones = np.ones(200, np.float32)
    return {
        "strided view": [np.zeros(3400, np.float32), base[:, ::2], ones],
        "read-only": [np.zeros(3400, np.float32), read_only, ones],
        "both": [np.zeros(3000, np.float32), base[:20, ::2], read_only, ones],
    }


@pytest.mark.parametrize("case", ["strided view", "read-only", "both"])
def test_underflow_counts_every_leaf_of_a_group_with_strided_or_read_only_arrays(case: str) -> None:
    leaves = _mostly_zero_numpy_trees()[case]
    expected = sum(int(np.count_nonzero(leaf == 0)) for leaf in leaves) / sum(leaf.size for leaf in leaves)
    scaler = ampscale.create_scaler(init_scale=1.0)
    _, finite, fraction = scaler.unscale(leaves, underflow=True)
    assert bool(finite)
    assert float(fraction) == pytest.approx(expected)
    assert expected > 0.9
    diagnosis = ampscale.doctor(scaler.update(finite), underflow=fraction)
    assert diagnosis.cause == "underflow"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax", "array_api_strict"])
def test_underflow_fraction_is_exact_on_every_backend(backend: str) -> None:
    values = np.zeros(1000, np.float32)
    values[:37] = 1.0
    values[37:40] = 1e-40  # subnormal: counted too
    strided = np.zeros((50, 4), np.float32)
    strided[:, 0] = 2.0
    if backend == "numpy":
        tree = {"a": values.copy(), "b": strided.copy()[:, ::2]}
    elif backend == "torch":
        tree = {"a": torch.from_numpy(values.copy()), "b": torch.from_numpy(strided.copy())[:, ::2]}
    elif backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        tree = {"a": jnp.asarray(values), "b": jnp.asarray(strided)[:, ::2]}
    else:
        xp = pytest.importorskip("array_api_strict")
        tree = {"a": xp.asarray(values), "b": xp.asarray(strided[:, ::2].copy())}
        backend = xp
    scaler = ampscale.create_scaler(backend, init_scale=1.0)
    _, _, fraction = scaler.unscale(tree, underflow=True)
    assert float(fraction) == pytest.approx((963 + 50) / 1100)


def test_underflow_with_sparse_gradients_counts_their_stored_values() -> None:
    embedding = torch.nn.Embedding(100, 4, sparse=True)
    dense = torch.nn.Linear(4, 1)
    dense(embedding(torch.tensor([3, 7, 7]))).sum().backward()
    dense.weight.grad.zero_()  # four zeros among the dense values
    grads = [embedding.weight.grad, dense.weight.grad, dense.bias.grad]
    stored = embedding.weight.grad._values()
    expected = (int((stored == 0).sum()) + 4) / (stored.numel() + 5)
    scaler = ampscale.create_scaler("torch", init_scale=1.0)
    _, finite, fraction = scaler.unscale(grads, underflow=True)
    assert bool(finite)
    assert float(fraction) == pytest.approx(expected)
    assert expected < 0.5  # the embedding rows the batch touched hold real gradients
    drop_in = amp_torch.GradScaler("cpu")
    optimizer = torch.optim.SGD([*embedding.parameters(), *dense.parameters()], lr=0.1)
    optimizer.zero_grad()
    drop_in.scale(dense(embedding(torch.tensor([1]))).sum()).backward()
    drop_in.step(optimizer)
    drop_in.update()


def test_errors_name_a_leaf_by_its_path_and_index_on_every_backend() -> None:
    scaler = ampscale.create_scaler()
    with pytest.raises(TypeError, match=r"\['b'\] \(leaf \[1\] in tree order\)"):
        scaler.unscale({"a": np.ones(2, np.float32), "b": np.ones(2, np.int32)})
    shared = np.ones(10, np.float32)
    with pytest.raises(ampscale.AliasedGradientsError, match=r"\['w'\] \(leaf \[0\].*\['v'\]\[1\] \(leaf \[2\]"):
        scaler.unscale({"w": shared[:6], "v": [np.ones(2, np.float32), shared[4:]]})
    tensor = torch.ones(10)
    with pytest.raises(ampscale.AliasedGradientsError, match=r"\['x'\]\.y \(leaf \[2\]"):
        ampscale.create_scaler("torch").unscale({"a": tensor[:6], "x": _Pair(torch.ones(1), tensor[4:])})
    with pytest.raises(ampscale.AliasedGradientsError, match=r"\['bias'\] \(leaf \[0\]"):
        ampscale.create_scaler("torch").unscale({"bias": torch.ones(1).expand(4)})
    with pytest.raises(TypeError, match=r"\['k'\] \(leaf \[0\]"):
        ampscale.all_finite({"k": np.ones(2, np.int64)})
    with pytest.raises(ValueError, match=r"\['m'\] \(leaf \[1\].*meta"):
        ampscale.diagnose({"a": torch.ones(1), "m": torch.empty(2, device="meta")})
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match=r"\['p'\]\['q'\] \(leaf \[1\]"):
        ampscale.create_scaler("jax").unscale({"a": jnp.ones(2), "p": {"q": jnp.ones(2, jnp.int32)}})


class _Pair:
    """A tree node for the torch backend: a named tuple."""

    def __new__(cls, x: object, y: object) -> object:
        from collections import namedtuple

        return namedtuple("Pair", "x y")(x, y)


@pytest.mark.parametrize("named", [True, False])
def test_the_drop_in_names_a_gradient_by_its_parameter(named: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    params = model.named_parameters() if named else model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = amp_torch.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model[1].weight.grad = torch.ones(1, 2).expand(2, 2)
    before = [p.grad.clone() for p in model.parameters()]
    name = "1.weight" if named else r"param_groups\[0\]\['params'\]\[2\]"
    with pytest.raises(ampscale.AliasedGradientsError, match=name + r" \(leaf \[2\] in tree order\)"):
        scaler.unscale_(optimizer)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def test_meta_tensors_are_refused_before_anything_changes() -> None:
    real = torch.full((3,), 4.0)
    tree = [real, torch.empty(5, device="meta")]
    scaler = ampscale.create_scaler("torch", init_scale=4.0)
    for call in (
        lambda: scaler.unscale(tree),
        lambda: scaler.unscale(tree, underflow=True),
        lambda: scaler.unscale([torch.empty(2, device="meta")]),
        lambda: ampscale.all_finite(tree),
        lambda: ampscale.diagnose(tree),
        lambda: scaler.step(lambda p, g, s: (p, s), [], tree, ()),
    ):
        with pytest.raises(ValueError, match=r"\[1\]|\[0\]") as caught:
            call()
        assert "meta tensor" in str(caught.value)
        assert torch.equal(real, torch.full((3,), 4.0))


@pytest.mark.parametrize("tree", [[None], {"w": None, "b": [None]}, None, (None, None)], ids=repr)
def test_a_tree_of_only_none_gradients_warns(tree: object) -> None:
    scaler = ampscale.create_scaler()
    with pytest.warns(ampscale.AmpscaleWarning, match="backward"):
        _, finite = scaler.unscale(tree)
    assert bool(finite)
    with pytest.warns(ampscale.AmpscaleWarning, match="backward"):
        scaler.step(lambda p, g, s: (p, s), [], tree, ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.unscale([])  # an empty tree is a tree with nothing to do, not a forgotten backward
        scaler.unscale([None, np.ones(1, np.float32)])


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_update_twice_with_one_steps_flag_is_refused(backend: str) -> None:
    if backend == "jax":
        jax = pytest.importorskip("jax")
    scaler = ampscale.create_scaler(backend, growth_interval=2)
    grads = [ampscale.create_scaler(backend).scale(np.float32(1.0) if backend == "numpy" else _one(backend))]
    _, finite = scaler.unscale(grads)
    once = scaler.update(finite)
    with pytest.raises(ValueError, match="count twice"):
        once.update(finite)
    assert once.get_stats()["steps"] == 1  # unchanged
    _, again = once.unscale(grads)  # a new step: its flag is fine, even if it is the same object
    assert once.update(again).get_stats()["steps"] == 2
    assert once.update(True).update(True).update(True).get_stats()["steps"] == 4  # plain bools: no check
    if backend == "jax":

        @jax.jit
        def twice(scaler: ampscale.Scaler, grads: list) -> ampscale.Scaler:
            _, finite = scaler.unscale(grads)
            return scaler.update(finite).update(finite)

        with pytest.raises(ValueError, match="count twice"):
            twice(scaler, grads)


def _one(backend: str) -> object:
    if backend == "torch":
        return torch.ones(2)
    import jax.numpy as jnp

    return jnp.ones(2)


def test_float16_gradients_kept_in_float16_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampscale.backends._base

    monkeypatch.setattr(ampscale.backends._base, "_HALF_KEPT_WARNED", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampscale.create_scaler().unscale([np.ones(2, np.float32)])
        ampscale.create_scaler(grad_dtype="promote").unscale([np.ones(2, np.float16)])
        ampscale.create_scaler(mode="guard").unscale([np.ones(2, np.float16)])
    with pytest.warns(ampscale.AmpscaleWarning, match="grad_dtype='promote'"):
        ampscale.create_scaler().unscale([np.ones(2, np.float32), np.ones(2, np.float16)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampscale.create_scaler().unscale([np.ones(2, np.float16)])  # once per process
    monkeypatch.setattr(ampscale.backends._base, "_HALF_KEPT_WARNED", False)
    with pytest.warns(ampscale.AmpscaleWarning, match="float16 gradients are unscaled in float16 on the torch"):
        ampscale.create_scaler("torch").unscale([torch.ones(2, dtype=torch.float16)])


# ------------------------------------------------------------------------------ section 4: torch's step value


class _Returns(torch.optim.SGD):
    """An optimizer whose step returns a value (as LBFGS, or a closure's loss, do)."""

    def step(self, closure: object = None) -> object:  # type: ignore[override]
        super().step()
        return {"stepped": True}


def _twin_steps(make_optimizer: object, poison: bool, call: object, enabled: bool = True) -> tuple:
    out = []
    for cls in (torch.amp.GradScaler, amp_torch.GradScaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = make_optimizer(model.parameters())
        scaler = cls("cpu", enabled=enabled)
        loss = model(torch.ones(2, 3)).pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            model.weight.grad[0, 0] = float("nan")
        out.append(call(scaler, optimizer, model))
        scaler.update()
    return tuple(out)


STEP_CASES = {
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.1), lambda s, o, m: s.step(o)),
    "value": (lambda p: _Returns(p, lr=0.1), lambda s, o, m: s.step(o)),
    "closure": (
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda s, o, m: s.step(o, lambda: m(torch.ones(2, 3)).pow(2).mean()),
    ),
    "fused Adam": (lambda p: torch.optim.Adam(p, lr=0.1, fused=True), lambda s, o, m: s.step(o)),
    "unscale first": (lambda p: _Returns(p, lr=0.1), lambda s, o, m: (s.unscale_(o), s.step(o))[1]),
}


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "skipped"])
@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_step_returns_exactly_what_torchs_returns(case: str, poison: bool, enabled: bool) -> None:
    make_optimizer, call = STEP_CASES[case]
    theirs, ours = _twin_steps(make_optimizer, poison, call, enabled)
    assert type(ours) is type(theirs)
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs)
    else:
        assert ours == theirs
    if not poison or not enabled:
        assert theirs is not None or case in ("SGD", "fused Adam")


def test_the_step_outcome_is_kept_on_the_scaler() -> None:
    scaler = amp_torch.GradScaler("cpu")
    assert scaler.last_step is None
    assert _train_step(scaler) is None
    assert scaler.last_step.applied is True
    assert _train_step(scaler, poison=True) is None
    assert scaler.last_step.applied is False
    assert float(scaler.last_step.found_inf) == 1.0
    copied = pickle.loads(pickle.dumps(scaler))
    assert copied.last_step is None  # an outcome of this process's steps
    fused = amp_torch.GradScaler("cpu")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    fused.scale(model(torch.ones(1, 2)).sum()).backward()
    assert fused.step(optimizer) is None
    assert isinstance(fused.last_step.applied, torch.Tensor)  # on the device: no sync
    assert bool(fused.last_step.applied)
    assert math.isfinite(fused.get_scale())
