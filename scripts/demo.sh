#!/usr/bin/env bash
# The README's main job: plan a GPT, train it with the plan on several CPU ranks (gloo),
# print the plan and predicted vs measured memory and step time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/shardplan demo "$@"
