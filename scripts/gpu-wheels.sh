#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), exactly the wheels scripts/gpu-check.sh needs on the GPU
# machine and its image lacks: pure-Python packages, for that machine's Python 3.12. The machine
# has no package index; the check installs these with pip --no-index. Run it here, once:
#   bash scripts/gpu-wheels.sh
# then name .whl in the device run's carry list. Which wheels, at which exact versions, is
# scripts/gpu-wheels.txt (the one place that pins them; the test environment is constrained to
# the same versions through requirements-test.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r scripts/gpu-wheels.txt
ls -l .whl
