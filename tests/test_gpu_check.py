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
    pip_lines = [line for line in log.splitlines() if " -m pip " in line]
    assert pip_lines
    assert all("--no-index" in line for line in pip_lines)
    assert not re.search(r"^(Collecting|Downloading|Looking in indexes)", log, re.MULTILINE)
    assert "--timeout=" in " ".join(stages["gpu-tests"].get("command", ["--timeout="]))
