"""Pi0.5 against lerobot 0.6.1's ``PI05Policy``: same weights, inputs, noise and flow times -> same numbers.

The reference (``tests/fixtures/pi05``) was computed by lerobot itself; these tests load its checkpoint with
our loader and compare every stage: prompts and tokens, image preprocessing, prefix embeddings, the per-element
flow-matching loss, the policy's mean loss, and the denoised action chunks.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.modules.embodied import (
    Pi05,
    Pi05Config,
    Pi05Inputs,
    Pi05Policy,
    PromptTokenizer,
    build_prompts,
    load_lerobot_checkpoint,
    to_lerobot_state_dict,
)
from forge_lightning.modules.llm.hf import load_hf_state_dict

LOSS_RTOL = 1e-4
ACTION_ATOL = 1e-4


@pytest.fixture(scope="module")
def policy(fixture_dir, meta) -> Pi05Policy:
    return Pi05Policy(
        "debug",
        pretrained=str(fixture_dir),
        tokenizer=str(fixture_dir / "tokenizer"),
        image_keys=meta["cameras"],
    ).eval()


def test_debug_preset_is_the_fixture_size(fixture_dir, meta):
    lerobot_config = json.loads((fixture_dir / "config.json").read_text())
    sizes = meta["sizes"]
    gemma = {
        name: {
            "hidden_size": s["width"],
            "intermediate_size": s["mlp_dim"],
            "num_layers": s["depth"],
            "num_heads": s["num_heads"],
            "num_kv_heads": s["num_kv_heads"],
            "head_dim": s["head_dim"],
        }
        for name, s in (("llm", sizes["llm"]), ("action_expert", sizes["action_expert"]))
    }
    vision = {
        k.replace("num_hidden_layers", "num_layers").replace("num_attention_heads", "num_heads"): v
        for k, v in sizes["vision"].items()
    }
    read = Pi05Config.from_lerobot(lerobot_config, vision=vision, vocab_size=meta["vocab_size"], **gemma)
    assert read == Pi05Config.from_preset("debug")
    # Without overrides, lerobot's variant names give the public sizes, the other fields come from the file.
    with pytest.raises(ValueError, match=r"vision.patch_size \(14\) must divide vision.image_size \(32\)"):
        Pi05Config.load(fixture_dir)
    public = Pi05Config.load({**lerobot_config, "image_resolution": [224, 224]})
    assert public.llm.hidden_size == 2048 and public.action_expert.hidden_size == 1024
    assert (public.chunk_size, public.max_action_dim, public.num_inference_steps) == (5, 6, 4)


def test_prompts_and_tokens_match_lerobot(fixture_dir, meta, inputs):
    prompts = build_prompts(meta["tasks"], inputs["observation.state"])
    assert prompts == meta["prompts"]  # -1.05 -> bin -1, 1.0 -> bin 255, as lerobot bins them
    tokens, mask = PromptTokenizer(fixture_dir / "tokenizer", meta["sizes"]["tokenizer_max_length"])(prompts)
    assert torch.equal(tokens, inputs["tokens"]) and torch.equal(mask, inputs["token_mask"])


def test_images_and_prefix_match_lerobot(policy, lerobot_batch, expected):
    model_inputs = policy.prepare_inputs(lerobot_batch)
    torch.testing.assert_close(model_inputs.images, expected["images_preprocessed"], rtol=0, atol=1e-6)
    assert torch.equal(model_inputs.image_mask, expected["image_masks"])  # the third camera is missing
    with torch.no_grad():
        embeddings, _ = policy.model.embed_prefix(model_inputs)
    torch.testing.assert_close(embeddings, expected["prefix_embs"], rtol=1e-5, atol=1e-5)


def test_loss_matches_lerobot(policy, lerobot_batch, inputs, expected):
    with torch.no_grad():
        model_inputs = policy.prepare_inputs(lerobot_batch)
        actions = policy.prepare_actions(lerobot_batch)
        elements = policy.model.forward_loss(model_inputs, actions, inputs["noise"], inputs["time"])
        mean = policy.loss(lerobot_batch, noise=inputs["noise"], time=inputs["time"])
    torch.testing.assert_close(elements, expected["loss_elements"], rtol=LOSS_RTOL, atol=1e-5)
    assert abs(mean.item() - expected["loss_mean"].item()) <= LOSS_RTOL * expected["loss_mean"].item()


def test_actions_match_lerobot(policy, lerobot_batch, inputs, expected, meta):
    noise = inputs["sample_noise"]
    model_inputs = policy.prepare_inputs(lerobot_batch)
    padded = policy.model.predict_action_chunk(
        model_inputs, noise=noise, num_steps=meta["num_inference_steps"]
    )
    torch.testing.assert_close(padded, expected["sample_actions"], rtol=0, atol=ACTION_ATOL)
    chunk = policy.predict_action_chunk(lerobot_batch, noise=noise)  # no statistics: normalised, padded
    torch.testing.assert_close(chunk[..., :4], expected["predict_action_chunk"], rtol=0, atol=ACTION_ATOL)


def test_checkpoint_layout_round_trips(fixture_dir):
    reference = load_hf_state_dict(fixture_dir)
    model = load_lerobot_checkpoint(Pi05(Pi05Config.from_preset("debug")), fixture_dir)
    exported = to_lerobot_state_dict(model)
    assert set(exported) == set(reference)
    for key, tensor in exported.items():
        assert tensor.shape == reference[key].shape, key
        if not key.endswith("lm_head.weight"):  # the unused heads are not kept
            assert torch.equal(tensor, reference[key]), key


def test_public_size_layout_matches_lerobot(fixture_dir):
    """Every tensor of lerobot's public-size policy (4.14 B parameters) has its place in ours, same shape."""
    layout = json.loads((fixture_dir / "pi05_base_layout.json").read_text())
    with torch.device("meta"):
        model = Pi05(Pi05Config.from_preset("pi05-base"))
    exported = {k: list(v.shape) for k, v in to_lerobot_state_dict(model).items()}
    assert exported == layout
    assert (
        sum(p.numel() for p in model.parameters())
        + sum(layout[k][0] * layout[k][1] for k in layout if k.endswith("lm_head.weight"))
        == 4_143_404_816
    )


def test_padding_does_not_change_the_loss(policy, lerobot_batch, inputs):
    """Extra prompt padding shifts no position and is never attended to."""
    with torch.no_grad():
        model_inputs = policy.prepare_inputs(lerobot_batch)
        actions = policy.prepare_actions(lerobot_batch)
        longer = Pi05Inputs(
            model_inputs.images,
            model_inputs.image_mask,
            F.pad(model_inputs.tokens, (0, 7)),
            F.pad(model_inputs.token_mask, (0, 7)),
        )
        base = policy.model.forward_loss(model_inputs, actions, inputs["noise"], inputs["time"])
        padded = policy.model.forward_loss(longer, actions, inputs["noise"], inputs["time"])
    torch.testing.assert_close(padded, base, rtol=1e-5, atol=1e-6)
