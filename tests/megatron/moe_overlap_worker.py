"""2-process worker: megatron-core's ``moe_shared_expert_overlap`` at EP = 2 (DP = 2) against the same twin without
it, for MoE models with shared experts; writes, on rank 0, each run's loss sums and gradients (Hugging Face names).

``python -m torch.distributed.run --nproc-per-node 2 moe_overlap_worker.py OUT_FILE CONFIG_NAME...`` (gloo, CPU
shim: its CUDA streams are no-ops, so the overlapped code path runs in order).
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

from forge_lightning.contracts import MoECommOverlap  # noqa: E402
from forge_lightning.modules.llm.megatron import unwrap  # noqa: E402


def main(out: Path, names: list[str]) -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    results = {}
    for name in names:
        config = moe_config(name)
        batches = micro_batches(config, 4)[dp_rank::dp_size]  # two micro-batches per DP rank
        for overlapped in (False, True):
            overlap = MoECommOverlap(moe_shared_expert_overlap=overlapped)
            chunks = build_twin(native_model(config), moe_overlap=overlap, expert_model_parallel_size=2)
            layers = [
                layer.mlp for layer in unwrap(chunks[0]).decoder.layers if hasattr(layer.mlp, "experts")
            ]
            run = megatron_run(chunks, config, batches)
            dist.all_reduce(run["sums"], group=parallel_state.get_data_parallel_group())
            overlaps = [moe.shared_expert_overlap for moe in layers]
            results[name, overlapped] = {"sums": run["sums"], "grads": run["grads"], "overlaps": overlaps}
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, out)
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
