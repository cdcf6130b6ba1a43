#!/usr/bin/env bash
# Builds the LeRobot reference fixtures under tests/fixtures/lerobot/ with lerobot itself.
#
# lerobot cannot share the project venv (its hub / transformers / torchvision pins clash), so each lerobot
# version gets its own venv (outside the repository by default), installed with --no-deps plus what its
# dataset code imports:
#   lerobot 0.4.4 writes v3.0 datasets; lerobot 0.3.3 writes v2.1 (and reads v2.0).
# Usage: scripts/make_lerobot_fixtures.sh [--venvs-only]   (LEROBOT_VENV_ROOT=DIR to place the venvs elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${LEROBOT_VENV_ROOT:-/tmp/lerobot-venvs}"
PYTHON="${PYTHON:-python3.11}"
OUT="tests/fixtures/lerobot"
COMMON=(torch==2.13.0 numpy pandas pyarrow pillow safetensors packaging jsonlines einops termcolor
        deepdiff draccus==0.10.0 imageio fsspec tqdm pyyaml)

make_venv() {  # make_venv NAME LEROBOT_VERSION EXTRA_SPECS...
    local venv="$ROOT/$1" version="$2"
    shift 2
    if [ ! -f "$venv/.ready" ]; then
        "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install -q torch==2.13.0
        "$venv/bin/python" -m pip install -q "${COMMON[@]}" "$@"
        # torchvision: only its pure-Python parts are used (VideoReader with the pyav backend); its C ops do
        # not load beside this torch, which the driver script works around (see make_lerobot_fixtures.py).
        "$venv/bin/python" -m pip install -q --no-deps "torchvision==0.22.1" "lerobot==$version"
        touch "$venv/.ready"
    fi
}

make_venv lerobot-0.4.4 0.4.4 "datasets>=4,<5" "huggingface-hub<0.36" "av>=15,<16" accelerate
make_venv lerobot-0.3.3 0.3.3 "datasets>=2.19,<=3.6" "huggingface-hub<0.36" "av>=15,<16" accelerate
[ "${1:-}" = "--venvs-only" ] && exit 0

rm -rf "$OUT" && mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
# v2.1 written by lerobot 0.3.3, then a v2.0 copy (stats.json instead of episodes_stats.jsonl) read by it too.
"$ROOT/lerobot-0.3.3/bin/python" scripts/make_lerobot_fixtures.py write --version v2.1 --out "$OUT"
"$ROOT/lerobot-0.3.3/bin/python" scripts/make_lerobot_fixtures.py read --version v2.1 --out "$OUT"
"$ROOT/lerobot-0.3.3/bin/python" scripts/make_lerobot_fixtures.py read --version v2.0 --out "$OUT"
# v3.0 written by lerobot 0.4.4.
"$ROOT/lerobot-0.4.4/bin/python" scripts/make_lerobot_fixtures.py write --version v3.0 --out "$OUT"
"$ROOT/lerobot-0.4.4/bin/python" scripts/make_lerobot_fixtures.py read --version v3.0 --out "$OUT"
# A v3.0 dataset written by forge-lightning's LeRobotWriter (project venv), read back by lerobot 0.4.4.
.venv/bin/python scripts/make_lerobot_fixtures.py write --version forge --out "$OUT"
"$ROOT/lerobot-0.4.4/bin/python" scripts/make_lerobot_fixtures.py read --version forge --out "$OUT"
chmod -R a+rX "$OUT"
du -sh "$OUT"
