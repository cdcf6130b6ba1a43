#!/usr/bin/env bash
# Sets up the environment, lints, and runs the default test suite (CPU; `gpu` and `slow` tests are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
# pytest exits 5 when it collected no test: that is a failure here, as is any other non-zero code.
python -m pytest -q "$@"
