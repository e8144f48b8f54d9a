#!/bin/bash
# Regenerate every provided Slurm script from its plan specification (run from the checkout's root).
# tests/planner/test_slurm_specs.py fails when a checked-in script differs from what this produces.
set -euo pipefail
cd "$(dirname "$0")/../.."
for spec in scripts/slurm/specs/*.json; do
  ${PYTHON:-python} -m megatron_pp_ext.cli grid --slurm --spec "$spec"
done
