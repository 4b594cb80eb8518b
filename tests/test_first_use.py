"""What a new user meets first: the command line, ``ampscale.info()``, and clear first mistakes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import ampscale
from ampscale.__main__ import main


def test_usage_names_every_command_and_the_version_flag(capsys) -> None:
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for text in ("demo", "info", "--version"):
        assert text in usage
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == ampscale.__version__
    assert main([]) == 2
    assert main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_info_reports_each_backend_as_installed_usable_or_what_to_do() -> None:
    facts = ampscale.info()
    json.dumps(facts)  # plain values
    assert facts["ampscale"] == ampscale.__version__
    assert list(facts["backends"]) == ["numpy", "torch", "jax", "cupy"]
    numpy_facts = facts["backends"]["numpy"]
    assert numpy_facts["usable"]
    assert numpy_facts["devices"] == ["cpu"]
    assert "kernel" in numpy_facts["details"]
    for name, backend in facts["backends"].items():
        installed = importlib.util.find_spec(name) is not None
        assert backend["installed"] is installed, name
        if backend["usable"]:
            assert backend["devices"]
            assert backend["problem"] is None
            assert backend["fix"] is None
        else:
            assert backend["problem"], name
            assert backend["fix"], name
        if not installed:
            assert backend["problem"].endswith("is not installed")
            assert f"pip install 'ampscale[{name}]'" in backend["fix"]
    with pytest.raises(ValueError, match="tensorflow"):
        ampscale.info(["tensorflow"])


def _cupy_without_a_driver() -> types.ModuleType:
    """A module that fails as CuPy does on a machine whose driver is older than its runtime."""

    class CUDARuntimeError(RuntimeError):
        pass

    def get_device_count() -> int:
        raise CUDARuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
        )

    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.__version__ = "13.6.0"
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    return cupy


def test_info_says_cupy_is_not_usable_when_its_driver_is_missing(monkeypatch, capsys) -> None:
    """CuPy imports without a working driver; ``info`` must not call it usable, and the demo
    must say so in one line instead of dying with ``cudaErrorInsufficientDriver``."""
    monkeypatch.setitem(sys.modules, "cupy", _cupy_without_a_driver())
    cupy = ampscale.info(["cupy"])["backends"]["cupy"]
    assert cupy["installed"]
    assert not cupy["usable"]
    assert cupy["devices"] == []
    assert "cudaErrorInsufficientDriver" in cupy["problem"]
    assert "driver" in cupy["fix"]

    from ampscale import demo

    assert demo.main(["--backend", "cupy", "--no-plot"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "--backend cupy" in lines[0]
    assert "cudaErrorInsufficientDriver" in lines[0]
    assert "fix:" in lines[0]


def test_info_command_prints_the_facts(capsys) -> None:
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert main(["info"]) == 0
    text = capsys.readouterr().out.strip()
    assert text == ampscale._info.format_info(facts)
    assert text.splitlines()[0] == f"ampscale {ampscale.__version__} (Python {facts['python']}, {facts['platform']})"
    assert "numpy: usable on cpu" in text
    assert "kernel:" in text
    if not facts["backends"]["cupy"]["installed"]:
        assert "cupy: not installed; to install: pip install 'ampscale[cupy]'" in text
    assert main(["info", "--yaml"]) == 2


def test_python_m_ampscale_runs_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ampscale", "--version"], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ampscale.__version__


@pytest.mark.parametrize("loss", [0.5, 1, True])
def test_a_python_number_as_the_loss_says_what_to_pass(loss) -> None:
    scaler = ampscale.create_scaler()
    message = r"loss must be an array of your framework .* not a Python (float|int|bool)"
    with pytest.raises(TypeError, match=message):
        scaler.scale(loss)
    with pytest.raises(TypeError, match=message):
        scaler.unscale([np.ones(2, np.float32)], loss=loss)
    assert scaler.state is None  # nothing changed
    assert float(scaler.scale(np.float64(0.5))) == 32768.0  # NumPy scalars are arrays


def test_outcome_reason_is_a_code_on_the_device_and_a_name_on_the_host() -> None:
    scaler = ampscale.create_scaler()
    assert scaler.outcome.to_dict()["reason"] == "no step yet"
    cases = [
        (np.float32(1.0), np.ones(2, np.float32), 0, "applied"),
        (np.float32(np.inf), np.ones(2, np.float32), 1, "loss"),
        (np.float32(1.0), np.array([1.0, np.nan], np.float32), 2, "gradients"),
    ]
    for loss, grad, code, name in cases:
        _, _, scaler = scaler.step(lambda p, g, s: (p, s), [], [grad], (), loss=loss)
        assert int(scaler.outcome.reason) == code
        assert scaler.outcome.to_dict()["reason"] == name == ampscale.StepOutcome.reason_name(code)


@pytest.mark.parametrize("args", [["info"], ["--help"], ["info", "--json"]], ids=" ".join)
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(args: list[str]) -> None:
    """``python -m ampscale info | head -1``: the reader has gone when the command writes; it ends
    as Unix tools do (the status a shell gives a process SIGPIPE ended), with no traceback."""
    from ampscale.__main__ import CLOSED_PIPE

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write fails
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ampscale", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == CLOSED_PIPE
