"""2-process worker: for each layout, fill the megatron chunks from the safetensors slices and from the full native
model (the reference), and record whether they are bit-identical and how many elements each rank read.

``python -m torch.distributed.run --nproc-per-node 2 sliced_load_worker.py OUT_JSON ARCH:HF_DIR:TP:PP:EP ...``
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from worker_exit import exit_worker  # noqa: E402

from forge_lightning.modules.llm.hf import split_experts  # noqa: E402
from forge_lightning.modules.llm.megatron import (  # noqa: E402  # noqa: E402
    build_gpt_model,
    gpt_decoder_spec,
    load_hf_checkpoint,
    load_state,
    transformer_config,
)
from forge_lightning.modules.llm.module import CausalLM  # noqa: E402


def compare(hf_dir: str, tp: int, pp: int, ep: int) -> dict:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    module = CausalLM(config=hf_dir, pretrained=hf_dir)  # the reference: the full native model on every rank
    config = module.config
    tf = transformer_config(
        config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1 and config.moe is not None,
        pipeline_dtype=torch.float32,
    )

    def build():
        return build_gpt_model(
            config,
            tf,
            gpt_decoder_spec(tf),
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )

    full, sliced = build(), build()
    load_state([full], config, split_experts(module.model.state_dict()).__getitem__)
    files = load_hf_checkpoint([sliced], config, hf_dir)
    a, b = dict(full.named_parameters()), dict(sliced.named_parameters())
    differ = sorted(k for k in a if not (a[k].dtype == b[k].dtype and a[k].equal(b[k])))
    result = {
        "differ": differ,
        "params": len(a),
        "read": files.elements_read,
        "rank_params": sum(p.numel() for p in a.values()),
        "total": sum(p.numel() for p in module.model.parameters()),
    }
    parallel_state.destroy_model_parallel()
    return result


def main(out: Path, cases: list[str]) -> None:
    dist.init_process_group("gloo")
    results = {}
    for case in cases:
        arch, hf_dir, tp, pp, ep = case.split(":")
        results[f"{arch} tp{tp} pp{pp} ep{ep}"] = compare(hf_dir, int(tp), int(pp), int(ep))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
