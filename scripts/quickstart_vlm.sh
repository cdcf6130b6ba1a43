#!/usr/bin/env bash
# Quick start, vision-language: makes a synthetic visual QA set (coloured shapes on a 3 x 3 board, one-word answers)
# and a ChatML tokenizer (no download), composes a tiny SigLIP tower + MLP projector + Llama from config, trains it
# on CPU with the loss on the answers, and reports held-out exact match before and after training; exports the model
# as a LLaVA checkpoint (Hugging Face format).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The model is tiny: one thread is as fast as two and never slowed by oversubscribed cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
forge-data vlm-quickstart --output data/vlm_quickstart
forge fit --config configs/quickstart/vlm.yaml "$@"
