#!/usr/bin/env bash
# The README's test command: sets up .venv, runs the whole suite, the type checker, then the plan-quality gate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
# Style first, in seconds: ruff's format and lint (pyflakes, import order, absolute imports).
.venv/bin/ruff format --check --quiet .
.venv/bin/ruff check --quiet .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
# Types: the package as pyproject.toml's [tool.mypy] says (every function typed on the seams).
.venv/bin/python -m mypy
# The plan-quality gate: predicted step time and memory of the baseline's models must not regress.
.venv/bin/shardplan check --baseline benchmarks/baseline.json
