#!/usr/bin/env bash
# The test command (README): lint, the type check of the pure packages, then the tests.
#   bash scripts/run_tests.sh            every test: pure ones and real gloo runs (CI; ~15 min on 2 idle cores)
#   bash scripts/run_tests.sh --quick    pure and single-process tests only (-m "not gloo and not slow"; ~2 min)
# Any other argument goes to pytest (a file, -k EXPR, -x, ...). Which tests are real-rank (gloo) tests, and the
# guard that fails an unmarked one: tests/tiers.py.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
quick=0
args=()
for arg in "$@"; do
    if [ "$arg" = --quick ]; then quick=1; else args+=("$arg"); fi
done
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
"$PYTHON" -m mypy  # the pure packages, as configured in pyproject.toml
if [ "$quick" = 1 ]; then
    args=(-m "not gloo and not slow" "${args[@]}")
fi
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests "${args[@]}"
