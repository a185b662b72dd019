#!/usr/bin/env bash
# The README's test command: sets up .venv, runs the whole suite, then the plan-quality gate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
