#!/usr/bin/env bash
# Creates .venv and installs shardplan with what the tests and the demo need.
# torch is pinned here (not in pyproject) so pip takes the CPU build and users keep their own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
