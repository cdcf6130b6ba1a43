"""2-process worker for the Muon-under-megatron tests: every case in one set of processes (gloo, CPU shim).

``python -m torch.distributed.run --nproc-per-node 2 muon_worker.py OUT_DIR CASE...``; each case writes
``OUT_DIR/<case>.pt`` on global rank 0 (``torch.load(..., weights_only=False)``):

* ``exchange``: the dense debug twin at TP = 2: the full matrices :class:`TensorParallelExchange` gathers for each
  owner (by megatron name), and whether ``publish`` of ``2 * full + rank`` gives each rank ``2 * shard + owner``;
* ``dense_tp2`` / ``dense_tp1`` / ``dense_pp2``: the dense twin's Hugging Face weights after ``STEPS`` Muon steps
  at TP = 2, at TP = 1 (DP = 2, each rank half of every global batch) and at PP = 2, fp32;
* ``moe_ep2`` / ``moe_tp2_sp`` / ``moe_tp2_sp_etp1`` / ``moe_ep1``: the same for the Qwen3-MoE debug twin at
  EP = 2, at TP = 2 with sequence parallelism (experts split over TP: the expert TP group exchanges them, or whole
  on both ranks at ETP = 1) and at EP = 1 (DP = 2); ``deepseek_ep2``: the DeepSeek-V3 debug twin (MLA) at EP = 2;
* ``resume``: TP = 2, a dist-checkpoint after the first step (megatron ``sharded_state_dict``, model + optimizer),
  then fresh chunks and optimizer load it and take the remaining steps at TP = 2 and at TP = 1.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from moe_reference import build_twin, moe_config  # noqa: E402
from moe_reference import native_model as moe_native_model  # noqa: E402
from muon_reference import (  # noqa: E402
    dense_config,
    megatron_optimizer,
    megatron_step,
    native_model,
    step_batches,
    twin_chunks,
)
from worker_exit import exit_worker  # noqa: E402

from forge_lightning.optim.muon_exchange import newton_schulz_flops  # noqa: E402
from forge_lightning.strategies.megatron.muon import TensorParallelExchange  # noqa: E402


@torch.no_grad()
def exchange_case() -> dict:
    """Gather every 2-D parameter of the TP = 2 twin onto its owner, publish a result that names its owner."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    (chunk,) = twin_chunks(dense_config(), tensor_model_parallel_size=2)
    named = [(n, p) for n, p in chunk.named_parameters() if p.ndim == 2]
    params = [p for _, p in named]  # the parameters themselves: they carry megatron's TP marks
    group = parallel_state.get_tensor_model_parallel_group()
    exchange = TensorParallelExchange(params, [newton_schulz_flops(p.shape) for p in params], group)
    full = exchange.gather(params)
    owners = {n: exchange.owners[i] for i, (n, _) in enumerate(named)}
    results = {i: 2 * f + exchange.rank for i, f in full.items()}
    out = exchange.publish(results)
    published = all(
        torch.equal(o, 2 * p + exchange.owners[i]) for i, (o, p) in enumerate(zip(out, params, strict=True))
    )

    gathered = [None, None]
    dist.all_gather_object(gathered, {named[i][0]: f for i, f in full.items()})
    parallel_state.destroy_model_parallel()
    return {
        "full": {**gathered[0], **gathered[1]},
        "owners": owners,
        "published": published,
        "sharded": [n for n, p in named if getattr(p, "tensor_model_parallel", False)],
    }


def _layout(**degrees: int) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=degrees.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=degrees.get("pipeline_model_parallel_size", 1),
        expert_model_parallel_size=degrees.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=degrees.get("expert_tensor_parallel_size"),
    )
    model_parallel_cuda_manual_seed(0)


def _train(config, degrees: dict, steps: list, chunks=None, optimizer=None) -> tuple:
    """``steps`` optimizer steps of the twin at ``degrees`` (parallel state set), each DP rank its share of every
    global batch; returns the chunks and the optimizer."""
    if chunks is None:
        model = native_model(config) if config.moe is None else moe_native_model(config)
        chunks = build_twin(model, **degrees)
        optimizer = megatron_optimizer(chunks)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    for batches in steps:
        megatron_step(chunks, optimizer, config, batches[dp_rank::dp_size])
    return chunks, optimizer


def _hf_weights(chunks, config) -> dict:
    from forge_lightning.modules.llm.megatron import export_hf_state

    return export_hf_state(chunks, config)


def _trained(config, **degrees: int) -> dict:
    _layout(**degrees)
    chunks, _ = _train(config, degrees, step_batches(config))
    weights = _hf_weights(chunks, config)
    parallel_state.destroy_model_parallel()
    return weights


def resume_case(out: Path) -> dict:
    """Save after one step at TP = 2; resume from it at TP = 2 and TP = 1 for the remaining steps."""
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    config, steps = dense_config(), step_batches(dense_config())
    path = out / "resume.ckpt"
    tp2 = dict(tensor_model_parallel_size=2)
    _layout(**tp2)
    chunks, optimizer = _train(config, tp2, steps[:1])
    state = {ckpt.SHARDED_KEY: ckpt.sharded_state_dict(chunks, optimizer, is_loading=False)}
    ckpt.MegatronCheckpointIO().save_checkpoint({**state, ckpt.HF_CONFIG_KEY: config.to_hf()}, path)
    dist.barrier()
    _train(config, tp2, steps[1:], chunks, optimizer)
    results = {"uninterrupted": _hf_weights(chunks, config)}
    parallel_state.destroy_model_parallel()
    for name, degrees in (("tp2", tp2), ("tp1", {})):
        _layout(**degrees)
        chunks = build_twin(
            native_model(config, seed=1), **degrees
        )  # other weights: the load must replace them
        optimizer = megatron_optimizer(chunks)
        template = ckpt.sharded_state_dict(chunks, optimizer, is_loading=True)
        loaded = ckpt.MegatronCheckpointIO().load_checkpoint(path, sharded_state_dict=template)
        ckpt.load_into(chunks, optimizer, loaded.pop(ckpt.SHARDED_KEY))
        _train(config, degrees, steps[1:], chunks, optimizer)
        results[name] = _hf_weights(chunks, config)
        parallel_state.destroy_model_parallel()
    return results


CASES = {
    "exchange": lambda out: exchange_case(),
    "dense_tp2": lambda out: _trained(dense_config(), tensor_model_parallel_size=2),
    "dense_tp1": lambda out: _trained(dense_config()),
    "dense_pp2": lambda out: _trained(dense_config(), pipeline_model_parallel_size=2),
    "moe_ep2": lambda out: _trained(moe_config("qwen3_moe"), expert_model_parallel_size=2),
    "moe_tp2_sp": lambda out: _trained(
        moe_config("qwen3_moe"), tensor_model_parallel_size=2, sequence_parallel=True
    ),
    "moe_tp2_sp_etp1": lambda out: _trained(
        moe_config("qwen3_moe"),
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_tensor_parallel_size=1,
    ),
    "moe_ep1": lambda out: _trained(moe_config("qwen3_moe")),
    "deepseek_ep2": lambda out: _trained(moe_config("deepseek_v3"), expert_model_parallel_size=2),
    "resume": resume_case,
}


def main(out: Path, cases: list[str]) -> None:
    dist.init_process_group("gloo")
    for case in cases:
        result = CASES[case](out)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{case}.pt")
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
