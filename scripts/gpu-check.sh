#!/usr/bin/env bash
# Every GPU check of ampscale in one command, within 7 minutes on a cold cache: the stages, their
# limits and their output are described in scripts/gpu_check.py (python3 scripts/gpu_check.py --plan
# prints them). Two files come back in the output directory: gpu-check.log and gpu-check.json.
#
# On the GPU machine (the wheels it lacks carried in .whl/, see scripts/gpu-wheels.sh):
#   bash scripts/gpu-check.sh "$OUT"
# Here, without a GPU (the GPU stages skip, with their reason):
#   bash scripts/gpu-check.sh /tmp/gpu-check-dry --dry-run
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
