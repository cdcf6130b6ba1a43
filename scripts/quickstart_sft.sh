#!/usr/bin/env bash
# Quick start, fine-tuning: makes unit-conversion chat data and a ChatML tokenizer (no download), fine-tunes a tiny
# Llama-style model on CPU with packed sequences and assistant-only loss, and reports held-out exact match before
# and after training; exports the model (Hugging Face format) with its tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The model is tiny: one thread is as fast as two and never slowed by oversubscribed cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
forge-data sft-quickstart --output data/sft_quickstart
forge fit --config configs/quickstart/sft.yaml "$@"
