"""``from_pretrained`` builds every VLM family on the meta device and makes the checkpoint's tensors its parameters:
for Qwen2.5-VL, Qwen3-VL (tied embeddings), Qwen3-VL-MoE, LLaVA with SigLIP and with CLIP, and LLaVA-OneVision the
parameters, the rebuilt buffers (rotary frequencies, M-RoPE axes) and the logits equal exactly those of a model built
on the CPU and filled by copying; the CPU bytes it allocates are the checkpoint's (one copy, measured by a dispatch
mode), half of what the CPU build allocates; a missing tensor is refused with its name, and so is a buffer that no
module can rebuild."""

from __future__ import annotations

import re

import pytest
import torch
from qwen_vl_parity import END, IMAGE, START, VIDEO, VOCAB, pixels, placeholders, text
from safetensors.torch import load_file, save_file
from tiny import TINY_LLM, TINY_QWEN2_5_VL_TEXT, TINY_QWEN3_TEXT, TINY_QWEN3_VL_TEXT, TINY_SIGLIP_VISION
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    CLIPVisionConfig,
    LlavaConfig,
    LlavaOnevisionConfig,
    Qwen2_5_VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    SiglipVisionConfig,
)

from forge_lightning.modules.layers.state_dict import assign_weights
from forge_lightning.modules.vlm import VisionLanguageModel, VLMConfig, save_pretrained
from forge_lightning.modules.vlm.hf import from_pretrained, load_pretrained

QWEN_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
QWEN_VISION = dict(hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4)
QWEN3_VISION = dict(**QWEN_VISION, depth=2, deepstack_visual_indexes=[0], num_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
LLAVA_IMAGE = 500


def _hf_config(family: str):
    text = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **TINY_QWEN3_VL_TEXT)
    if family == "qwen2_5_vl":
        vision = dict(**QWEN_VISION, depth=2, fullatt_block_indexes=[1], window_size=16)
        return Qwen2_5_VLConfig(
            text_config=dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **TINY_QWEN2_5_VL_TEXT),
            vision_config=vision,
            **QWEN_TOKENS,
        )
    if family == "qwen3_vl_tied":
        return Qwen3VLConfig(
            text_config=text, vision_config=QWEN3_VISION, tie_word_embeddings=True, **QWEN_TOKENS
        )
    if family == "qwen3_vl_moe":
        return Qwen3VLMoeConfig(text_config={**text, **MOE}, vision_config=QWEN3_VISION, **QWEN_TOKENS)
    llm = {**TINY_LLM, "vocab_size": VOCAB * 2}
    if family == "llava_siglip":
        return LlavaConfig(
            vision_config=SiglipVisionConfig(**TINY_SIGLIP_VISION),
            text_config=llm,
            image_token_index=LLAVA_IMAGE,
        )
    if family == "llava_clip":
        return LlavaConfig(
            vision_config=CLIPVisionConfig(**TINY_SIGLIP_VISION),
            text_config=llm,
            image_token_index=LLAVA_IMAGE,
        )
    return LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**TINY_SIGLIP_VISION, vision_use_head=False),
        text_config={**TINY_QWEN3_TEXT, "model_type": "qwen2", "vocab_size": VOCAB * 2},
        image_token_index=LLAVA_IMAGE,
        video_token_index=LLAVA_IMAGE + 1,
        image_grid_pinpoints=[[16, 16], [16, 32]],
    )


FAMILIES = ["qwen2_5_vl", "qwen3_vl_tied", "qwen3_vl_moe", "llava_siglip", "llava_clip", "llava_onevision"]


def _checkpoint(family: str, path) -> VLMConfig:
    """Our random model of ``family`` (every weight drawn anew), saved in its Hugging Face layout."""
    config = VLMConfig.from_hf(_hf_config(family).to_dict())
    torch.manual_seed(0)
    model = VisionLanguageModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    save_pretrained(model, config, path)
    return config


def _batch(config: VLMConfig) -> dict[str, torch.Tensor]:
    """An image and text (for LLaVA-OneVision, whose inputs are tiles, text only)."""
    if config.family.model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        grid = (1, 4, 4)
        ids = text(3, 0) + placeholders(IMAGE, grid) + text(4, 1)
        return dict(
            input_ids=torch.tensor([ids]),
            pixel_values=pixels([grid], 0, 4),
            image_grid_thw=torch.tensor([grid]),
        )
    if config.family.model_type == "llava":
        ids = text(3, 0) + [LLAVA_IMAGE] * config.vision.tokens_per_image + text(4, 1)
        image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        return dict(input_ids=torch.tensor([ids]), pixel_values=image)
    return dict(input_ids=torch.tensor([text(9, 0)]))


class _CPUBytes(TorchDispatchMode):
    """Counts the bytes of the CPU storages that the operations inside it create (each storage once)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self._seen = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self._seen:
                    self._seen.add(storage.data_ptr())
                    self.bytes += storage.nbytes()
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_meta_built_model_equals_the_copied_one(family: str, tmp_path) -> None:
    config = _checkpoint(family, tmp_path)
    with _CPUBytes() as meta_bytes:
        meta = from_pretrained(tmp_path)
    with _CPUBytes() as copy_bytes:
        copied = load_pretrained(VisionLanguageModel(meta.config), tmp_path)
    mine, theirs = dict(meta.named_buffers()), dict(copied.named_buffers())
    assert mine.keys() == theirs.keys() and any("inv_freq" in name for name in mine)
    for name, tensor in [*copied.state_dict().items(), *theirs.items()]:
        got = meta.state_dict().get(name, mine.get(name))
        assert got.device.type == "cpu" and got.dtype == tensor.dtype and torch.equal(got, tensor), name
    if config.llm.tie_word_embeddings:
        assert meta.llm.lm_head.weight is meta.llm.model.embed_tokens.weight
    batch = _batch(config)
    with torch.no_grad():
        assert torch.equal(meta(**batch), copied(**batch))
    weights = sum(p.numel() * p.element_size() for p in meta.parameters())
    # The meta build allocates the checkpoint's tensors (one copy); the CPU build a random init on top.
    assert meta_bytes.bytes <= 1.05 * weights + 65536, (meta_bytes.bytes, weights)
    assert copy_bytes.bytes >= 1.9 * weights, (copy_bytes.bytes, weights)


@pytest.mark.parametrize(
    ("family", "name", "named"),
    [
        (
            "qwen3_vl_moe",
            "model.language_model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.experts.down_proj",
        ),
        ("qwen3_vl_moe", "model.visual.blocks.1.attn.qkv.bias", "blocks.1.attn.qkv.bias"),
        ("llava_siglip", "multi_modal_projector.linear_1.weight", "linear_1.weight"),
    ],
)
def test_a_missing_tensor_is_refused_with_its_name(family: str, name: str, named: str, tmp_path) -> None:
    _checkpoint(family, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[name]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "forge-manifest.json").unlink()  # the export's hashes no longer hold
    with pytest.raises(ValueError, match=r"missing: " + re.escape(named)):
        from_pretrained(tmp_path)


class _Scaled(nn.Module):
    """A parameter beside a derived buffer, which its reset_parameters would also redraw: not rebuildable."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("scale", torch.empty(3), persistent=False)


def test_a_buffer_no_module_can_rebuild_is_refused() -> None:
    with torch.device("meta"):
        module = nn.Sequential(_Scaled())
    with pytest.raises(ValueError, match=r"cannot rebuild them .*: 0\.scale: _Scaled"):
        assign_weights(module, {"0.weight": torch.ones(3)})
    assert module[0].weight.is_meta  # nothing was assigned
