#!/usr/bin/env bash
# Every GPU check in one command, well under ten minutes on one GPU:
#   1. set up ampscale from this tree (no package index needed: wheels in .whl/ are used if present),
#   2. the GPU tests: CuPy, torch CUDA, the shared contract and reliability tests on every GPU
#      framework, the CuPy example on the GPU,
#   3. the GPU benchmark rows (CuPy, torch CUDA, JAX GPU),
#   4. the JAX tests with JAX on the GPU (JAX's default device there).
# Usage: bash scripts/gpu-check.sh [output directory]   (logs and the benchmark table land there)
# Limits (seconds) and the benchmarked backends can be set: GPU_TESTS_LIMIT, BENCH_LIMIT,
# JAX_TESTS_LIMIT, BENCH_BACKENDS (e.g. "cupy,torch").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-output}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX, CuPy and torch share the GPU in one process
status=0

echo "== machine"
nvidia-smi -L || true
if compgen -G ".whl/*.whl" >/dev/null; then  # dependencies carried as wheels
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ampscale-site .whl/*.whl || status=1
    export PYTHONPATH="/tmp/ampscale-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package runs from this tree; build its native NumPy kernel in place.
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || {
    echo "setup.py build_ext failed (see build.log); compiling the kernel directly"
    gcc -O3 -std=c11 -fno-math-errno -fno-trapping-math -shared -fPIC -pthread \
        $("$py" -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])") \
        ampscale/backends/_native.c \
        -o "ampscale/backends/_native$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY'
import importlib

import ampscale

print("ampscale", ampscale.__version__, "from", ampscale.__file__)
for name in ("cupy", "torch", "jax", "jmp", "ampscale.backends._native"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as exc:  # noqa: BLE001
        print(name, "unavailable:", exc)
try:
    import jax

    print("jax devices:", jax.devices())
except Exception as exc:  # noqa: BLE001
    print("jax:", exc)
PY

# pytest options: a per-test limit where pytest-timeout is installed (a hang names its test)
opts=(-q -p no:cacheprovider -p no:benchmark -n 8 --no-header -rfE --durations=8)
if "$py" -c "import pytest_timeout" 2>/dev/null; then opts+=(--timeout=120); fi

echo "== GPU tests (CuPy, torch CUDA, contract and reliability tests on the GPU frameworks)"
timeout "${GPU_TESTS_LIMIT:-240}" "$py" -m pytest -m gpu "${opts[@]}" \
    tests/test_cupy.py tests/test_scaler.py tests/test_overflow_detection.py tests/test_reliability.py \
    tests/test_torch.py tests/test_examples.py \
    2>&1 | tee "$out/gpu-tests.log"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=1; fi

echo "== GPU benchmark"
backends=$("$py" - <<'PY'
import importlib.util
print(",".join(b for b in ("cupy", "torch", "jax") if importlib.util.find_spec(b)))
PY
)
timeout "${BENCH_LIMIT:-240}" "$py" benchmarks/run.py --backends "${BENCH_BACKENDS:-$backends}" \
    --workloads W0,W1,W1h,W2 --quick --markdown --json "$out/gpu-benchmark.json" 2>&1 | tee "$out/gpu-benchmark.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== JAX tests with JAX on the GPU"
if "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    timeout "${JAX_TESTS_LIMIT:-200}" "$py" -m pytest "${opts[@]}" \
        tests/test_jax.py tests/test_scaler.py tests/test_overflow_detection.py -k "jax" \
        2>&1 | tee "$out/jax-gpu-tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "JAX has no GPU here: skipped"
fi

echo "== gpu-check exit status: $status"
exit $status
