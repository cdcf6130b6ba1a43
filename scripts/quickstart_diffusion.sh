#!/usr/bin/env bash
# Quick start, text-to-video: draws clips of one coloured shape moving across a 32 x 32 frame with captions ("a red
# square moving left"; 4 of the 32 combinations held out), writes a word-level tokenizer and a tiny random UMT5 text
# encoder (no download), caches pixel-space latents (the frames themselves: no VAE) and the captions' embeddings,
# trains a tiny Wan DiT with the flow-matching loss on CPU, and prints how often generated clips have the prompt's
# colour, direction and shape, before and after training, for held-out and training prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The model is tiny and its batches come from memory (no data worker): two threads on two cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
forge-data diffusion-quickstart --output data/diffusion_quickstart
forge-data precompute --config data/diffusion_quickstart/precompute.yaml --output data/diffusion_quickstart/features
forge fit --config configs/quickstart/diffusion.yaml "$@"
