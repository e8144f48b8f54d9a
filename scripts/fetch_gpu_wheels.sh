#!/usr/bin/env bash
# Fetch, where there is network, the wheels a GPU machine without network lacks, into gpu_wheels/ (git-ignored).
# Copy that folder with the checkout to the GPU machine; scripts/gpu_check.sh installs it there without network.
#
# The GPU machine (docs/gpu.md): Python 3.12, a CUDA build of torch, numpy; no network needed. megatron-core
# 0.19.2 needs only torch, numpy and packaging>=24.2 (packaging is fetched too, in case the machine lacks it). Transformer Engine is not fetched: its
# torch extension has no binary wheel (docs/gpu.md, "Transformer Engine").
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=gpu_wheels
PY=${PYTHON:-python3}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
# cp312 manylinux wheels for the device, whatever this machine's Python is
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" megatron-core==0.19.2
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$DEST" packaging==25.0
# this package (pure Python); the device also gets the source tree, which gpu_check.sh puts first on the path
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$DEST" .
ls -l "$DEST"
du -ch "$DEST"/*.whl | tail -1
