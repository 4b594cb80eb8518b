"""Random training programs run side by side on ``torch.amp.GradScaler`` and the drop-in.

Hypothesis draws the settings and a sequence of actions (steps with infs or NaNs injected,
``unscale_`` + clipping before ``step``, ``update(new_scale)``, setters, a second optimizer,
checkpoints cross-loaded between the two classes, and misuse that must raise). After every
action both sides must agree: the same exception type or none, bitwise equal parameters,
the same scale, growth tracker and ``state_dict``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ampscale.torch as amp_torch  # noqa: E402

SETTINGS = st.fixed_dictionaries(
    {},
    optional={
        "init_scale": st.sampled_from([1.0, 3.0, 2.0**10, 1e4, 2.0**16, 2.0**100, 2.0**126]),
        "growth_factor": st.sampled_from([2.0, 1.5, 3.0, 1.0001]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.3, 0.9999]),
        "growth_interval": st.integers(1, 4),
        "enabled": st.sampled_from([True, True, True, False]),
    },
)

SETTERS = ["growth_factor", "backoff_factor", "growth_interval"]
MISUSES = ["unscale_twice", "step_twice", "update_twice", "unscale_after_step", "closure", "scale_tree"]
ACTION = st.one_of(
    st.tuples(st.just("step"), st.sampled_from([None, "inf", "-inf", "nan", "loss-inf"]), st.booleans()),
    st.tuples(st.just("update"), st.sampled_from([1.0, 2.0**5, 0.375, 7e3]), st.booleans()),
    st.tuples(st.just("set"), st.sampled_from(SETTERS), st.integers(1, 3)),
    st.tuples(st.just("checkpoint"), st.booleans(), st.none()),
    st.tuples(
        st.just("misuse"),
        st.sampled_from(MISUSES),
        st.none(),
    ),
)


class Side:
    """One model, two optimizers and a scaler of one class."""

    def __init__(self, scaler_class: Any, config: dict) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        first, second = list(self.model[0].parameters()), list(self.model[2].parameters())
        self.optimizers = [torch.optim.SGD(first, lr=0.05, momentum=0.9), torch.optim.Adam(second, lr=1e-2)]
        self.scaler = scaler_class("cpu", **config)

    def step(self, x: Any, y: Any, inject: str | None, clip: bool) -> None:
        for opt in self.optimizers:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        if inject == "loss-inf":
            loss = loss * float("inf")
        self.scaler.scale(loss).backward()
        if inject in ("inf", "-inf", "nan"):
            self.model[2].weight.grad[1, 2] = float(inject)
        if clip:
            self.scaler.unscale_(self.optimizers[0])
            torch.nn.utils.clip_grad_norm_(self.model[0].parameters(), 0.5)
        for opt in self.optimizers:
            self.scaler.step(opt)
        self.scaler.update()

    def act(self, action: tuple, x: Any, y: Any) -> None:
        kind, a, b = action
        if kind == "step":
            self.step(x, y, a, b)
        elif kind == "update":
            self.scaler.update(torch.tensor(a) if b else a)
        elif kind == "set":
            value = {"growth_factor": 1.0 + b, "backoff_factor": 1.0 / (b + 1), "growth_interval": b}[a]
            getattr(self.scaler, f"set_{a}")(value)
        elif kind == "misuse":
            self.misuse(a, x, y)

    def misuse(self, what: str, x: Any, y: Any) -> None:
        opt = self.optimizers[0]
        for o in self.optimizers:
            o.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        try:
            if what == "unscale_twice":
                self.scaler.unscale_(opt)
                self.scaler.unscale_(opt)
            elif what == "step_twice":
                self.scaler.step(opt)
                self.scaler.step(opt)
            elif what == "unscale_after_step":
                self.scaler.step(opt)
                self.scaler.unscale_(opt)
            elif what == "closure":
                self.scaler.step(opt, closure=lambda: loss)
            elif what == "scale_tree":
                outputs = self.scaler.scale({"a": loss, "b": [loss * 2, (loss * 3, loss * float("inf"))]})
                assert isinstance(outputs, dict)
                assert isinstance(outputs["b"][1], tuple)
                self.scaler.unscale_(opt)
            else:
                self.scaler.update()
                self.scaler.update()
        finally:
            self.scaler.update()  # leave both sides in a clean state for the next action


def _get(scaler: Any, getter: str) -> Any:
    try:
        return getattr(scaler, getter)()
    except AttributeError as exc:  # torch's disabled scaler keeps no settings
        return type(exc)


def _raised(function: Any, *args: Any) -> type | None:
    try:
        function(*args)
    except Exception as exc:  # compared by type with the other side
        return type(exc)
    return None


def _agree(ours: Side, theirs: Side, where: str) -> None:
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        assert _get(ours.scaler, getter) == _get(theirs.scaler, getter), f"{where}: {getter}"
    assert ours.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker(), where
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), where
    assert ours.scaler.is_enabled() == theirs.scaler.is_enabled(), where
    assert ours.scaler.state_dict() == theirs.scaler.state_dict(), where
    for a, b in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), where  # NaNs too, bit for bit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=SETTINGS, actions=st.lists(ACTION, min_size=1, max_size=14), seed=st.integers(0, 2**16))
def test_random_programs_match_torch_grad_scaler(config: dict, actions: list, seed: int) -> None:
    ours, theirs = Side(amp_torch.GradScaler, config), Side(torch.amp.GradScaler, config)
    generator = torch.Generator().manual_seed(seed)
    for index, action in enumerate(actions):
        x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)
        if action[0] == "checkpoint":
            # each side continues from the other's checkpoint (or its own, reloaded)
            source_ours, source_theirs = (theirs, ours) if action[1] else (ours, theirs)
            saved_for_ours, saved_for_theirs = source_ours.scaler.state_dict(), source_theirs.scaler.state_dict()
            ours.scaler = amp_torch.GradScaler("cpu")
            theirs.scaler = torch.amp.GradScaler("cpu")
            got = _raised(ours.scaler.load_state_dict, saved_for_ours)
            want = _raised(theirs.scaler.load_state_dict, saved_for_theirs)
        else:
            got, want = _raised(ours.act, action, x, y), _raised(theirs.act, action, x, y)
        assert got == want, f"action {index}: {action}: raised {got}, torch raised {want}"
        _agree(ours, theirs, f"action {index}: {action}")


def test_disabled_scaler_settings_behave_like_torch() -> None:
    """Disabled, torch keeps no settings: getters raise until a setter stores a value, unchecked."""
    for scaler in (amp_torch.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=False)):
        with pytest.raises(AttributeError):
            scaler.get_growth_factor()
        scaler.set_growth_factor(0.5)  # no check: it is never used
        scaler.set_growth_interval(3)
        assert scaler.get_growth_factor() == 0.5
        assert scaler.get_growth_interval() == 3
        assert scaler.state_dict() == {}
        assert scaler.get_scale() == 1.0
