"""``python tests/megatron/forge_entry.py fit ...``: the forge CLI with the test-only CUDA shim installed.

Lightning's launcher re-runs this script as ``__main__`` for every process, so each one installs the shim before
megatron runs. Every import is under the main guard: the first megatron-core dist-checkpoint a rank saves starts a
``spawn`` multiprocessing manager, which imports the parent's main script; that import is then cheap (measured: a
4-step TP=2 fit with two checkpoints, 44 s with the imports at the top, 32 s so, on 2 loaded cores).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cuda_shim

    cuda_shim.install()

    from forge_lightning.cli import main

    main()
