"""Worker: the megatron twin at context_parallel_size = 2 (TP = PP = DP = 1; Ulysses attention, or ring attention
with cp_comm_type p2p) or at the 4-process layouts; writes, on rank 0, each config's loss parts and gradients
(Hugging Face names) for test_context_parallel.py to compare with the native model on one process.

``python -m torch.distributed.run --nproc-per-node 2 context_parallel_worker.py OUT_FILE LAYOUT[,LAYOUT] NAME...``
(gloo, CPU shim; layouts from :data:`LAYOUTS`: ``cp4_a2a_p2p`` on 4 processes is in the suite, the other 4-process
ones run by hand; EP layouts skip dense configs). The ranks of the CP group get the same full micro-batches; the
strategy's schedule gives each its share of the sequence.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_reference import moe_config
from worker_exit import exit_worker

from forge_lightning.modules.llm.config import LLMConfig

# Llama (GQA: one key/value group per CP rank), Qwen3 with MQA (q/k norm, head_dim != hidden / heads; the single
# key/value head is repeated to the query heads before the exchange), and the MoE twins (router losses included).
DENSE_CONFIGS = {
    "llama_gqa": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3_mqa": dict(
        architecture="qwen3", qk_norm=True, num_kv_heads=1, head_dim=32, tie_word_embeddings=True
    ),
}


LAYOUTS = {
    "cp2": dict(context_parallel_size=2),
    "cp2_ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),  # experts split over the CP ranks
    "cp2_tp2_sp": dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "cp2_pp2": dict(context_parallel_size=2, pipeline_model_parallel_size=2),
    "cp2_p2p": dict(context_parallel_size=2, cp_comm_type="p2p"),  # ring attention
    "cp4_a2a_p2p": dict(  # Ulysses over 2 ranks x a ring of 2 (megatron's hierarchical CP groups)
        context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]
    ),
}


def cp_config(name: str) -> LLMConfig:
    if name in DENSE_CONFIGS:
        return LLMConfig.from_preset("debug", **DENSE_CONFIGS[name])
    return moe_config(name)


def main(out: Path, layouts: list[str], names: list[str]) -> None:
    import cuda_shim

    cuda_shim.install()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from moe_reference import build_twin, megatron_run, micro_batches, native_model

    from forge_lightning.modules.llm.megatron import unwrap

    dist.init_process_group("gloo")
    results = {}
    for layout in layouts:
        degrees = LAYOUTS[layout]
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=degrees.get("tensor_model_parallel_size", 1),
            pipeline_model_parallel_size=degrees.get("pipeline_model_parallel_size", 1),
            context_parallel_size=degrees["context_parallel_size"],
            expert_model_parallel_size=degrees.get("expert_model_parallel_size", 1),
            hierarchical_context_parallel_sizes=degrees.get("hierarchical_context_parallel_sizes"),
        )
        model_parallel_cuda_manual_seed(0)  # megatron's RNG tracker (sequence-parallel embedding dropout)
        assert parallel_state.get_data_parallel_world_size() == 1
        for name in names:
            config = cp_config(name)
            if degrees.get("expert_model_parallel_size", 1) > 1 and config.moe is None:
                continue
            chunks = build_twin(native_model(config), **degrees)
            layers = unwrap(chunks[0]).decoder.layers
            # the chosen CP attention is on
            cps = [layer.self_attention.core_attention.cp for layer in layers]
            assert all(cp.size == degrees["context_parallel_size"] for cp in cps)
            assert all(cp.comm_type == degrees.get("cp_comm_type", "a2a") for cp in cps)
            run = megatron_run(chunks, config, micro_batches(config, 2))
            # Each rank's sums are over its half of every sequence: the batch's are their sum over DP x CP.
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            dist.all_reduce(run["sums"], group=dp_cp)
            results[layout, name] = run
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, out)
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:])
