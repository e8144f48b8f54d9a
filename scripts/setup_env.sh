#!/usr/bin/env bash
# One-time set-up of the pinned environment (see README): Python 3.11 or 3.12, torch 2.13.0 (CPU build
# where no CUDA is wanted), megatron-core 0.19.2 and this package in editable mode with its test
# extras. Installs into the Python named by $PYTHON (default: python3); use a venv if you like.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] not in ((3, 11), (3, 12)):
    sys.exit(f"megatron_pp_ext supports Python 3.11 and 3.12, found {sys.version.split()[0]} (set PYTHON=...)")
PY
MINOR=$("$PYTHON" -c 'import sys; print(sys.version_info[1])')

pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --no-input "$@"; }

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
pip_install "torch==${TORCH_VERSION:-2.13.0}"
if [ "$MINOR" = 11 ]; then
    # megatron-core >= 0.17 declares Python >= 3.12, but its cp311 wheel of 0.19.2 works on 3.11.
    pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
else
    # 3.12: megatron-core's declared Python (and Megatron-Bridge's): installed normally, with its dependencies
    # (torch, pinned above, already satisfies its torch requirement).
    pip_install "megatron-core==0.19.2"
fi
pip_install numpy "packaging>=24.2" psutil
pip_install -e ".[test]"  # with the test tools: pytest, hypothesis, ruff, mypy (pinned in setup.py)

# The HTML explorer's browser test (tests/analysis/test_html_explorer.py): Playwright for Python driving
# Debian's chromium through executable_path (Playwright's own browser download cannot reach its servers).
# Measured here: about 2 minutes for apt-get update + install, seconds for the pip package. Best effort:
# without them the test is skipped with the reason, nothing else depends on them. SKIP_BROWSER=1 skips it.
if [ "${SKIP_BROWSER:-0}" != 1 ]; then
    pip_install "playwright==1.65.2" || echo "setup_env: playwright not installed; the browser test will be skipped" >&2
    if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
            >/dev/null || echo "setup_env: chromium not installed; the browser test will be skipped" >&2
    fi
fi
"$PYTHON" -c "import importlib.metadata as md, torch, megatron_pp_ext; print('torch', torch.__version__, '| megatron-core', md.version('megatron-core'), '| megatron_pp_ext', megatron_pp_ext.__version__)"
