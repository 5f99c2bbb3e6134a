#!/usr/bin/env bash
# Wheels for a GPU machine without network access that has Python, NumPy and PyTorch but not the
# packages of anygpu's other backends and tests: downloaded here into .whl/ for its Python
# version (default 3.12), which scripts/gpu_check.sh installs from when the folder is present
# (without dependencies: the machine's own NumPy and pytest stay).
#   usage: scripts/offline_wheels.sh [python-version]
set -eu
cd "$(dirname "$0")/.."
version=${1:-3.12}
mkdir -p .whl
python3 -m pip download --quiet --no-deps --dest .whl --only-binary=:all: --python-version "$version" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  pyopencl wgpu pytest-xdist execnet platformdirs pytools siphash24 rendercanvas cffi pycparser \
  typing_extensions
ls .whl
