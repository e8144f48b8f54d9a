#!/usr/bin/env bash
# GPU checks of the Transformer Engine B/W split (tests/gpu): real TE layers on one GPU, zb-h1 and v-zb
# with megatron's TE layer spec on 2 GPUs against the same schedules unsplit.
# Needs: CUDA, 2 GPUs, Transformer Engine >= 2.10 (pip install megatron_pp_ext[te]); every test is skipped
# with its reason otherwise (-rs prints them).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m pytest tests/gpu -v -rs "$@"
