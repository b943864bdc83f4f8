#!/usr/bin/env bash
# Set up from scratch and run the test suite (CPU; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
.venv/bin/python -m pytest "$@"
