#!/usr/bin/env bash
# Every GPU check in one command: install, the GPU tests (CuPy, torch CUDA, JAX GPU, and the
# shared contract tests on every GPU framework), then the GPU benchmark rows. Well under ten
# minutes on one GPU. Usage: bash scripts/gpu-check.sh [output directory]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-output}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

echo "== machine"
nvidia-smi -L || true
python3 -m pip install -q -e . 2>&1 | tail -2
python3 - <<'PY'
import importlib
for name in ("cupy", "torch", "jax"):
    try:
        module = importlib.import_module(name)
        print(name, module.__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "unavailable:", exc)
PY

echo "== GPU tests"
timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_cupy.py tests/test_scaler.py tests/test_overflow_detection.py tests/test_torch.py tests/test_jax.py \
    tests/test_examples.py \
    2>&1 | tee "$out/gpu-tests.log"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=1; fi

echo "== GPU benchmark"
timeout 240 python3 benchmarks/run.py --backends "$(python3 - <<'PY'
import importlib.util
print(",".join(b for b in ("cupy", "torch", "jax") if importlib.util.find_spec(b)))
PY
)" --workloads W1,W1h,W2 --quick --markdown 2>&1 | tee "$out/gpu-benchmark.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
