"""The benchmark command runs for every installed backend and reports every row (a smoke run:
the figures themselves are never asserted, since this machine is shared and noisy)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import types

import pytest

RUN = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
INSTALLED = [name for name in ("numpy", "torch", "jax") if importlib.util.find_spec(name) is not None]


def test_every_installed_backend_reports_its_rows(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "results.json"
    command = [sys.executable, str(RUN), "--quick", "--workloads", "W0", "--json", str(out)]
    done = subprocess.run(
        [*command, "--backends", ",".join(INSTALLED)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert {row["backend"] for row in rows} == {"limit", *INSTALLED}
    assert all(row["workload"] == "W0" for row in rows)
    assert all(math.isfinite(row["seconds"]) and row["seconds"] > 0 for row in rows)
    for backend in INSTALLED:  # ampscale's own row and at least one anchor to compare with
        names = [row["name"] for row in rows if row["backend"] == backend]
        assert any(name.startswith("ampscale") for name in names), names
        if backend != "jax" or importlib.util.find_spec("jmp") is not None:  # jax's anchor is jmp
            assert any(row["anchor"] for row in rows if row["backend"] == backend), names
    assert "x best anchor" in done.stdout  # the printed table


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--workloads", "W9", "unknown workload"), ("--backends", "fortran", "unknown or not installed backend")],
)
def test_bad_options_are_named(option: str, value: str, message: str) -> None:
    done = subprocess.run([sys.executable, str(RUN), option, value], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert message in done.stderr
    assert value in done.stderr


def test_shared_data_keeps_its_magnitude_through_a_measurement() -> None:
    """Cases share their arrays and each step multiplies them by one of the alternating scales:
    through the untimed and timed steps of many cases and rounds, the shared data stays within
    one factor of 16 and every run of a case leaves it where it found it."""
    sys.path.insert(0, str(RUN.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUN.parent))
    shared, other = [1.0], [1.0]
    seen = []

    def stepper(value: list) -> object:
        def step(i: int) -> None:
            value[0] *= run.SCALES[i % 2]
            seen.append(shared[0])

        return step

    cases = [run.Case("numpy", "W0", f"shared {k}", stepper(shared), 1) for k in range(3)]
    cases += [run.Case("torch", "W0", f"other {k}", stepper(other), 1) for k in range(2)]
    run.measure(cases, steps=2, rounds=9)
    assert min(seen) >= 1 / 16
    assert max(seen) <= 16
    assert shared == [1.0]
    assert other == [1.0]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the per-call rows are torch's")
def test_per_call_rows_compare_each_call_with_torchs(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "calls.json"
    command = [sys.executable, str(RUN), "--quick", "--workloads", "N", "--backends", "numpy,torch", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    rows = [row for row in json.loads(out.read_text()) if row["backend"] == "torch"]
    assert {row["backend"] for row in json.loads(out.read_text())} == {"limit", "torch"}  # numpy has no N rows
    for call in ("scale", "unscale_", "step", "update"):
        group = [row for row in rows if row["group"] == call]
        assert sorted(row["name"] for row in group) == [
            f"ampscale.torch.GradScaler.{call}",
            f"torch.amp.GradScaler.{call}",
        ]
        assert [row["anchor"] for row in group if row["name"].startswith("torch")] == [True]
        assert all(math.isfinite(row["seconds"]) and 0 < row["seconds"] < 0.1 for row in group)


def _run_module() -> types.ModuleType:
    """``benchmarks/run.py``, imported as its row modules import it."""
    sys.path.insert(0, str(RUN.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUN.parent))
    return run


def test_fp8_workloads_run_alone_with_every_group_and_its_anchor(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--workloads FP8`` runs the FP8 bookkeeping rows alone (small shapes here: a smoke run),
    each group of ampscale rows beside its anchor, read speeds noted against L's."""
    run = _run_module()
    monkeypatch.setitem(run.WORKLOADS, "FP8-W1", ([(64, 48), (48,), (7,)], "float32"))
    monkeypatch.setitem(run.WORKLOADS, "FP8-W2", ([(256,)] * 20, "float32"))
    out = tmp_path / "results.json"
    assert run.main(["--quick", "--workloads", "FP8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {row["workload"] for row in rows} == {"FP8-W1", "FP8-W2"}
    assert {row["backend"] for row in rows} == {"limit", "fp8"}
    for workload in ("FP8-W1", "FP8-W2"):
        mine = [r for r in rows if r["workload"] == workload and r["backend"] == "fp8"]
        groups = {r["group"] for r in mine if r["name"].startswith("ampscale")}
        assert "amax" in groups
        for group in groups:  # every group of ampscale rows has an anchor, where its package is installed
            if group in ("torchao", "flax") and importlib.util.find_spec(group) is None:
                continue
            assert any(r["anchor"] and r["group"] == group for r in mine), (workload, group)
        assert all(r["moved"] == sum(4 * math.prod(s) for s in run.WORKLOADS[workload][0]) for r in mine)
    assert "reads at" in capsys.readouterr().out


def test_the_targets_compare_rows_of_one_run_and_say_met_or_not() -> None:
    run = _run_module()
    result = run.Result
    rows = [
        result("limit", "W2", "L: torch mul_ (2 threads)", 1.0e-3, 65_536_000, limit=True),
        result("torch", "W2", "ampscale torch (unscale + update)", 1.5e-3, 65_536_000),
        result("torch", "W2", "torch.amp.GradScaler", 3.3e-3, 65_536_000, anchor=True),
        result("numpy", "W1h", "ampscale numpy", 14e-3, 497_759_232),
        result("torch", "W1h", "ampscale torch (unscale + update)", 12e-3, 497_759_232),
        result("numpy", "W0", "ampscale numpy", 25e-6, 8192),
    ]
    assert run.targets_report(rows) == [
        "numpy W0: ampscale numpy 25.0 us (target <= 20 us): NOT met",
        "torch W2: ampscale torch (unscale + update) 2.20x torch.amp.GradScaler (target >= 2x): met",
        "torch W2: ampscale torch (unscale + update) 0.67 L (target >= 0.6 L): met",
        "torch W1h: ampscale torch (unscale + update) 1.17x ampscale numpy (target >= 1x): met",
    ]


def test_the_chart_is_drawn_from_a_runs_json(tmp_path: pathlib.Path) -> None:
    chart = RUN.parent / "chart.py"
    out = tmp_path / "chart.png"
    done = subprocess.run(
        [sys.executable, str(chart), str(RUN.parent / "cpu-results.json"), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "torch.amp.GradScaler" in done.stdout
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    done = subprocess.run([sys.executable, str(chart), str(empty), str(out)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "no CPU rows of W1, W1h or W2" in done.stderr


def test_the_charts_json_holds_the_rows_the_page_shows() -> None:
    """benchmarks/cpu-results.json and the page's table are the same run: a new run replaces both."""
    rows = json.loads((RUN.parent / "cpu-results.json").read_text())
    page = (RUN.parent / "README.md").read_text()
    table = page.split("### All rows", 1)[1].split("\n\n", 2)[1]
    shown = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert len(shown) == len(rows)
    for cells, row in zip(shown, rows, strict=True):
        backend, workload, name, time = cells[:4]
        assert (backend, workload, name.removesuffix(" (anchor)")) == (row["backend"], row["workload"], row["name"])
        assert name.endswith(" (anchor)") == row["anchor"]
        ms = row["seconds"] * 1e3  # the run's JSON keeps the time the table shows rounded
        assert time == (f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f}"), cells
