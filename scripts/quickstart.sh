#!/usr/bin/env bash
# Quick start: prepares data from the Python standard library's own source files (no download), trains a
# small Llama-style model on CPU, validates, checkpoints, exports Hugging Face weights and prints a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
forge-data quickstart --output data/quickstart
forge fit --config configs/quickstart/llm.yaml "$@"
