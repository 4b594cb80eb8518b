#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), exactly the wheels scripts/gpu-check.sh needs on the GPU
# machine and its image lacks: pure-Python packages, for that machine's Python 3.12. The machine
# has no package index; the check installs these with pip --no-index. Run it here, once:
#   bash scripts/gpu-wheels.sh
# then name .whl in the device run's carry list. array-api-compat is ampscale's one dependency
# besides NumPy (the image has NumPy, pytest, pytest-xdist, pytest-timeout, hypothesis and
# ml-dtypes); its version is the one the test environment pins.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=("array-api-compat==1.16.0")
mkdir -p .whl
rm -f .whl/*.whl
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
