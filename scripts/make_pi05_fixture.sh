#!/usr/bin/env bash
# Builds the Pi0.5 parity fixture under tests/fixtures/pi05/ with lerobot 0.6.1's own PI05Policy.
#
# lerobot 0.6.x needs Python 3.12 and torch < 2.12 (its Pi0.5 ships its own Gemma / PaliGemma code on top of
# transformers 5.4-5.5), so it gets its own venv outside the repository, never the project venv. lerobot is
# installed --no-deps with only what its Pi0.5 modules import. PyPI's torch 2.11 is a CUDA build; it runs on
# CPU, which is all this script uses (~5 GB of wheels on the first run).
# Usage: scripts/make_pi05_fixture.sh [--venv-only]
#   PYTHON312=/path/to/python3.12 to pick the interpreter; LEROBOT_PI05_VENV=DIR to place the venv elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON312:-python3.12}"
VENV="${LEROBOT_PI05_VENV:-/tmp/lerobot-venvs/lerobot-0.6.1-py312}"
OUT="tests/fixtures/pi05"

if [ ! -f "$VENV/.ready" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "torch==2.11.0"
    "$VENV/bin/python" -m pip install -q --no-deps "torchvision==0.26.0"
    "$VENV/bin/python" -m pip install -q "transformers==5.5.4" "tokenizers==0.22.2" "numpy==2.2.6" \
        "safetensors==0.8.0" "huggingface-hub>=1.6,<2" "opencv-python-headless<4.14" "draccus==0.11.6" \
        mergedeep pyyaml-include toml termcolor gymnasium farama-notifications "einops<0.9" packaging tqdm \
        requests pillow
    "$VENV/bin/python" -m pip install -q --no-deps "lerobot==0.6.1"
    touch "$VENV/.ready"
fi
[ "${1:-}" = "--venv-only" ] && exit 0

rm -rf "$OUT"
HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 "$VENV/bin/python" scripts/make_pi05_fixture.py --out "$OUT"
chmod -R a+rX "$OUT"
du -sh "$OUT"
