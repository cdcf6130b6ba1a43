"""2-process worker: the MLP-Mixer family's ``forge fit`` / ``forge validate`` (mixer.yaml) under each strategy, one
case after the other in the same processes (torch, Lightning and megatron-core are imported once).

``python -m torch.distributed.run --nproc-per-node 2 worker.py OUT_DIR CASE...`` (gloo, CPU; cases from
:data:`CASES`, run in order). Each case is the forge CLI (``ForgeCLI``, as ``forge fit`` runs it) on mixer.yaml with
the case's arguments (``{out}`` stands for ``OUT_DIR``); it writes its CSV log and the plain model's weights at the
start and end of training (weights_export.py) under ``OUT_DIR/CASE/version_0``. A case named ``bad_*`` is expected to
fail: its error message goes to ``OUT_DIR/CASE_error.txt``. Megatron cases run with the test-only CUDA shim
(tests/megatron/cuda_shim.py) installed, the others without it.
"""

import faulthandler
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "megatron")]

import cuda_shim  # noqa: E402
import torch.distributed as dist  # noqa: E402
from worker_exit import exit_worker  # noqa: E402

from forge_lightning.cli import ForgeCLI  # noqa: E402

YAML = HERE / "mixer.yaml"
# A class path alone would stay a string (which Lightning reads as a registry name): each is given an init arg.
DDP = ["--trainer.strategy", "forge_lightning.strategies.DDPStrategy", "--trainer.strategy.comm_hook", "none"]
FSDP2 = ["--trainer.strategy", "forge_lightning.strategies.FSDP2Strategy"]
MEGATRON = ["--trainer.strategy", "forge_lightning.strategies.megatron.MegatronStrategy"]
TP2 = ["--trainer.strategy.tensor_model_parallel_size", "2"]
CHECKPOINT = "{out}/ckpt_megatron_tp2/epoch=0-step=3.ckpt"
POSITION = ["--model.init_args.config", '{"position_embedding": true}']
NAN = ["--data.init_args.nan_sample", "5"]


def batch(size: int) -> list[str]:
    return ["--data.batch_size", str(size)]


# The global batch is the reference's (8 samples a step, 2 micro-batches): data.batch_size is per data-parallel rank.
CASES: dict[str, tuple[str, list[str]]] = {
    "ddp": ("fit", [*DDP, *batch(2)]),
    "fsdp2": ("fit", [*FSDP2, "--trainer.strategy.data_parallel_size", "2", *batch(2)]),
    "fsdp2_tp2": (
        "fit",
        [
            *FSDP2,
            "--trainer.strategy.tensor_parallel_size",
            "2",
            "--performance.activation_checkpointing",
            "full",
        ]
        + batch(4),
    ),
    # Saves a dist-checkpoint after its last step, which megatron_validate_* load at TP = 2 and at TP = 1 x DP = 2.
    "megatron_tp2": (
        "fit",
        [*MEGATRON, *TP2, "--performance.activation_checkpointing", "full", *batch(4)]
        + ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint"]
        + [
            "--trainer.callbacks.dirpath={out}/ckpt_megatron_tp2",
            "--trainer.callbacks.every_n_train_steps=3",
        ],
    ),
    "megatron_dp2": ("fit", [*MEGATRON, "--trainer.strategy.use_distributed_optimizer", "true", *batch(2)]),
    "megatron_validate_dp2": (
        "validate",
        [
            *MEGATRON,
            "--trainer.strategy.tensor_model_parallel_size",
            "1",
            "--ckpt_path",
            CHECKPOINT,
            *batch(2),
        ],
    ),
    "megatron_validate_tp2": ("validate", [*MEGATRON, *TP2, "--ckpt_path", CHECKPOINT, *batch(4)]),
    # With an nn.Embedding table: natively (DDP) it is not decayed; see test_contract_family.py.
    "ddp_position": ("fit", [*DDP, *POSITION, *batch(2)]),
    "megatron_position": ("fit", [*MEGATRON, *TP2, *POSITION, *batch(4)]),
    # A NaN training sample (read by one rank): the non-finite guard leaves its step out everywhere.
    "ddp_nan": ("fit", [*DDP, *NAN, *batch(2)]),
    "fsdp2_nan": ("fit", [*FSDP2, "--trainer.strategy.data_parallel_size", "2", *NAN, *batch(2)]),
    "megatron_tp2_nan": ("fit", [*MEGATRON, *TP2, *NAN, *batch(4)]),
    "megatron_dp2_nan": (
        "fit",
        [*MEGATRON, "--trainer.strategy.use_distributed_optimizer", "true", *NAN, *batch(2)],
    ),
    "bad_megatron_pp2": ("fit", [*MEGATRON, "--trainer.strategy.pipeline_model_parallel_size", "2"]),
    "bad_megatron_kernel": ("fit", [*MEGATRON, *TP2, "--performance.kernels.rms_norm", "triton"]),
    "bad_megatron_checkpoint_config": (
        "validate",
        [*MEGATRON, *TP2, "--model.init_args.config", '{"num_layers": 3}', "--ckpt_path", CHECKPOINT],
    ),
}


def run_case(out: Path, name: str) -> None:
    if "megatron" in name:
        cuda_shim.install()
    else:
        cuda_shim.uninstall()
    command, extra = CASES[name]
    args = [command, "--config", str(YAML), "--trainer.devices", "2"]
    args += ["--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name]
    args += [arg.replace("{out}", str(out)) for arg in extra]
    try:
        ForgeCLI(args=args)
    except Exception as err:
        if not name.startswith("bad_"):
            raise
        if dist.get_rank() == 0:
            (out / f"{name}_error.txt").write_text(f"{type(err).__name__}: {err}")
        dist.barrier()


def main(out: Path, names: list[str]) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hung collective fails with every thread's stack
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        run_case(out, name)
    dist.barrier()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
