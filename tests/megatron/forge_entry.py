"""``python tests/megatron/forge_entry.py fit ...``: the forge CLI with the test-only CUDA shim installed.

Lightning's launcher re-runs this script for every process, so each one installs the shim before megatron runs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

from forge_lightning.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
