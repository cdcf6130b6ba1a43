"""2-process worker: tiny Qwen2.5-VL and Qwen3-VL ``VisionLanguageModule``s under MegatronStrategy, one
``Trainer.fit`` per case in the same processes (megatron-core is imported once).

``python -m torch.distributed.run --nproc-per-node 2 vlm_qwen_worker.py OUT_DIR CASE...`` (gloo, CPU shim; cases
from :data:`CASES`; the models' ``config.json`` under ``OUT_DIR/<model>``, written by :func:`write_configs`). Each
case writes its CSV log under ``OUT_DIR/CASE`` (global rank 0) and, per rank, ``OUT_DIR/CASE_rank{r}.pt``: the
module's state dict after the fit. test_vlm_qwen.py compares them with the same module trained on one process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from components_worker import main, trainer_kwargs
from qwen_vl_parity import END, IMAGE, START, VIDEO, VOCAB, pixels, placeholders
from tiny import TINY_QWEN2_5_VL_TEXT, TINY_QWEN3_VL_TEXT
from torch.utils.data import DataLoader, DistributedSampler
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

from forge_lightning.modules.vlm import VisionLanguageModule

SEED = 13
PATCH = 4
SEQ = 40
IMG_A, IMG_B, IMG_C, VID = (1, 4, 6), (1, 4, 4), (1, 6, 4), (2, 4, 4)  # 6, 4, 6 and 2 x 4 merged tokens
VISION = dict(hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=PATCH)
TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
# Qwen2.5-VL: chunked M-RoPE [2, 3, 3], windowed ViT blocks; Qwen3-VL: interleaved M-RoPE [6, 5, 5] and DeepStack
# features of both ViT blocks added after the LLM's first two of four layers (all on the first stage at PP 2).
MODELS = {
    "qwen2_5_vl": Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, **TINY_QWEN2_5_VL_TEXT),
        vision_config=dict(
            VISION, depth=2, fullatt_block_indexes=[1], window_size=4 * PATCH, tokens_per_second=2
        ),
        **TOKENS,
    ),
    "qwen3_vl": Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, **{**TINY_QWEN3_VL_TEXT, "num_hidden_layers": 4}),
        vision_config=dict(VISION, depth=2, deepstack_visual_indexes=[0, 1], num_position_embeddings=16),
        **TOKENS,
    ),
}
# strategy: MegatronStrategy options; batch 3 and accumulate 3 as vlm_worker.py (the second TP rank encodes sample 2
# and a padding copy of it; 1F1B over 3 micro-batches), DP = 1: the global batch is the one-process reference's.
CASES = {
    "qwen2_5_vl_tp2": dict(
        model="qwen2_5_vl",
        strategy=dict(tensor_model_parallel_size=2, components={"vision": {"recompute": "full"}}),
    ),
    "qwen2_5_vl_pp2": dict(model="qwen2_5_vl", strategy=dict(pipeline_model_parallel_size=2)),
    "qwen3_vl_tp2_sp": dict(
        model="qwen3_vl", strategy=dict(tensor_model_parallel_size=2, sequence_parallel=True)
    ),
    "qwen3_vl_pp2": dict(model="qwen3_vl", strategy=dict(pipeline_model_parallel_size=2)),
}
BATCH, ACCUMULATE = 3, 3


def write_configs(out: Path) -> None:
    for name, config in MODELS.items():
        config.save_pretrained(out / name)


def build_module(out: Path, model: str) -> VisionLanguageModule:
    pl.seed_everything(SEED, verbose=False)
    return VisionLanguageModule(str(out / model), optimizer={"lr": 1e-3}, scheduler={"name": "constant"})


def _text(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 240, (n,), generator=g).tolist()


def _video(model: str, g: torch.Generator) -> list[int]:
    """Qwen2.5-VL: one placeholder run; Qwen3-VL: per frame a timestamp (two text tokens) and the frame's run."""
    if model == "qwen2_5_vl":
        return placeholders(VIDEO, VID)
    return sum((_text(2, g) + placeholders(VIDEO, (1, *VID[1:])) for _ in range(VID[0])), [])


def samples(model: str, count: int) -> list[dict]:
    """Samples in turn: an image and a video, text only (right padding), two images; at varying places."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for i in range(count):
        images, video = [[IMG_A], [], [IMG_B, IMG_C]][i % 3], i % 3 == 0
        ids = _text(1 + i % 4, g)
        for grid in images:
            ids += placeholders(IMAGE, grid) + _text(2, g)
        if video:
            ids += _video(model, g)
        ids += _text(SEQ + 1 - len(ids), g)
        ids_S = torch.tensor(ids)
        labels = ids_S[1:].clone()
        labels[(labels == IMAGE) | (labels == VIDEO)] = -100
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 1:  # right padding
            mask[-5:], labels[-5:] = 0, -100
        item = {"input_ids": ids_S[:-1] * mask, "labels": labels, "attention_mask": mask}
        item["pixel_values"] = pixels(images, 100 + i, PATCH)
        item["image_grid_thw"] = torch.tensor(images, dtype=torch.long).view(-1, 3)
        item["pixel_values_videos"] = pixels([VID] if video else [], 200 + i, PATCH)
        item["video_grid_thw"] = torch.tensor([VID] if video else [], dtype=torch.long).view(-1, 3)
        out.append(item)
    return out


def collate(items: list[dict]) -> dict:
    """Text stacked per sample, the images' and videos' patches and grids of all samples in order (as
    VLMDataModule gives them)."""
    batch = {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "labels", "attention_mask")}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        batch[key] = torch.cat([item[key] for item in items])
    return batch


def data(model: str) -> DataLoader:
    """The samples in order, on a sampler of one replica (DP = 1 in every case; see vlm_worker.py)."""
    dataset = samples(model, 36)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=collate)


def fit_kwargs(out: Path, name: str) -> dict:
    return trainer_kwargs(out, name, ACCUMULATE)


def run_case(out: Path, name: str) -> None:
    from forge_lightning.strategies.megatron import MegatronStrategy

    case = CASES[name]
    module = build_module(out, case["model"])
    trainer = pl.Trainer(devices=2, strategy=MegatronStrategy(**case["strategy"]), **fit_kwargs(out, name))
    loader = data(case["model"])
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save({"state": state}, out / f"{name}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:], run_case)
