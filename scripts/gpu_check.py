"""Every GPU check of ampscale in one command, within 7 minutes on a cold cache (run by gpu-check.sh).

The stages, each with a time limit (:data:`STAGES`; their sum is at most :data:`TOTAL_LIMIT`,
and no stage runs past the deadline):

1. ``machine``: what ``nvidia-smi`` sees;
2. ``wheels``: the pure-Python packages the GPU image lacks, carried as wheels in ``.whl/``
   (``bash scripts/gpu-wheels.sh`` downloads them), installed with ``pip --no-index`` into
   ``$GPU_CHECK_SITE`` (default ``/tmp/ampscale-site``, put first on ``PYTHONPATH``): nothing is
   ever fetched from a package index (``PIP_NO_INDEX`` is set for every stage too);
3. ``imports``: every module the checks need, imported first; a missing one stops the run with
   one line that names it (and says how to carry it);
4. ``build``: the C extensions, built in place, then imported (``setup.py`` never fails a build,
   so a broken one is caught here, with one line);
5. ``preflight``: versions, whether the one-launch CUDA step and the JAX CUDA custom call load;
6. ``gpu-tests``: the tests marked ``gpu`` (one-launch CUDA step, CuPy, torch CUDA, the drop-in
   on CUDA, the fused FP8 pass, the shared contract tests on the GPU frameworks), each test under a limit well
   below the stage's;
7. ``bench``: the GPU benchmark (``benchmarks/run.py --gpu-only``: torch CUDA, CuPy, the
   drop-in's ``update()``, the FP8 pass on W1: amax + cast against a copy of the same bytes),
   and the issues' targets read from it;
8. ``jax-tests``, 9. ``jax-bench``: JAX on the GPU (the CUDA custom call against XLA:GPU, and
   W1 beside torch's fused kernel, and W2);
10. ``report``: the targets.

Output: exactly two files in the output directory, ``gpu-check.log`` (everything printed) and
``gpu-check.json`` (each stage's limit, time, status and reason, the tests that failed, the
benchmark rows and the targets), rewritten after every stage so that a run cut short still
says how far it got. Scratch files go to a temporary directory.

``--dry-run``: on a machine without a GPU, the GPU stages are skipped with their reason and a
missing GPU-only package is reported instead of stopping the run (exit status 0 when every
stage that ran passed). ``--plan``: print the stages and their limits as JSON, run nothing.

Usage: ``python3 scripts/gpu_check.py [OUT] [--dry-run | --plan]`` (``OUT`` defaults to
``$OUT``, else ``gpu-check-output``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the whole run, seconds (7 minutes): no stage runs past it, and the limits below add up to it
TOTAL_LIMIT = 420
#: pytest-timeout's limit for one test, per test stage: well below the stage's own limit, so a
#: hang is named instead of the stage being killed with no summary
PER_TEST_LIMIT = {"gpu-tests": 45, "jax-tests": 25}
#: xdist workers per test stage (16 cores on the GPU machine; every worker holds a CUDA context)
WORKERS = {"gpu-tests": 8, "jax-tests": 4}
#: the only files written to the output directory
OUTPUT_FILES = ("gpu-check.log", "gpu-check.json")
#: imports every GPU run needs; a missing one stops the run (the wheels stage can carry them)
REQUIRED = (
    "numpy",
    "array_api_compat",
    "array_api_compat.torch",  # what the torch and CuPy backends import on their GPU paths
    "array_api_compat.cupy",
    "ml_dtypes",
    "hypothesis",
    "pytest",
    "xdist",
    "pytest_timeout",
    "torch",
    "cupy",
    "jax",
)
#: optional: tests and benchmarks that need them skip
OPTIONAL = ("jmp", "array_api_strict", "flax", "optax")
GPU_TEST_FILES = (
    "tests/test_cuda_gpu.py",
    "tests/test_cupy.py",
    "tests/test_scaler.py",
    "tests/test_overflow_detection.py",
    "tests/test_reliability.py",
    "tests/test_torch.py",
    "tests/test_examples.py",
    "tests/test_docs.py",
    "tests/test_in_place.py",
    "tests/test_fp8_fused_gpu.py",
)
JAX_TEST_FILES = ("tests/test_jax_cuda_gpu.py", "tests/test_scaler.py", "tests/test_overflow_detection.py")


@dataclasses.dataclass
class Stage:
    """One stage: its name, its time limit in seconds, whether it needs a GPU, what it does."""

    name: str
    limit: int
    gpu: bool
    does: str


STAGES = (
    Stage("machine", 5, False, "nvidia-smi: the GPU, its driver and memory"),
    Stage("wheels", 15, False, "pip install --no-index the wheels carried in .whl/ (nothing from an index)"),
    Stage("imports", 40, False, "import every module the checks need; stop with one line if one is missing"),
    Stage("build", 60, False, "setup.py build_ext --inplace, then import the built extensions"),
    Stage("preflight", 25, False, "versions; whether the one-launch CUDA step and the JAX custom call load"),
    Stage("gpu-tests", 120, True, "pytest -m gpu: CUDA step, CuPy, torch CUDA, drop-in, contract tests"),
    Stage("bench", 60, True, "benchmarks/run.py --gpu-only (torch CUDA, CuPy, the drop-in's update, FP8 W1)"),
    Stage("jax-tests", 50, True, "JAX on the GPU: the CUDA custom call against XLA:GPU, contract tests"),
    Stage("jax-bench", 35, True, "JAX GPU benchmark: W1 beside torch's fused kernel, and W2"),
    Stage("report", 10, False, "the targets, read from the benchmark rows"),
)


def plan() -> dict[str, Any]:
    """The stages and limits (what ``--plan`` prints)."""
    return {
        "total_limit": TOTAL_LIMIT,
        "sum_of_limits": sum(s.limit for s in STAGES),
        "per_test_limit": PER_TEST_LIMIT,
        "workers": WORKERS,
        "output_files": list(OUTPUT_FILES),
        "required_imports": list(REQUIRED),
        "stages": [dataclasses.asdict(s) for s in STAGES],
    }


class Run:
    """The log, the JSON report and the deadline of one run."""

    def __init__(self, out: str, dry_run: bool) -> None:
        self.out = out
        self.dry_run = dry_run
        os.makedirs(out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu-check-")  # scratch, never in the output
        self.log = open(os.path.join(out, OUTPUT_FILES[0]), "w", buffering=1)  # noqa: SIM115
        self.start = time.monotonic()
        self.deadline = self.start + TOTAL_LIMIT
        self.report: dict[str, Any] = {"dry_run": dry_run, "plan": plan(), "stages": [], "facts": {}}
        self.env = dict(os.environ)
        self.env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "PIP_NO_INDEX": "1",  # no stage may reach a package index
                "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # JAX, CuPy and torch share the GPU
                "AMPSCALE_CACHE_DIR": os.environ.get("AMPSCALE_CACHE_DIR", "/tmp/ampscale-cuda-cache"),
            }
        )
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        self.status = 0

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.start, 1)
        self.report["exit_status"] = self.status
        path = os.path.join(self.out, OUTPUT_FILES[1])
        with open(path + ".part", "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        os.replace(path + ".part", path)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, command: list[str], limit: float, label: str | None = None) -> tuple[int | None, str]:
        """Run ``command`` (its own process group) with its output in the log; ``(exit code or
        None if it ran past ``limit`` and was killed, its output)``. ``label``: what the log
        shows instead of the command line."""
        self.say(f"$ {label or ' '.join(command)}  (limit {limit:.0f} s)")
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(max(limit, 1.0), kill)
        timer.start()
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            sys.stdout.write(line)
            self.log.write(line)
        code = process.wait()
        timer.cancel()
        if killed.is_set():
            self.say(f"!! killed at its limit of {limit:.0f} s")
            return None, "".join(lines)
        return code, "".join(lines)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


_IMPORTS = r"""
import importlib, json, sys
required, optional = sys.argv[1].split(","), sys.argv[2].split(",")
found = {}
for name in required + optional:
    try:
        module = importlib.import_module(name)
        found[name] = str(getattr(module, "__version__", "ok"))
    except Exception as exc:
        found[name] = None
        print(f"import {name}: {type(exc).__name__}: {exc}")
facts = {"modules": found}
try:
    import torch
    facts["torch_cuda"] = bool(torch.cuda.is_available())
    facts["torch_device"] = torch.cuda.get_device_name(0) if facts["torch_cuda"] else None
except Exception as exc:
    facts["torch_cuda"] = False
try:
    import cupy
    facts["cupy_devices"] = int(cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    facts["cupy_devices"] = 0
try:
    import jax
    facts["jax_backend"] = jax.default_backend()
except Exception as exc:
    facts["jax_backend"] = None
print("FACTS " + json.dumps(facts))
"""

_PREFLIGHT = r"""
import json
import ampscale
from ampscale._native.cuda import driver, nvrtc
facts = {"ampscale": ampscale.__version__, "from": ampscale.__file__}
facts["cuda_step"] = driver.unavailable_reason() or "available"
try:
    facts["nvrtc"] = "{}.{}".format(*nvrtc.version()) + f" ({nvrtc.library_path()})"
except OSError as exc:
    facts["nvrtc"] = f"unavailable: {exc}"
try:
    from ampscale.backends import jax as jax_backend
    facts["jax_custom_call"] = str(jax_backend.custom_call_status())
except Exception as exc:
    facts["jax_custom_call"] = f"{type(exc).__name__}: {exc}"
print("FACTS " + json.dumps(facts))
"""


def _facts(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        if line.startswith("FACTS "):
            return json.loads(line[6:])  # type: ignore[no-any-return]
    return {}


def junit_summary(path: str, limit: int = 60) -> dict[str, Any]:
    """Counts and the failed tests (name, message) of a pytest JUnit XML file."""
    if not os.path.exists(path):
        return {"missing": True}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                text = (node.get("message") or "") + "\n" + (node.text or "")
                failed.append(
                    {"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind, "text": text[-3000:]}
                )
    return {**counts, "failed": failed[:limit], "failed_total": len(failed)}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, from the benchmark rows (``None`` where a row is missing)."""

    def row(backend: str, workload: str, name: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["backend"], r["workload"], r["name"]) == (backend, workload, name)), None)

    def limit(workload: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["limit"] and r["device"] == "gpu" and r["workload"] == workload), None)

    out: list[dict[str, Any]] = []

    def check(target: str, value: Any, ok: bool | None) -> None:
        out.append({"target": target, "measured": value, "met": ok})

    fused = "torch fused kernel only"
    ours_t, ours_c = "ampscale torch (unscale + update)", "ampscale cupy (one launch: unscale + update)"
    t0, c0 = row("torch-cuda", "W0", ours_t), row("cupy", "W0", ours_c)
    t1, f1, g1 = (
        row("torch-cuda", "W1", ours_t),
        row("torch-cuda", "W1", fused),
        row("torch-cuda", "W1", "torch.amp.GradScaler"),
    )
    c1 = row("cupy", "W1", ours_c)
    if t0:
        check("torch CUDA W0 <= 40 us", f"{t0['seconds'] * 1e6:.1f} us", t0["seconds"] <= 40e-6)
        check("torch CUDA launches per step = 2", t0["launches"], t0["launches"] == 2)
    if t1 and f1:
        check(
            "torch CUDA W1 <= 1.05x the fused kernel",
            f"{t1['seconds'] / f1['seconds']:.3f}x",
            t1["seconds"] <= 1.05 * f1["seconds"],
        )
    if t1 and g1:
        check(
            "torch CUDA W1 >= 2x faster than GradScaler",
            f"{g1['seconds'] / t1['seconds']:.2f}x",
            g1["seconds"] >= 2 * t1["seconds"],
        )
    if c0:
        check("CuPy W0 <= 40 us", f"{c0['seconds'] * 1e6:.1f} us", c0["seconds"] <= 40e-6)
        check("CuPy launches per step = 1", c0["launches"], c0["launches"] == 1)
    lim = limit("W1")
    if c1 and lim:
        fraction = lim["seconds"] / c1["seconds"]
        check("CuPy W1 >= 0.85 L", f"{fraction:.2f} L", fraction >= 0.85)
    drop = row("torch-cuda", "N", "ampscale.torch.GradScaler.update (CUDA)")
    theirs = row("torch-cuda", "N", "torch.amp.GradScaler.update (CUDA)")
    if drop:
        check("drop-in update() launches = 1", drop["launches"], drop["launches"] == 1)
        if theirs:
            check("drop-in update() host time vs torch's", f"{drop['seconds'] / theirs['seconds']:.2f}x", None)
    jax_step = "ampscale jax (jit, donated)"
    j1 = row("jax-gpu", "W1", jax_step)
    if j1 and f1:
        check(
            "JAX W1 within 1.2x of torch's fused kernel",
            f"{j1['seconds'] / f1['seconds']:.2f}x",
            j1["seconds"] <= 1.2 * f1["seconds"],
        )
    cast, copy = (
        row("fp8-gpu", "FP8-W1", "ampscale fp8.amax_and_cast e4m3fn, torch CUDA"),
        row("fp8-gpu", "FP8-W1", "device copy of the same bytes (copy_)"),
    )
    if cast and copy:
        check(
            "FP8 amax + cast of W1 within 1.1x of a copy of the same bytes (torch CUDA)",
            f"{cast['seconds'] / copy['seconds']:.2f}x",
            cast["seconds"] <= 1.1 * copy["seconds"],
        )
        check("FP8 amax + cast launches per step = 1", cast["launches"], cast["launches"] == 1)
    j2 = row("jax-gpu", "W2", jax_step)
    if j2:
        check(
            "JAX W2 >= 5x faster than the 19 ms measured before",
            f"{19e-3 / j2['seconds']:.1f}x",
            j2["seconds"] <= 19e-3 / 5,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in args:
        print(json.dumps(plan(), indent=1))
        return 0
    dry_run = "--dry-run" in args
    positional = [a for a in args if not a.startswith("--")]
    out = positional[0] if positional else os.environ.get("OUT") or "gpu-check-output"
    run = Run(out, dry_run)
    stages = {s.name: s for s in STAGES}
    have_gpu = False
    rows: list[dict[str, Any]] = []
    run.say(
        f"== gpu-check{' (dry run)' if dry_run else ''}: {len(STAGES)} stages, limits {sum(s.limit for s in STAGES)} s "
        f"of {TOTAL_LIMIT} s; output: {', '.join(OUTPUT_FILES)} in {os.path.abspath(out)}"
    )
    for s in STAGES:
        run.say(f"   {s.name:<10} {s.limit:>4} s  {s.does}")

    def stage(name: str) -> dict[str, Any]:
        entry = {"name": name, "limit": stages[name].limit, "status": "running", "seconds": 0.0}
        run.report["stages"].append(entry)
        run.say(f"\n== {name} (limit {stages[name].limit} s)")
        entry["_start"] = time.monotonic()
        return entry

    def done(entry: dict[str, Any], status: str, reason: str = "") -> None:
        entry["seconds"] = round(time.monotonic() - entry.pop("_start"), 1)
        entry["status"] = status
        if reason:
            entry["reason"] = reason
        run.say(f"-- {entry['name']}: {status}{': ' + reason if reason else ''} ({entry['seconds']} s)")
        if status in ("failed", "timed out"):
            run.status = 1
        run.save()

    def budget(name: str) -> float:
        return max(1.0, min(stages[name].limit, run.left()))

    def stop(line: str) -> int:
        run.say(f"\ngpu-check: STOPPED: {line}")
        run.report["stopped"] = line
        run.status = 1
        run.save()
        shutil.rmtree(run.work, ignore_errors=True)
        return 1

    # 1. machine
    entry = stage("machine")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        done(entry, "skipped", "no nvidia-smi here: no GPU")
    else:
        code, text = run.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], budget("machine")
        )
        have_gpu = code == 0 and bool(text.strip())
        run.report["facts"]["nvidia_smi"] = text.strip()
        if have_gpu:
            done(entry, "passed")
        else:
            done(entry, "skipped" if dry_run else "failed", "nvidia-smi sees no GPU")

    # 2. wheels
    entry = stage("wheels")
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if not wheels:
        done(entry, "skipped", "no wheels carried in .whl/ (bash scripts/gpu-wheels.sh downloads them)")
    else:
        site = os.environ.get("GPU_CHECK_SITE") or os.path.join(tempfile.gettempdir(), "ampscale-site")
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--upgrade", "--target", site, *wheels]
        entry["wheels"] = [os.path.basename(w) for w in wheels]
        code, _ = run.run(command, budget("wheels"))
        run.env["PYTHONPATH"] = os.pathsep.join([site, run.env["PYTHONPATH"]])
        done(
            entry, "passed" if code == 0 else "failed", "" if code == 0 else "pip could not install the carried wheels"
        )
        if code != 0:
            return stop("the carried wheels in .whl/ did not install (see the log)")

    # 3. imports
    entry = stage("imports")
    command = [*_python(_IMPORTS), ",".join(REQUIRED), ",".join(OPTIONAL)]
    code, text = run.run(command, budget("imports"), "python -c <import " + ", ".join(REQUIRED + OPTIONAL) + ">")
    facts = _facts(text)
    run.report["facts"].update(facts)
    modules = facts.get("modules", {})
    missing = [m for m in REQUIRED if not modules.get(m)]
    if code is None or not facts:
        done(entry, "failed", "the import check did not finish")
        return stop("the import check did not finish (see the log)")
    gpu_frameworks = bool(facts.get("torch_cuda")) and facts.get("cupy_devices", 0) > 0
    if missing and not dry_run:
        done(entry, "failed", "missing: " + ", ".join(missing))
        return stop(
            "missing Python packages: "
            + ", ".join(missing)
            + " (carry them as wheels in .whl/: bash scripts/gpu-wheels.sh)"
        )
    if have_gpu and not gpu_frameworks and not dry_run:
        done(entry, "failed", f"torch CUDA {facts.get('torch_cuda')}, CuPy devices {facts.get('cupy_devices')}")
        return stop("torch or CuPy does not see the GPU (see the log)")
    done(entry, "passed", ("dry run; the GPU run would stop on missing: " + ", ".join(missing)) if missing else "")

    # 4. build
    entry = stage("build")
    code, _ = run.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], budget("build") - 5)
    check = "import ampscale._native.cpu._numpy, ampscale._native.cuda._driver; print('built extensions import')"
    built, _ = run.run(_python(check), 5 + max(0.0, budget("build") - (time.monotonic() - entry["_start"])), check)
    if code is None or built != 0:
        done(entry, "failed", "the C extensions did not build or do not import")
        return stop(
            "the C extensions (ampscale._native.cpu._numpy, ampscale._native.cuda._driver) did not build (see the log)"
        )
    done(entry, "passed")

    # 5. preflight
    entry = stage("preflight")
    code, text = run.run(
        _python(_PREFLIGHT), budget("preflight"), "python -c <versions, CUDA step, NVRTC, JAX custom call>"
    )
    run.report["facts"].update(_facts(text))
    done(entry, "passed" if code == 0 else "failed")

    gpu_reason = "" if have_gpu and gpu_frameworks else "no GPU here" if not have_gpu else "torch/CuPy see no GPU"
    timeout_ok = bool(modules.get("pytest_timeout"))

    def skip(entry: dict[str, Any], command: list[str]) -> None:
        entry["command"] = command
        run.say("would run: " + " ".join(command))
        done(entry, "skipped", gpu_reason)

    def pytest_stage(name: str, files: tuple[str, ...], select: list[str]) -> None:
        entry = stage(name)
        xml = os.path.join(run.work, f"{name}.xml")
        command = [
            sys.executable,
            "-m",
            "pytest",
            *files,
            *select,
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:benchmark",
        ]
        command += ["-n", str(WORKERS[name]), "--no-header", "-rfE", "--durations=10", f"--junitxml={xml}"]
        if timeout_ok or gpu_reason:  # (a skipped stage shows the command of the GPU run)
            command.append(f"--timeout={PER_TEST_LIMIT[name]}")
        if gpu_reason:
            skip(entry, command)
            return
        code, _ = run.run(command, budget(name))
        entry["tests"] = junit_summary(xml)
        if code is None:
            done(entry, "timed out", "the stage ran past its limit")
        else:
            done(entry, "passed" if code in (0, 5) else "failed", "" if code in (0, 5) else f"pytest exit {code}")

    def bench_stage(name: str, backends: str, workloads: str) -> None:
        entry = stage(name)
        path = os.path.join(run.work, f"{name}.json")
        command = [sys.executable, "benchmarks/run.py", "--gpu-only", "--backends", backends, "--workloads", workloads]
        command += ["--quick", "--markdown", "--json", path]
        if gpu_reason:
            skip(entry, command)
            return
        code, _ = run.run(command, budget(name))
        if os.path.exists(path):
            with open(path) as f:
                found = json.load(f)
            rows.extend(found)
            run.report.setdefault("benchmark", []).extend(found)
        done(entry, "passed" if code == 0 else "timed out" if code is None else "failed")

    # 6, 7: torch CUDA and CuPy
    pytest_stage("gpu-tests", GPU_TEST_FILES, ["-m", "gpu"])
    bench_stage("bench", "cupy,torch,fp8", "W0,W1,W1h,W2,N,FP8-W1")
    # 8, 9: JAX on the GPU
    if not gpu_reason and facts.get("jax_backend") != "gpu":
        gpu_reason = f"JAX's default backend is {facts.get('jax_backend')!r}, not the GPU"
    pytest_stage("jax-tests", JAX_TEST_FILES, ["-k", "jax"])
    bench_stage("jax-bench", "torch,jax", "W1,W2")

    # 10. report
    entry = stage("report")
    found = targets(rows)
    run.report["targets"] = found
    for t in found:
        mark = "-" if t["met"] is None else "met" if t["met"] else "NOT met"
        run.say(f"| {t['target']} | {t['measured']} | {mark} |")
    done(entry, "passed", "" if found else "no benchmark rows (no GPU)")
    run.save()
    run.say(f"\n== gpu-check exit status: {run.status} after {run.report['seconds']} s")
    shutil.rmtree(run.work, ignore_errors=True)
    return run.status


if __name__ == "__main__":
    raise SystemExit(main())
