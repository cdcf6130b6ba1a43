"""2-process worker: megatron-core's MoE communication overlap at EP = 2 (DP = 2) against the same twin without it:
``moe_shared_expert_overlap`` (fp32) and ``overlap_moe_expert_parallel_comm`` (bf16, which it needs: megatron's
combined 1F1B schedule through the twin's schedule plan), for MoE models with shared experts; writes, on rank 0,
each run's loss sums, gradients (Hugging Face names) and which overlap the built layers run.

``python -m torch.distributed.run --nproc-per-node 2 moe_overlap_worker.py OUT_FILE CONFIG_NAME...`` (gloo, CPU
shim: its CUDA streams are no-ops, so the overlapped code paths run their parts in order).
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from moe_reference import decoder_twin, megatron_run, micro_batches, moe_config, native_model  # noqa: E402
from worker_exit import exit_worker  # noqa: E402

from forge_lightning.contracts import MegatronDims, MoECommOverlap  # noqa: E402
from forge_lightning.modules.llm.megatron import unwrap  # noqa: E402
from forge_lightning.strategies.megatron.wrapping import wrap_ddp  # noqa: E402

KINDS = ("moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm")
EP2 = MegatronDims(expert_model_parallel_size=2)


def main(out: Path, names: list[str]) -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    results = {}
    for name, kind, overlapped in itertools.product(names, KINDS, (False, True)):
        config = moe_config(name)
        batches = micro_batches(config, 4)[dp_rank::dp_size]  # two micro-batches per DP rank
        bf16 = kind == "overlap_moe_expert_parallel_comm"
        twin = decoder_twin(
            native_model(config), bf16=bf16, moe_overlap=MoECommOverlap(**{kind: overlapped}), **EP2.as_dict()
        )
        chunks = wrap_ddp(twin.build_chunks(), EP2, overlap_grad_reduce=False)
        gpt = unwrap(chunks[0])
        run = megatron_run(chunks, config, batches)
        dist.all_reduce(run["sums"], group=parallel_state.get_data_parallel_group())
        results[name, kind, overlapped] = {
            "sums": run["sums"],
            "grads": run["grads"],
            "shared_overlap": [
                layer.mlp.shared_expert_overlap
                for layer in gpt.decoder.layers
                if hasattr(layer.mlp, "experts")
            ],
            "expert_overlap": gpt.config.overlap_moe_expert_parallel_comm,
        }
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, out)
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
