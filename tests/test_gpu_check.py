"""``scripts/gpu-check.sh`` (``scripts/gpu_check.py``): its plan fits the GPU machine's limits, and a
dry run here (no GPU: the GPU stages skip, with their reason) installs nothing from an index and
writes only the files that come back from that machine (at most 8, two folders deep)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: what comes back from the GPU machine's $OUT (the device README's limits)
MAX_FILES, MAX_DEPTH, MAX_BYTES = 8, 2, 16 << 20
SEVEN_MINUTES = 420


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_every_stage_has_a_limit_and_together_they_fit_seven_minutes() -> None:
    check = load_check()
    plan = check.plan()
    names = [s["name"] for s in plan["stages"]]
    assert {"wheels", "imports", "build", "gpu-tests", "bench", "jax-tests", "jax-bench"} <= set(names)
    assert all(s["limit"] > 0 for s in plan["stages"])
    assert plan["sum_of_limits"] == sum(s["limit"] for s in plan["stages"])
    assert plan["sum_of_limits"] <= plan["total_limit"] <= SEVEN_MINUTES
    # a margin for the script's own start and end, and the copies back (scripts/gpu_check.py)
    assert plan["margin"] >= 30
    assert plan["sum_of_limits"] <= plan["total_limit"] - plan["margin"]
    limits = {s["name"]: s["limit"] for s in plan["stages"]}
    for stage, per_test in plan["per_test_limit"].items():
        assert per_test <= limits[stage] / 2, stage  # a hang is named, not the stage killed
    assert len(plan["output_files"]) <= 2
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in plan["output_files"])
    assert "array_api_compat" in plan["required_imports"]


def _tree_copy(target: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns(
        ".git", ".whl", "build", "dist", "*.so", "__pycache__", ".*cache", ".hypothesis", "site", "*.egg-info"
    )
    shutil.copytree(ROOT, target, ignore=ignore)
    return target


def _tiny_wheel(directory: pathlib.Path) -> pathlib.Path:
    """A pure-Python wheel made here (nothing downloaded), carried in ``.whl/`` as the GPU run would."""
    directory.mkdir()
    path = directory / "ampscale_carried_probe-1.0-py3-none-any.whl"
    info = "ampscale_carried_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("ampscale_carried_probe.py", "CARRIED = True\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: ampscale-carried-probe\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.skipif(
    not (ROOT / "setup.py").exists() or not (ROOT / "ampscale").is_dir(),
    reason="needs the source tree (the script builds the extensions in place); this is an installed copy",
)
def test_a_dry_run_installs_nothing_from_an_index_and_writes_two_files(tmp_path: pathlib.Path) -> None:
    tree = _tree_copy(tmp_path / "tree")
    _tiny_wheel(tree / ".whl")
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        {
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # any index access would fail
            "PIP_NO_INDEX": "1",
            "GPU_CHECK_SITE": str(tmp_path / "site"),
            "AMPSCALE_CACHE_DIR": str(tmp_path / "cache"),
            "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p),
        }
    )
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", str(out), "--dry-run"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["gpu-check.json", "gpu-check.log"]
    assert len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) <= MAX_DEPTH + 1 and p.stat().st_size <= MAX_BYTES for p in files)
    report = json.loads((out / "gpu-check.json").read_text())
    log = (out / "gpu-check.log").read_text()
    stages = {s["name"]: s for s in report["stages"]}
    plan = report["plan"]
    assert [s["name"] for s in plan["stages"]] == list(stages)  # every stage ran or said why not
    assert plan["sum_of_limits"] <= SEVEN_MINUTES
    for name, stage in stages.items():
        assert stage["status"] in ("passed", "skipped"), (name, stage)
        if stage["status"] == "skipped":
            assert stage.get("reason"), name
    for name in ("gpu-tests", "bench", "jax-tests", "jax-bench"):
        if shutil.which("nvidia-smi") is None:
            assert stages[name]["status"] == "skipped"
            assert "no GPU" in stages[name]["reason"]
    assert stages["wheels"]["status"] == "passed"
    assert stages["wheels"]["wheels"] == ["ampscale_carried_probe-1.0-py3-none-any.whl"]
    assert (tmp_path / "site" / "ampscale_carried_probe.py").exists()
    assert stages["build"]["status"] == "passed"
    for witness in ("nvidia-smi", "torch", "cupy", "jax"):  # who sees a GPU, each answer logged
        assert f"GPU seen by {witness}: " in log
    pip_lines = [line for line in log.splitlines() if " -m pip " in line]
    assert pip_lines
    assert all("--no-index" in line for line in pip_lines)
    assert not re.search(r"^(Collecting|Downloading|Looking in indexes)", log, re.MULTILINE)
    assert "--timeout=" in " ".join(stages["gpu-tests"].get("command", ["--timeout="]))


# ------------------------------------------------------------------------------ decisions, without a GPU


def test_a_gpu_is_there_when_any_witness_sees_one_and_no_gpu_says_why() -> None:
    check = load_check()
    facts = {"torch_cuda": True, "cupy_devices": 1, "jax_backend": "gpu", "why_no_gpu": {}}
    witnesses = check.gpu_witnesses("timed out after 10 s", facts)  # a slow nvidia-smi decides nothing
    assert witnesses["nvidia-smi"] == "timed out after 10 s"
    assert check.no_gpu_reason(witnesses) == ""
    blind = {
        "torch_cuda": False,
        "cupy_devices": 0,
        "jax_backend": "cpu",
        "why_no_gpu": {"torch": "torch.cuda.is_available() is False", "cupy": "ImportError: no cupy"},
    }
    reason = check.no_gpu_reason(check.gpu_witnesses("not installed", blind))
    assert reason.startswith("no GPU here")
    for said in ("nvidia-smi: not installed", "torch.cuda.is_available() is False", "no cupy", "jax"):
        assert said in reason
    assert check.no_gpu_reason(check.gpu_witnesses(None, blind)) == ""  # nvidia-smi alone sees one


class _Machine:
    """What the commands of a run answer, without running them: a GPU that nvidia-smi is too slow
    to report, torch, CuPy and JAX that see it, and an extension that did not build."""

    def __init__(self, facts: dict, broken: set[str]) -> None:
        self.facts = facts
        self.broken = broken
        self.commands: list[list[str]] = []

    def run(self, runner, command, limit, label=None):  # the signature of gpu_check.Run.run
        runner.say(f"$ {label or ' '.join(command)}")
        self.commands.append(list(command))
        joined = " ".join(command)
        if command[0].endswith("nvidia-smi"):
            return None, ""  # killed at its limit
        if "FACTS" in joined and "required" in joined:
            return 0, "FACTS " + json.dumps(self.facts)
        if "FACTS" in joined:
            return 0, "FACTS {}"
        for name in self.broken:
            if f"import {name};" in joined:
                return 1, f"ModuleNotFoundError: No module named {name!r}"
        return 0, ""

    def ran(self, program: str) -> list[list[str]]:
        """The commands that ran ``program`` (``pytest``: ``python -m pytest``; or a script)."""
        return [c for c in self.commands if program in c or (c[1:3] == ["-m", program])]


def _run_main(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, machine: _Machine):
    check = load_check()
    monkeypatch.setattr(check.Run, "run", lambda self, *a, **k: machine.run(self, *a, **k))
    real_which = shutil.which
    monkeypatch.setattr(
        check.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else real_which(name)
    )
    status = check.main([str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    return status, report, (tmp_path / "out" / "gpu-check.log").read_text()


SEEN = {
    "modules": dict.fromkeys(load_check().REQUIRED, "1"),
    "torch_cuda": True,
    "cupy_devices": 1,
    "jax_backend": "gpu",
    "why_no_gpu": {},
}


def test_a_slow_nvidia_smi_skips_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    machine = _Machine(SEEN, set())
    status, report, log = _run_main(monkeypatch, tmp_path, machine)
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["machine"]["status"] == "skipped"
    assert "timed out" in stages["machine"]["reason"]
    for name in ("gpu-tests", "bench", "jax-tests", "jax-bench"):
        assert stages[name]["status"] == "passed", (name, stages[name])
    assert "no GPU here" not in log
    assert status == 0


def test_a_missing_extension_skips_only_the_stages_that_need_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    machine = _Machine(SEEN, {"ampscale._native.cuda._driver"})
    status, report, log = _run_main(monkeypatch, tmp_path, machine)
    stages = {s["name"]: s for s in report["stages"]}
    assert "stopped" not in report
    assert stages["build"]["status"] == "failed"
    assert stages["build"]["missing"] == ["ampscale._native.cuda._driver"]
    assert [line for line in log.splitlines() if line.startswith("MISSING:")] == [
        "MISSING: ampscale._native.cuda._driver (the CUDA launcher) did not build or import; "
        "needed by: torch CUDA, the JAX CUDA custom call"
    ]
    (tests,) = machine.ran("pytest")  # CuPy's GPU tests still run, torch's (which need it) do not
    assert tests[tests.index("-k") + 1] == "not torch"
    (bench,) = machine.ran("benchmarks/run.py")
    # CuPy's rows, and the FP8 pass's (whose rows count their launches: a torch row without the
    # launcher shows the fallback's)
    assert bench[bench.index("--backends") + 1] == "cupy,fp8"
    assert bench[bench.index("--workloads") + 1] == "W0,W1,W1h,W2,N,FP8-W1"
    for name in ("jax-tests", "jax-bench"):
        assert stages[name]["status"] == "skipped"
        assert "ampscale._native.cuda._driver" in stages[name]["reason"]
    assert status == 1  # the build failed: the run says so


def test_without_the_numpy_kernel_every_stage_runs_and_its_warning_is_no_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    machine = _Machine(SEEN, {"ampscale._native.cpu._numpy"})
    _, report, log = _run_main(monkeypatch, tmp_path, machine)
    stages = {s["name"]: s for s in report["stages"]}
    for name in ("gpu-tests", "bench", "jax-tests", "jax-bench"):
        assert stages[name]["status"] == "passed", (name, stages[name])
    for command in machine.ran("pytest"):
        assert command[command.index("-W") + 1] == load_check().NO_NUMPY_KERNEL_FILTER
    assert "needed by: no stage" in log


def test_the_wheels_carried_are_checked_against_the_one_pin(tmp_path: pathlib.Path) -> None:
    """scripts/gpu-wheels.txt is the one place that pins the carried wheels: gpu-wheels.sh
    downloads what it lists, the test environment is constrained by it, and the check names a
    carried wheel of another version."""
    check = load_check()
    pins = check.pinned_wheels()
    assert pins
    assert all(re.fullmatch(r"\d+(\.\d+)+", version) for version in pins.values())  # exact versions
    assert "array_api_compat" in pins
    script = (ROOT / "scripts" / "gpu-wheels.sh").read_text()
    assert "-r scripts/gpu-wheels.txt" in script
    assert not re.search(r"array-api-compat==", script)  # no second pin
    assert "-c scripts/gpu-wheels.txt" in (ROOT / "requirements-test.txt").read_text()
    version = pins["array_api_compat"]
    assert check.compare_wheels(pins, [f"/w/array_api_compat-{version}-py3-none-any.whl"]) == {
        f"array_api_compat=={version}": "carried"
    }
    assert check.compare_wheels(pins, ["/w/array_api_compat-0.1-py3-none-any.whl"]) == {
        f"array_api_compat=={version}": "other version 0.1"
    }
    assert check.compare_wheels(pins, []) == {f"array_api_compat=={version}": "missing"}
