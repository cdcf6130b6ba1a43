"""The composed Qwen3-VL-MoE model against transformers' ``Qwen3VLMoeForConditionalGeneration`` on a tiny random
checkpoint (fp32): logits within 1e-4 (max abs), the loss with the load-balancing term (``output_router_logits``,
padding left out) within 1e-5 (relative), every parameter's gradient within 1e-4 (relative L2), on one batch of two
images, a text-only row and a video beside an image; the experts load from transformers' fused layout and from the
published (transposed) one; checkpoints written by us load in transformers with the same logits; a short training
run of ``VisionLanguageModule`` adds the aux loss as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from qwen_vl_parity import (
    IMAGE,
    VIDEO,
    VOCAB,
    assert_export_loads,
    assert_matches_transformers,
    hf_checkpoint,
    hf_logits,
    labels,
    pixels,
    placeholders,
    right_padded,
    text,
)
from safetensors.torch import load_file, save_file
from tiny import TINY_QWEN3_VL_TEXT
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from forge_lightning.modules.layers import MoEBlock
from forge_lightning.modules.vlm import VisionLanguageModule, VLMConfig, from_pretrained

PATCH = 4
NUM_EXPERTS, TOP_K = 6, 2
# Three decoder layers, the middle one dense (mlp_only_layers), two DeepStack layers. A large aux-loss weight, so
# that the load-balancing term moves the loss and the router gradients measurably.
TEXT = dict(
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    **{**TINY_QWEN3_VL_TEXT, "num_hidden_layers": 3},
    num_experts=NUM_EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=24,  # 2 * 24 and 24 both differ from hidden 64: the published layout is unambiguous
    mlp_only_layers=[1],
    router_aux_loss_coef=0.5,
)
VISION = dict(
    depth=3,
    deepstack_visual_indexes=[0, 2],
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    num_position_embeddings=16,
)
IMG_A, IMG_B, VID = (1, 4, 6), (1, 6, 4), (2, 4, 4)
# The smallest gap between a token's K-th and (K+1)-th routing probability that the batch must keep, so that
# rounding differences between the two implementations cannot swap an expert (a top-k tie).
MIN_TOPK_GAP = 1e-4


def _hf_checkpoint(path: Path) -> Qwen3VLMoeForConditionalGeneration:
    return hf_checkpoint(Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig, TEXT, VISION, path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    _hf_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint: Path) -> tuple[Qwen3VLMoeForConditionalGeneration, object]:
    return Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoint).eval(), from_pretrained(checkpoint)


def _video(grid: tuple[int, int, int], seed: int) -> list[int]:
    """Per temporal patch a timestamp (two text tokens here) and the frame's placeholder run."""
    return sum((text(2, seed + k) + placeholders(VIDEO, (1, *grid[1:])) for k in range(grid[0])), [])


def _batch() -> dict[str, torch.Tensor]:
    ids, mask = right_padded(
        [
            text(3, 0) + placeholders(IMAGE, IMG_A) + text(4, 1) + placeholders(IMAGE, IMG_B) + text(2, 2),
            text(9, 3),
            text(2, 4) + _video(VID, 20) + text(3, 5) + placeholders(IMAGE, IMG_A) + text(2, 6),
        ]
    )
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels([IMG_A, IMG_B, IMG_A], 0, PATCH),
        image_grid_thw=torch.tensor([IMG_A, IMG_B, IMG_A]),
        pixel_values_videos=pixels([VID], 1, PATCH),
        video_grid_thw=torch.tensor([VID]),
    )


def test_config_reads_and_round_trips(checkpoint: Path) -> None:
    hf = json.loads((checkpoint / "config.json").read_text())
    config = VLMConfig.from_hf(hf)
    assert config.family.name == "Qwen3-VL-MoE" and config.vision_type == "qwen3_vit"
    moe = config.llm.moe
    assert config.llm.architecture == "qwen3_vl_moe_text" and config.llm.mrope_interleaved
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size) == (NUM_EXPERTS, TOP_K, 24)
    assert moe.norm_topk_prob and moe.dense_layers == [1] and moe.aux_loss_coef == 0.5
    assert VLMConfig.from_hf(config.to_hf()) == config
    back = Qwen3VLMoeConfig(**config.to_hf()).text_config
    assert (back.num_experts, back.mlp_only_layers, back.router_aux_loss_coef) == (NUM_EXPERTS, [1], 0.5)


def test_logits_loss_aux_loss_and_gradients_match_transformers(pair) -> None:
    hf, model = pair
    batch = _batch()
    with torch.no_grad():
        model(**batch)
    for block in model.llm.moe_blocks():
        top = block.stats.probs.topk(TOP_K + 1, dim=-1).values
        assert (top[:, TOP_K - 1] - top[:, TOP_K]).min() > MIN_TOPK_GAP
    errors = assert_matches_transformers(hf, model, batch, router_aux=True)
    assert errors["aux_loss"] <= 1e-5


def test_the_router_loss_leaves_padding_out(pair) -> None:
    """Over a right-padded batch, the masked expert loads are those of the rows run alone without their padding
    (routing is per token), and the padding would change the load-balancing loss."""
    _, model = pair
    ids = torch.tensor([text(9, 3), text(9, 7)])
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        model(ids[:1])
        first = model.llm.router_losses()
        model(ids[1:, :5])
        second = model.llm.router_losses()
        model(ids, attention_mask=mask)
        masked, unmasked = model.llm.router_losses(mask), model.llm.router_losses()
    torch.testing.assert_close(masked.tokens_per_expert, first.tokens_per_expert + second.tokens_per_expert)
    assert masked.tokens_per_expert.sum() == 14 * TOP_K * len(model.llm.moe_blocks())
    assert not torch.equal(masked.aux_loss, unmasked.aux_loss)


def test_published_expert_layout_loads(pair, checkpoint: Path, tmp_path: Path) -> None:
    """Released Qwen3-VL-MoE files hold ``gate_up_proj [E, D, 2I]`` and ``down_proj [E, I, D]``: both we and
    transformers read them into the in-memory layout, with equal logits."""
    hf, model = pair
    state = load_file(checkpoint / "model.safetensors")
    fused = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4
    state.update({k: state[k].transpose(1, 2).contiguous() for k in fused})
    tmp_path.mkdir(exist_ok=True)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    published = from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, published.state_dict()[name]), name
    batch = _batch()
    with torch.no_grad():
        theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()
        keep = batch["attention_mask"].bool()
        assert (published(**batch) - hf_logits(theirs, batch)[0])[keep].abs().max() <= 1e-4


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path: Path) -> None:
    _, model = pair
    out = assert_export_loads(model, Qwen3VLMoeForConditionalGeneration, _batch(), tmp_path / "ours")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "qwen3_vl_moe" and saved["text_config"]["model_type"] == "qwen3_vl_moe_text"
    weights = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    # The experts fused, in the model's layout, as transformers 5 writes them.
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in weights


class _FirstLoss(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_training_adds_the_aux_loss_as_transformers_does(pair, checkpoint: Path, tmp_path: Path) -> None:
    """The first step's training loss is transformers' loss with ``output_router_logits`` (cross-entropy plus the
    weighted load-balancing loss over the unpadded tokens); four steps on the batch lower it."""
    hf, _ = pair
    batch = _batch()
    target = labels(batch)
    with torch.no_grad():
        want = hf_logits(hf, batch, labels=target, output_router_logits=True)[1].loss.item()
    # VisionTextData's batches: labels shifted to the predicting position, the step's trained token count.
    train = {**batch, "labels": torch.cat([target[:, 1:], torch.full_like(target[:, :1], -100)], dim=1)}
    train["step_tokens"] = (train["labels"] != -100).sum()
    module = VisionLanguageModule.from_pretrained(
        checkpoint,
        optimizer={"lr": 1e-2, "weight_decay": 0.0},
        scheduler={"name": "constant", "warmup_steps": 0},
    )
    losses = _FirstLoss()
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([train] * 4, batch_size=None))
    assert abs(losses.losses[0] - want) <= 1e-5 * want, (losses.losses[0], want)
    assert losses.losses[-1] < losses.losses[0]
    assert "train/router_aux_loss" in trainer.callback_metrics
    assert isinstance(module.model.llm.model.layers[0].mlp, MoEBlock)
