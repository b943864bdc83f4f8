#!/usr/bin/env bash
# Set up .venv with everything the workbench needs; safe to re-run.
#   --browser   also install Debian's chromium (for the report/browser tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# A CPU machine must take torch 2.13.0 (a CPU build); a GPU node keeps the torch it has.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
python -m ipykernel install --sys-prefix --name python3 >/dev/null
if [ "${1:-}" = "--browser" ] && ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "setup: chromium missing and not root; browser tests will be skipped" >&2
    fi
fi
