#!/usr/bin/env bash
# Set up and run the main job: every study notebook re-run headless into
# self-contained HTML under results/reports/ (index.html lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/workbench report --all "$@"
