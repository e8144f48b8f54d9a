#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the B/W split on CUDA, zb-h1 / v-zb on two ranks sharing one GPU, one layer's
# F/B/W costs and a split stage's peak memory against the planner. One line per check on stdout; the JSON
# summary and the checks' own output in $OUT (or --out DIR; default out/gpu_check): gpu_check.json, gpu_check.log.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, with the wheels copied there in gpu_wheels/
#   bash scripts/gpu_check.sh --dry-run       # here, on CPU with tiny shapes (what tests/selfcheck/test_gpu_check.py runs)
#
# Exit status: 0 when every check passed or was skipped, 1 when one failed, 2 for bad arguments, 3 when the
# wheels could not be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
dry=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry=1; done
if [[ $dry == 0 ]] && compgen -G "gpu_wheels/*.whl" >/dev/null; then
  # no network there: the copied wheels only, without their dependencies (torch, numpy are the machine's)
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    gpu_wheels/*.whl; then
    echo "gpu-check: installing gpu_wheels/*.whl into $SITE failed" >&2
    exit 3
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# this tree's package first (the wheel's copy is for runs outside the repository)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ $dry == 0 ]] && ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  echo "gpu-check: megatron-core cannot be imported: run scripts/fetch_gpu_wheels.sh where there is network and" \
    "copy gpu_wheels/ to this machine (docs/gpu.md)" >&2
  exit 3
fi
exec "$PY" -m megatron_pp_ext.selfcheck.gpu_check "$@"
