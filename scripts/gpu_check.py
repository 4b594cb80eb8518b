"""Every GPU check of ampscale in one command, within 7 minutes on a cold cache (run by gpu-check.sh).

The stages, each with a time limit (:data:`STAGES`; their sum leaves :data:`MARGIN` of
:data:`TOTAL_LIMIT`, a stage may also use the time earlier stages left unused, and no stage runs
past the deadline):

1. ``machine``: what ``nvidia-smi`` sees (one witness of the GPU among four: a slow or missing
   ``nvidia-smi`` does not decide, see ``imports``);
2. ``wheels``: the pure-Python packages the GPU image lacks, carried as wheels in ``.whl/``
   (``bash scripts/gpu-wheels.sh`` downloads exactly those pinned in ``scripts/gpu-wheels.txt``),
   installed with ``pip --no-index`` into ``$GPU_CHECK_SITE`` (default ``/tmp/ampscale-site``, put
   first on ``PYTHONPATH``): nothing is ever fetched from a package index (``PIP_NO_INDEX`` is set
   for every stage too); a carried wheel that is not the pinned version is named;
3. ``imports``: every module the checks need, imported first; a missing one stops the run with
   one line that names it (and says how to carry it). Whether there is a GPU is decided here:
   there is one if nvidia-smi, torch, CuPy or JAX sees one; "no GPU here" only when none does,
   with each one's answer logged; a framework that does not see a GPU the others see is named,
   and only the stages that need it are skipped;
4. ``build``: the C extensions, built in place, then imported one by one; a missing one is one
   line naming it and the stages that need it (the CUDA launcher ``_driver``: torch CUDA and the
   JAX custom call; the NumPy kernel ``_numpy``: nothing here, the tests' NumPy references then
   take the exact pure-NumPy path), and the other stages still run;
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

Time on a cold cache (the estimate behind the limits). The GPU tests ask NVRTC for 31
distinct sources: counted on the CPU stand-ins (``AMPSCALE_FAKE_CUPY=1 pytest -m gpu -k cupy``
and ``AMPSCALE_FAKE_TORCH_CUDA=1 pytest -k torch`` over :data:`GPU_TEST_FILES`, logging every
module source), 20 for CuPy's tests and 27 for torch's, 29 together (one configuration's module
is one cache entry for both frameworks), plus one batch of the drawn transitions per framework.
The JAX stages add one (the JAX module), the benchmarks a few (their configurations). At about
1 s of CPU each (an sm_90 cubin) and with each source compiled once under the cache's build
lock while other workers compile others, that is about 5 to 10 s of the 8 workers' time in the
``gpu-tests`` stage, not a stage of its own. The limits, in seconds: the build measured 16 s on
a loaded 2-core machine (7 s of CPU: the two extensions and the JAX CPU handler), importing
torch, CuPy and JAX with their GPU runtimes about 10 to 20 s, the benchmark's W1 arrays (124 M
values, several copies per backend) a few seconds to make; the per-test limits stay at most half
their stage's, so a hang is named in the log instead of the stage being killed without a summary.

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
#: the whole run, seconds (7 minutes): no stage runs past it
TOTAL_LIMIT = 420
#: what the stage limits leave of TOTAL_LIMIT: this script's own start, the report, the copies
MARGIN = 30
#: the wheels carried to the GPU machine, each pinned to one version (scripts/gpu-wheels.sh reads it)
PINNED_WHEELS = os.path.join(ROOT, "scripts", "gpu-wheels.txt")
#: the C extensions ``setup.py`` builds, what each is, and the stages that cannot run without it
EXTENSIONS = {
    "ampscale._native.cpu._numpy": ("the NumPy backend's native kernel", ()),
    "ampscale._native.cuda._driver": ("the CUDA launcher", ("torch CUDA", "the JAX CUDA custom call")),
}
#: pytest's filter for the NumPy kernel's missing-extension warning (the tests' filterwarnings
#: makes every ampscale warning an error; without the kernel the exact pure-NumPy path runs)
NO_NUMPY_KERNEL_FILTER = "ignore:ampscale's native NumPy kernel is not built:ampscale.PerformanceWarning"
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
    Stage("machine", 10, False, "nvidia-smi: the GPU, its driver and memory (one witness among four)"),
    Stage("wheels", 10, False, "pip install --no-index the wheels carried in .whl/ (nothing from an index)"),
    Stage("imports", 35, False, "import every module the checks need; who sees a GPU (nvidia-smi, torch, CuPy, JAX)"),
    Stage("build", 40, False, "setup.py build_ext --inplace, then import each built extension"),
    Stage("preflight", 20, False, "versions; whether the one-launch CUDA step and the JAX custom call load"),
    Stage("gpu-tests", 110, True, "pytest -m gpu: CUDA step, CuPy, torch CUDA, drop-in, FP8 pass, contract tests"),
    Stage("bench", 60, True, "benchmarks/run.py --gpu-only (torch CUDA, CuPy, the drop-in's update, FP8 W1)"),
    Stage("jax-tests", 50, True, "JAX on the GPU: the CUDA custom call against XLA:GPU, contract tests"),
    Stage("jax-bench", 45, True, "JAX GPU benchmark: W1 beside torch's fused kernel, and W2"),
    Stage("report", 5, False, "the targets, read from the benchmark rows"),
)


def plan() -> dict[str, Any]:
    """The stages and limits (what ``--plan`` prints)."""
    return {
        "total_limit": TOTAL_LIMIT,
        "margin": MARGIN,
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
facts = {"modules": found, "why_no_gpu": {}}
why = facts["why_no_gpu"]
try:
    import torch
    facts["torch_cuda"] = bool(torch.cuda.is_available())
    facts["torch_device"] = torch.cuda.get_device_name(0) if facts["torch_cuda"] else None
    if not facts["torch_cuda"]:
        why["torch"] = f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda})"
except Exception as exc:
    facts["torch_cuda"] = False
    why["torch"] = f"{type(exc).__name__}: {exc}"
try:
    import cupy
    facts["cupy_devices"] = int(cupy.cuda.runtime.getDeviceCount())
    if not facts["cupy_devices"]:
        why["cupy"] = "cupy.cuda.runtime.getDeviceCount() is 0"
except Exception as exc:
    facts["cupy_devices"] = 0
    why["cupy"] = f"{type(exc).__name__}: {exc}"
try:
    import jax
    facts["jax_backend"] = jax.default_backend()
    if facts["jax_backend"] != "gpu":
        why["jax"] = f"jax.default_backend() is {facts['jax_backend']!r}"
except Exception as exc:
    facts["jax_backend"] = None
    why["jax"] = f"{type(exc).__name__}: {exc}"
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
        # two while the host's bound of the scale is at least 1 (torch's kernel + the update),
        # one while it is below 1 (ampscale's kernel alone): the rows alternate scales 16, 1/16
        check("torch CUDA launches per step <= 2", t0["launches"], t0["launches"] <= 2)
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


def pinned_wheels(path: str = PINNED_WHEELS) -> dict[str, str]:
    """``{normalised name: version}`` of the pinned wheels (``name==version`` lines)."""
    pins = {}
    with open(path) as f:
        for line in f:
            requirement = line.split("#", 1)[0].strip()
            if requirement:
                name, _, version = requirement.partition("==")
                pins[_normalised(name)] = version.strip()
    return pins


def _normalised(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(".", "_")


def compare_wheels(pins: dict[str, str], wheels: list[str]) -> dict[str, str]:
    """For each pin: ``"carried"``, ``"missing"`` or ``"other version X"`` among the wheel files."""
    carried = {}
    for path in wheels:
        name, version = os.path.basename(path).split("-")[:2]
        carried[_normalised(name)] = version
    return {
        f"{name}=={version}": "carried"
        if carried.get(name) == version
        else "missing"
        if name not in carried
        else f"other version {carried[name]}"
        for name, version in pins.items()
    }


def gpu_witnesses(smi: str | None, facts: dict[str, Any]) -> dict[str, str | None]:
    """Who sees a GPU: ``{witness: None if it sees one, else why not}`` for nvidia-smi (its
    ``smi`` answer: ``None`` when it saw one), torch, CuPy and JAX (the import check's facts)."""
    why = facts.get("why_no_gpu", {})
    return {
        "nvidia-smi": smi,
        "torch": None if facts.get("torch_cuda") else why.get("torch", "torch does not see a GPU"),
        "cupy": None if facts.get("cupy_devices", 0) > 0 else why.get("cupy", "CuPy sees no device"),
        "jax": None if facts.get("jax_backend") == "gpu" else why.get("jax", "JAX is not on the GPU"),
    }


def no_gpu_reason(witnesses: dict[str, str | None]) -> str:
    """``""`` when any witness sees a GPU; else "no GPU here", with every witness's answer."""
    if any(answer is None for answer in witnesses.values()):
        return ""
    return "no GPU here (" + "; ".join(f"{w}: {answer}" for w, answer in witnesses.items()) + ")"


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
    rows: list[dict[str, Any]] = []
    run.say(
        f"== gpu-check{' (dry run)' if dry_run else ''}: {len(STAGES)} stages, limits {sum(s.limit for s in STAGES)} s "
        f"of {TOTAL_LIMIT} s; output: {', '.join(OUTPUT_FILES)} in {os.path.abspath(out)}"
    )
    for s in STAGES:
        run.say(f"   {s.name:<10} {s.limit:>4} s  {s.does}")
    banked = [0.0]  # time earlier stages left unused: a later stage may use it

    def stage(name: str) -> dict[str, Any]:
        entry = {"name": name, "limit": stages[name].limit, "status": "running", "seconds": 0.0}
        run.report["stages"].append(entry)
        run.say(f"\n== {name} (limit {stages[name].limit} s, {banked[0]:.0f} s left unused by earlier stages)")
        entry["_start"] = time.monotonic()
        return entry

    def done(entry: dict[str, Any], status: str, reason: str = "") -> None:
        entry["seconds"] = round(time.monotonic() - entry.pop("_start"), 1)
        banked[0] = max(0.0, banked[0] + stages[entry["name"]].limit - entry["seconds"])
        entry["status"] = status
        if reason:
            entry["reason"] = reason
        run.say(f"-- {entry['name']}: {status}{': ' + reason if reason else ''} ({entry['seconds']} s)")
        if status in ("failed", "timed out"):
            run.status = 1
        run.save()

    def budget(name: str) -> float:
        # the stage's own limit, plus what earlier stages left unused (the limits add up to at
        # most TOTAL_LIMIT - MARGIN, so the later stages still have theirs), never past the end
        return max(1.0, min(stages[name].limit + banked[0], run.left()))

    def stop(line: str) -> int:
        run.say(f"\ngpu-check: STOPPED: {line}")
        run.report["stopped"] = line
        run.status = 1
        run.save()
        shutil.rmtree(run.work, ignore_errors=True)
        return 1

    # 1. machine: one witness of the GPU (decided at the imports, with torch, CuPy and JAX)
    entry = stage("machine")
    smi = shutil.which("nvidia-smi")
    smi_answer: str | None
    if smi is None:
        smi_answer = "not installed"
        done(entry, "skipped", "no nvidia-smi here (torch, CuPy and JAX are asked too)")
    else:
        limit = budget("machine")
        code, text = run.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], limit)
        run.report["facts"]["nvidia_smi"] = text.strip()
        if code == 0 and text.strip():
            smi_answer = None
            done(entry, "passed")
        else:
            smi_answer = f"timed out after {limit:.0f} s" if code is None else f"exit {code}, no GPU listed"
            done(entry, "skipped", f"nvidia-smi: {smi_answer} (torch, CuPy and JAX are asked too)")

    # 2. wheels
    entry = stage("wheels")
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    pins = compare_wheels(pinned_wheels(), wheels)
    entry["pins"] = pins
    for requirement, state in pins.items():
        if state != "carried":
            run.say(f"pinned in scripts/gpu-wheels.txt: {requirement}: {state} (bash scripts/gpu-wheels.sh)")
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

    # 3. imports, and who sees a GPU
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
    witnesses = gpu_witnesses(smi_answer, facts)
    run.report["facts"]["gpu_witnesses"] = witnesses
    no_gpu = no_gpu_reason(witnesses)
    have_gpu = not no_gpu
    for witness, answer in witnesses.items():
        run.say(f"GPU seen by {witness}: {'yes' if answer is None else 'no: ' + answer}")
    if missing and not dry_run:
        done(entry, "failed", "missing: " + ", ".join(missing))
        return stop(
            "missing Python packages: "
            + ", ".join(missing)
            + " (carry them as wheels in .whl/: bash scripts/gpu-wheels.sh)"
        )
    blind = [w for w, answer in witnesses.items() if answer is not None and w != "nvidia-smi"]
    if have_gpu and blind and not dry_run:
        # the others see a GPU: only the stages that need the blind frameworks are skipped
        done(entry, "failed", "a GPU is there, but " + ", ".join(f"{w} does not see it" for w in blind))
    else:
        done(entry, "passed", ("dry run; the GPU run would stop on missing: " + ", ".join(missing)) if missing else "")
    if no_gpu:
        run.say(no_gpu)

    # 4. build: each extension on its own; a missing one skips only the stages that need it
    entry = stage("build")
    code, _ = run.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], budget("build") - 5)
    missing_pieces: dict[str, str] = {}
    for name, (what, needed_by) in EXTENSIONS.items():
        check = f"import {name}; print('{name}: built, imports')"
        left = max(1.0, budget("build") - (time.monotonic() - entry["_start"]))
        imported, _ = run.run(_python(check), left, f"python -c 'import {name}'")
        if imported != 0:
            missing_pieces[name] = what
            needs = ", ".join(needed_by) if needed_by else "no stage (the tests' NumPy references run pure NumPy)"
            run.say(f"MISSING: {name} ({what}) did not build or import; needed by: {needs}")
    entry["missing"] = sorted(missing_pieces)
    if code is None:
        done(entry, "timed out", "setup.py build_ext ran past its limit")
    elif missing_pieces:
        done(entry, "failed", "not built: " + ", ".join(sorted(missing_pieces)) + " (the stages that need none go on)")
    else:
        done(entry, "passed")
    no_driver = "ampscale._native.cuda._driver" in missing_pieces
    no_numpy_kernel = "ampscale._native.cpu._numpy" in missing_pieces

    # 5. preflight
    entry = stage("preflight")
    code, text = run.run(
        _python(_PREFLIGHT), budget("preflight"), "python -c <versions, CUDA step, NVRTC, JAX custom call>"
    )
    run.report["facts"].update(_facts(text))
    done(entry, "passed" if code == 0 else "failed")

    timeout_ok = bool(modules.get("pytest_timeout"))
    torch_sees = witnesses["torch"] is None and not no_driver
    cupy_sees = witnesses["cupy"] is None
    if no_gpu:
        cuda_reason = no_gpu
    elif not torch_sees and not cupy_sees:
        if witnesses["torch"] is None:
            torch_why = "its CUDA launcher ampscale._native.cuda._driver did not build"
        else:
            torch_why = str(witnesses["torch"])
        cuda_reason = f"neither torch CUDA nor CuPy can run (torch: {torch_why}; CuPy: {witnesses['cupy']})"
    else:
        cuda_reason = ""
    if no_gpu:
        jax_reason = no_gpu
    elif witnesses["jax"] is not None:
        jax_reason = f"JAX is not on the GPU: {witnesses['jax']}"
    elif no_driver:
        jax_reason = "the JAX CUDA custom call needs ampscale._native.cuda._driver, which did not build"
    else:
        jax_reason = ""

    def skip(entry: dict[str, Any], command: list[str], reason: str) -> None:
        entry["command"] = command
        run.say("would run: " + " ".join(command))
        done(entry, "skipped", reason)

    def pytest_stage(name: str, files: tuple[str, ...], select: list[str], reason: str) -> None:
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
        if no_numpy_kernel:
            command += ["-W", NO_NUMPY_KERNEL_FILTER]
        if timeout_ok or reason:  # (a skipped stage shows the command of the GPU run)
            command.append(f"--timeout={PER_TEST_LIMIT[name]}")
        if reason:
            skip(entry, command, reason)
            return
        code, _ = run.run(command, budget(name))
        entry["tests"] = junit_summary(xml)
        if code is None:
            done(entry, "timed out", "the stage ran past its limit")
        else:
            done(entry, "passed" if code in (0, 5) else "failed", "" if code in (0, 5) else f"pytest exit {code}")

    def bench_stage(name: str, backends: list[str], workloads: str, reason: str) -> None:
        entry = stage(name)
        path = os.path.join(run.work, f"{name}.json")
        command = [sys.executable, "benchmarks/run.py", "--gpu-only", "--backends", ",".join(backends)]
        command += ["--workloads", workloads, "--quick", "--markdown", "--json", path]
        if reason:
            skip(entry, command, reason)
            return
        code, _ = run.run(command, budget(name))
        if os.path.exists(path):
            with open(path) as f:
                found = json.load(f)
            rows.extend(found)
            run.report.setdefault("benchmark", []).extend(found)
        done(entry, "passed" if code == 0 else "timed out" if code is None else "failed")

    # 6, 7: torch CUDA and CuPy, each only where it can run
    select = ["-m", "gpu"]
    if not torch_sees and cupy_sees:
        select += ["-k", "not torch"]
        run.say("gpu-tests: CuPy only (torch " + ("has no CUDA launcher" if no_driver else "sees no GPU") + ")")
    elif torch_sees and not cupy_sees:
        select += ["-k", "not cupy"]
        run.say(f"gpu-tests: torch only (CuPy: {witnesses['cupy']})")
    pytest_stage("gpu-tests", GPU_TEST_FILES, select, cuda_reason)
    bench_backends = [b for b, sees in (("cupy", cupy_sees), ("torch", torch_sees)) if sees] or ["cupy", "torch"]
    # the FP8 rows (amax + cast of W1 against a copy of the same bytes) run on torch CUDA and CuPy
    bench_stage("bench", [*bench_backends, "fp8"], "W0,W1,W1h,W2,N,FP8-W1", cuda_reason)
    # 8, 9: JAX on the GPU
    pytest_stage("jax-tests", JAX_TEST_FILES, ["-k", "jax"], jax_reason)
    # (torch's fused kernel is the row JAX's W1 is compared with; a skipped stage shows the GPU run's command)
    bench_stage("jax-bench", ["torch", "jax"] if torch_sees or no_gpu else ["jax"], "W1,W2", jax_reason)

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
