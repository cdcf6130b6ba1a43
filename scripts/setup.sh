#!/usr/bin/env bash
# Creates .venv (if missing) and installs forge-lightning with its test tools. Safe to run again.
# The CPU build of torch is installed first: a looser spec with no torch present would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
stamp=".venv/.forge-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip
    python -m pip install -q "$TORCH_SPEC"
    python -m pip install -q -e ".[test,kernels]"
    touch "$stamp"
fi
