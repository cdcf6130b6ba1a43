"""2-process worker: the MoE twins at EP = 2 (DP = 2), TP = 2 with sequence parallelism (experts split over TP, or
whole with ETP = 1 and split over the TP ranks by EP = 2) and PP = 2; writes, on
rank 0, each run's loss, tracked router losses and gradients (Hugging Face names) for the test to compare with the
native model.

``python -m torch.distributed.run --nproc-per-node 2 moe_worker.py OUT_FILE CONFIG_NAME...`` (gloo, CPU shim).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from moe_reference import build_twin, megatron_run, micro_batches, moe_config, native_model  # noqa: E402
from worker_exit import exit_worker  # noqa: E402

LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "tp2_sp_etp1_ep2": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_tensor_parallel_size=1,
        expert_model_parallel_size=2,
    ),
    "tp2_sp_etp1": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def main(out: Path, names: list[str]) -> None:
    dist.init_process_group("gloo")
    results = {}
    for layout, degrees in LAYOUTS.items():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=degrees.get("tensor_model_parallel_size", 1),
            pipeline_model_parallel_size=degrees.get("pipeline_model_parallel_size", 1),
            expert_model_parallel_size=degrees.get("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=degrees.get("expert_tensor_parallel_size"),
        )
        model_parallel_cuda_manual_seed(0)  # megatron's RNG tracker (sequence-parallel embedding dropout)
        dp_rank, dp_size = (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        for name in names:
            config = moe_config(name)
            # the global batch: one micro-batch per DP rank, or both on one
            batches = micro_batches(config, 2)
            chunks = build_twin(native_model(config), **degrees)
            run = megatron_run(chunks, config, batches[dp_rank::dp_size])
            dist.all_reduce(run["sums"], group=parallel_state.get_data_parallel_group())
            results[layout, name] = run
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, out)
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
