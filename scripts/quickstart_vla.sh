#!/usr/bin/env bash
# Quick start, embodied: a scripted expert records Reach2D demonstrations (a LeRobot v3.0 dataset with a camera and
# the agent's state), a tiny Pi0.5 learns them on CPU, and forge-eval runs it in closed loop against a random policy.
# No download: the env, the expert, the dataset and the prompt tokenizer are the project's own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -c "import gymnasium, av, pyarrow" 2>/dev/null || python -m pip install -q -e ".[embodied]"
# One thread per process: the model is tiny, so intra-op threads only add overhead (0.105 s per step against 0.12 s
# with two threads on 2 cores), and the data worker gets the other core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m forge_lightning.sim.record --output data/vla_quickstart --episodes 1000
forge fit --config configs/quickstart/vla.yaml "$@"
# ModelCheckpoint numbers a second run's file last-v1.ckpt: evaluate the newest
ckpt="$(ls -t runs/vla_quickstart/checkpoints/last*.ckpt | head -n 1)"
forge-eval --config configs/quickstart/vla.yaml --ckpt "$ckpt" --episodes 200 --baseline random \
    --output runs/vla_quickstart/eval
