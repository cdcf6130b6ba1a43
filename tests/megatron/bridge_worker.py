"""2-process worker: load a Hugging Face directory at TP=2, write the gathered logits and the exported weights.

``python -m torch.distributed.run --nproc-per-node 2 bridge_worker.py HF_DIR OUT_DIR`` (gloo, CPU shim).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from worker_exit import exit_worker  # noqa: E402

from forge_lightning.modules.llm.config import LLMConfig  # noqa: E402
from forge_lightning.modules.llm.megatron import (  # noqa: E402  # noqa: E402
    build_gpt_model,
    export_hf_state,
    gpt_decoder_spec,
    load_hf_checkpoint,
    transformer_config,
)


def main(hf_dir: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config = LLMConfig.load(hf_dir)
    tf = transformer_config(config, tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model = build_gpt_model(config, tf, gpt_decoder_spec(tf), pre_process=True, post_process=True).eval()
    load_hf_checkpoint([model], config, hf_dir)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        local = model(ids, None, None)  # [b, s, vocab / 2]: this rank's vocabulary shard
    shards = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(shards, local.contiguous())
    state = export_hf_state([model], config)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(torch.cat(shards, dim=-1), out / "logits.pt")
        save_file(state, out / "exported.safetensors")
    parallel_state.destroy_model_parallel()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
