#!/usr/bin/env bash
# Every GPU check in one command, under 8 minutes in all on one GPU (each stage has a limit, and
# no stage runs past TOTAL_LIMIT seconds from the start, 465 by default):
#   1. set up ampscale from this tree (no package index needed: wheels in .whl/ are used if present),
#      and build its C extensions (the NumPy kernel, the CUDA driver launcher),
#   2. the GPU tests: the one-launch CUDA step (device transition against the host one, gradients
#      bit for bit against torch.amp.GradScaler, last-block stress, two streams, launches per step
#      counted by the profiler, no sync), CuPy, torch CUDA, the shared contract and reliability tests
#      on every GPU framework, the CUDA build tests (NVRTC and nvcc PTX), the CuPy example,
#   3. the GPU benchmark (L measured with CUDA events, launches and host microseconds per step),
#      and the issue's targets read from it,
#   4. the JAX tests with JAX on the GPU (JAX's default device there): the CUDA custom call bit for
#      bit against XLA:GPU's pure-XLA path (every dtype, inf/nan anywhere, jit/scan/vmap/shard_map,
#      donation, launches per call), and the JAX backend's other tests,
#   5. the JAX GPU benchmark (W1 beside torch's fused kernel, W2, W0) and the JAX GPU targets.
# Usage: bash scripts/gpu-check.sh [output directory]   (logs and the benchmark table land there)
# Limits (seconds) and the benchmarked backends can be set: TOTAL_LIMIT, GPU_TESTS_LIMIT,
# BENCH_LIMIT, JAX_TESTS_LIMIT, JAX_BENCH_LIMIT, BENCH_BACKENDS (default "cupy,torch").
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$((SECONDS + ${TOTAL_LIMIT:-465}))
# a stage's limit: what it asks for, but never past the deadline
budget() { local left=$((deadline - SECONDS)); if [ "$1" -lt "$left" ]; then echo "$1"; elif [ "$left" -gt 1 ]; then echo "$left"; else echo 1; fi; }
out="${1:-${OUT:-gpu-check-output}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX, CuPy and torch share the GPU in one process
export AMPSCALE_CACHE_DIR="${AMPSCALE_CACHE_DIR:-/tmp/ampscale-cuda-cache}"  # NVRTC binaries, shared by the workers
status=0

echo "== machine"
nvidia-smi -L || true
if compgen -G ".whl/*.whl" >/dev/null; then  # dependencies carried as wheels
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ampscale-site .whl/*.whl || status=1
    export PYTHONPATH="/tmp/ampscale-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package runs from this tree; build its native extensions in place.
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || {
    echo "setup.py build_ext failed (see build.log); compiling the extensions directly"
    include=$("$py" -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])")
    suffix=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    gcc -O3 -std=c11 -fno-math-errno -fno-trapping-math -shared -fPIC -pthread $include \
        ampscale/_native/cpu/_numpy.c -o "ampscale/_native/cpu/_numpy$suffix"
    gcc -O2 -std=c11 -shared -fPIC $include ampscale/_native/cuda/_driver.c -ldl -o "ampscale/_native/cuda/_driver$suffix"
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY'
import importlib

import ampscale

print("ampscale", ampscale.__version__, "from", ampscale.__file__)
for name in ("cupy", "torch", "jax", "jmp", "ampscale._native.cpu._numpy", "ampscale._native.cuda._driver"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as exc:  # noqa: BLE001
        print(name, "unavailable:", exc)
from ampscale._native.cuda import driver, nvrtc

print("CUDA step:", driver.unavailable_reason() or "available", "| NVRTC", nvrtc.version(), nvrtc.library_path())
try:
    import jax

    print("jax devices:", jax.devices())
except Exception as exc:  # noqa: BLE001
    print("jax:", exc)
PY

# pytest options: a per-test limit where pytest-timeout is installed (a hang names its test)
opts=(-q -p no:cacheprovider -p no:benchmark -n 8 --no-header -rfEs --durations=10)
if "$py" -c "import pytest_timeout" 2>/dev/null; then opts+=(--timeout=150); fi

echo "== GPU tests (one-launch CUDA step, CuPy, torch CUDA, contract and reliability tests on the GPU frameworks)"
timeout "$(budget "${GPU_TESTS_LIMIT:-150}")" "$py" -m pytest -m gpu "${opts[@]}" \
    tests/test_cuda_gpu.py tests/test_cupy.py tests/test_scaler.py tests/test_overflow_detection.py \
    tests/test_reliability.py tests/test_torch.py tests/test_examples.py tests/test_in_place.py \
    2>&1 | tee "$out/gpu-tests.log"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=1; fi
echo "== CUDA build and host tests (NVRTC and nvcc PTX for sm_80/sm_90, the kernels on the host, the JAX handler)"
timeout "$(budget 60)" "$py" -m pytest "${opts[@]}" tests/test_cuda_build.py tests/test_cuda_glue.py tests/test_codegen.py \
    tests/test_jax_cuda.py \
    2>&1 | tee "$out/cuda-build-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmark"
timeout "$(budget "${BENCH_LIMIT:-110}")" "$py" benchmarks/run.py --backends "${BENCH_BACKENDS:-cupy,torch}" \
    --workloads W0,W1,W1h,W2 --quick --markdown --json "$out/gpu-benchmark.json" 2>&1 | tee "$out/gpu-benchmark.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$py" - "$out/gpu-benchmark.json" <<'PY' | tee "$out/gpu-targets.md"
import json
import sys

rows = json.load(open(sys.argv[1]))


def row(backend, workload, name):
    return next((r for r in rows if r["backend"] == backend and r["workload"] == workload and r["name"] == name), None)


def limit(workload):
    return next((r for r in rows if r["limit"] and r["device"] == "gpu" and r["workload"] == workload), None)


def show(target, value, ok):
    print(f"| {target} | {value} | {'met' if ok else 'NOT met'} |")


print("| target | measured | |\n|---|---|---|")
t0 = row("torch-cuda", "W0", "ampscale torch (unscale + update)")
c0 = row("cupy", "W0", "ampscale cupy (one launch: unscale + update)")
t1 = row("torch-cuda", "W1", "ampscale torch (unscale + update)")
f1 = row("torch-cuda", "W1", "torch fused kernel only")
g1 = row("torch-cuda", "W1", "torch.amp.GradScaler")
c1 = row("cupy", "W1", "ampscale cupy (one launch: unscale + update)")
if t0:
    show("torch CUDA W0 <= 40 us", f"{t0['seconds'] * 1e6:.1f} us", t0["seconds"] <= 40e-6)
    show("torch CUDA launches per step = 2", t0["launches"], t0["launches"] == 2)
if t1 and f1:
    show("torch CUDA W1 <= 1.05x the fused kernel", f"{t1['seconds'] / f1['seconds']:.3f}x", t1["seconds"] <= 1.05 * f1["seconds"])
if t1 and g1:
    show("torch CUDA W1 >= 2x faster than GradScaler", f"{g1['seconds'] / t1['seconds']:.2f}x", g1["seconds"] >= 2 * t1["seconds"])
if c0:
    show("CuPy W0 <= 40 us", f"{c0['seconds'] * 1e6:.1f} us", c0["seconds"] <= 40e-6)
    show("CuPy launches per step = 1", c0["launches"], c0["launches"] == 1)
if c1 and limit("W1"):
    fraction = limit("W1")["seconds"] / c1["seconds"]
    show("CuPy W1 >= 0.85 L", f"{fraction:.2f} L", fraction >= 0.85)
PY

echo "== JAX tests with JAX on the GPU (the CUDA custom call, then the JAX backend's tests)"
if "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    timeout "$(budget "${JAX_TESTS_LIMIT:-90}")" "$py" -m pytest "${opts[@]}" \
        tests/test_jax_cuda_gpu.py tests/test_jax_ffi.py tests/test_jax.py tests/test_scaler.py \
        tests/test_overflow_detection.py -k "jax" \
        2>&1 | tee "$out/jax-gpu-tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1

    echo "== JAX GPU benchmark (W1 with torch's rows in the same run, then W2 and W0)"
    jax_bench_start=$SECONDS
    for workload in W1 W2 W0; do
        backends=jax
        [ "$workload" = W1 ] && backends=torch,jax  # torch's fused kernel, timed beside JAX
        left=$(( ${JAX_BENCH_LIMIT:-120} - (SECONDS - jax_bench_start) ))
        [ "$left" -gt 5 ] || { echo "JAX benchmark: no time left for $workload"; status=1; break; }
        timeout "$(budget "$left")" "$py" benchmarks/run.py --backends "$backends" --workloads "$workload" --quick \
            --markdown --json "$out/jax-gpu-benchmark-$workload.json" 2>&1 | tee "$out/jax-gpu-benchmark-$workload.md"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    "$py" - "$out" <<'PY' | tee "$out/jax-gpu-targets.md"
import json
import os
import sys


def rows(workload):
    path = os.path.join(sys.argv[1], f"jax-gpu-benchmark-{workload}.json")
    return json.load(open(path)) if os.path.exists(path) else []


def row(workload, backend, name):
    return next((r for r in rows(workload) if r["backend"] == backend and r["name"] == name), None)


def show(target, value, ok):
    print(f"| {target} | {value} | {'met' if ok else 'NOT met'} |")


print("| JAX GPU target | measured | |\n|---|---|---|")
step, loop = "ampscale jax (jit, donated)", "ampscale jax in a jitted loop (4 steps per call)"
xla = "ampscale jax, pure-XLA path (jit, donated)"
fused = row("W1", "torch-cuda", "torch fused kernel only")
for workload in ("W1", "W2", "W0"):
    for name in (step, loop, xla):
        r = row(workload, "jax-gpu", name)
        if r:
            print(f"| {workload} {name} | {r['seconds'] * 1e3:.3f} ms, {r['launches']} launches/step | {r['note']} |")
for name in (step, loop):
    r = row("W1", "jax-gpu", name)
    if r and fused:
        ratio = r["seconds"] / fused["seconds"]
        show(f"JAX W1 ({name}) within 1.2x of torch's fused kernel", f"{ratio:.2f}x", ratio <= 1.2)
    elif not r:
        show(f"JAX W1 ({name}) within 1.2x of torch's fused kernel", "not measured", False)
r, x = row("W2", "jax-gpu", step), row("W2", "jax-gpu", xla)
if r:
    show("JAX W2 >= 5x faster than the 19 ms measured before", f"{19e-3 / r['seconds']:.1f}x", r["seconds"] <= 19e-3 / 5)
    if x:
        print(f"| JAX W2 against the pure-XLA path in this run | {x['seconds'] / r['seconds']:.1f}x | |")
else:
    show("JAX W2 >= 5x faster than the 19 ms measured before", "not measured", False)
PY
else
    echo "JAX has no GPU here: skipped"
fi

echo "== gpu-check exit status: $status"
exit $status
