"""The Wan DiT against diffusers' ``WanTransformer3DModel`` on tiny random models (fp32, CPU).

Layouts: T2V (Wan 2.1 1.3B-like), I2V (image branch: image embedder, added k / v projections), FLF2V (I2V with
the image tokens' position embedding) and TI2V (Wan 2.2, per-token timesteps ``[B, S]``). Latents have an odd
frame count and non-square frames, batch 2. Outputs must agree to ``atol=1e-4``, the loss and every parameter's
gradient to 1e-4 of its largest magnitude; diffusers' directories (single-file and sharded) load into ours and ours
into diffusers with equal outputs; a packed batch of videos of different sizes equals each video run alone to
``atol=1e-5``.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from forge_lightning.contracts.plan import Component, ParallelPlan
from forge_lightning.modules.diffusion import WanDiT, WanDiTConfig, preset
from forge_lightning.performance.transforms import apply_activation_checkpointing

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)
LAYOUTS = {
    "t2v": TINY,
    "t2v-no-cross-norm": {**TINY, "cross_attn_norm": False},
    "i2v": {**TINY, "in_channels": 8, "image_dim": 20, "added_kv_proj_dim": 24},
    "flf2v": {**TINY, "in_channels": 8, "image_dim": 20, "added_kv_proj_dim": 24, "pos_embed_seq_len": 10},
    "ti2v": {**TINY, "patch_size": (1, 2, 2), "in_channels": 6, "out_channels": 6},
}
# diffusers' I2V attention takes the last 512 context tokens as the text (Wan's fixed umT5 length).
TEXT_LEN = {"i2v": 512, "flf2v": 512}
IMAGE_TOKENS = 5
LATENT = (3, 6, 8)  # frames, height, width: odd frame count, non-square
BATCH = 2


def _perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initialisation (norm weights of one, zero biases and position embeddings
    would hide a swapped or missing term)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _pair(layout: str) -> tuple[WanTransformer3DModel, WanDiT]:
    torch.manual_seed(0)
    ref = _perturbed(WanTransformer3DModel(**LAYOUTS[layout]))
    ours = WanDiT(WanDiTConfig.from_diffusers(dict(ref.config)))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(layout: str, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cfg = LAYOUTS[layout]
    x = torch.randn(BATCH, cfg["in_channels"], *LATENT, generator=gen)
    if (
        layout == "ti2v"
    ):  # per-token timesteps: the first frame's tokens clean (0), as Wan 2.2 TI2V conditions
        tokens_per_frame = (LATENT[1] // 2) * (LATENT[2] // 2)
        t = torch.rand(BATCH, 1, generator=gen) * 1000
        t = t.expand(BATCH, LATENT[0] * tokens_per_frame).clone()
        t[:, :tokens_per_frame] = 0.0
    else:
        t = torch.tensor([17.0, 803.5])
    inputs = {
        "hidden_states": x,
        "timestep": t,
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN.get(layout, 7), cfg["text_dim"], generator=gen),
    }
    if "image_dim" in cfg:
        # FLF2V: two images (first and last frame) per video, in consecutive rows.
        rows = 2 * BATCH if "pos_embed_seq_len" in cfg else BATCH
        inputs["encoder_hidden_states_image"] = torch.randn(
            rows, IMAGE_TOKENS, cfg["image_dim"], generator=gen
        )
    return inputs


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_match_diffusers(layout: str) -> None:
    ref, ours = _pair(layout)
    inputs = _inputs(layout)
    target = torch.randn(
        BATCH, LAYOUTS[layout]["out_channels"], *LATENT, generator=torch.Generator().manual_seed(2)
    )

    out_ref = ref(**inputs, return_dict=False)[0]
    out = ours(**inputs)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-4)

    loss_ref = torch.nn.functional.mse_loss(out_ref, target)
    loss = torch.nn.functional.mse_loss(out, target)
    assert abs(loss.item() - loss_ref.item()) <= 1e-4 * abs(loss_ref.item())
    loss_ref.backward()
    loss.backward()
    grads_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert _max_rel(p.grad, grads_ref[name].grad) <= 1e-4, name


def test_config_round_trip() -> None:
    for layout in LAYOUTS:
        ref = WanTransformer3DModel(**LAYOUTS[layout])
        config = WanDiTConfig.from_diffusers(dict(ref.config))
        written = config.to_diffusers()
        assert {k: v for k, v in written.items() if k != "_class_name"} == {
            k: list(v) if isinstance(v, tuple) else v for k, v in ref.config.items() if not k.startswith("_")
        }
        assert WanDiTConfig.from_diffusers(written) == config
    assert preset("debug").dim == 24


@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_export_loads_in_diffusers(tmp_path, shard: bool) -> None:
    _, ours = _pair("i2v")
    ours.save_pretrained(tmp_path / "out", max_shard_size=40_000 if shard else 5 * 10**9)
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file() == shard
    back = WanTransformer3DModel.from_pretrained(tmp_path / "out")
    inputs = _inputs("i2v")
    with torch.no_grad():
        torch.testing.assert_close(back(**inputs, return_dict=False)[0], ours(**inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_diffusers_directory_loads(tmp_path, shard: bool) -> None:
    ref, _ = _pair("ti2v")
    ref.save_pretrained(tmp_path / "ref", max_shard_size="40KB" if shard else "5GB")
    ours = WanDiT.from_pretrained(tmp_path / "ref")
    assert ours.config == WanDiTConfig.from_diffusers(dict(ref.config))
    inputs = _inputs("ti2v")
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs), ref(**inputs, return_dict=False)[0], rtol=0, atol=1e-5)


def test_strict_loading_names_the_tensor(tmp_path) -> None:
    ref, _ = _pair("t2v")
    ref.save_pretrained(tmp_path / "ref")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "ref" / "config.json").write_text(json.dumps({**config, "ffn_dim": 40}))
    with pytest.raises(ValueError, match=r"of another shape: blocks\.0\.ffn\.net\.0\.proj\.bias \[32\]"):
        WanDiT.from_pretrained(tmp_path / "ref")
    (tmp_path / "ref" / "config.json").write_text(json.dumps({**config, "cross_attn_norm": False}))
    with pytest.raises(ValueError, match=r"unexpected: blocks\.0\.norm2\.bias"):
        WanDiT.from_pretrained(tmp_path / "ref")
    (tmp_path / "ref" / "config.json").write_text(
        json.dumps({**config, "image_dim": 8, "added_kv_proj_dim": 24})
    )
    with pytest.raises(ValueError, match=r"missing: blocks\.0\.attn2\.add_k_proj\.bias"):
        WanDiT.from_pretrained(tmp_path / "ref")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match=r"image_dim \(20\) and added_kv_proj_dim \(None\) come together"):
        WanDiTConfig(image_dim=20)
    with pytest.raises(ValueError, match="does not know"):
        WanDiTConfig.from_diffusers({**TINY, "window_size": [-1, -1]})
    model = WanDiT(preset("debug", in_channels=4, out_channels=4))
    with pytest.raises(ValueError, match=r"must be a multiple of patch_size \(1, 2, 2\)"):
        model(torch.zeros(1, 4, 2, 5, 4), torch.zeros(1), torch.zeros(1, 3, 16))


# (frames, height, width) and text length of each packed video.
PACKED = [((3, 6, 8), 7), ((1, 4, 4), 3), ((2, 8, 6), 11)]


@pytest.mark.parametrize("layout", ["t2v", "i2v", "flf2v", "ti2v"])
def test_packed_equals_each_video_alone(layout: str) -> None:
    _, ours = _pair(layout)
    cfg = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    videos, timesteps, texts, images = [], [], [], []
    for i, (size, text_len) in enumerate(PACKED):
        videos.append(torch.randn(cfg["in_channels"], *size, generator=gen))
        tokens = size[0] * (size[1] // 2) * (size[2] // 2)
        timesteps.append(
            torch.rand(tokens, generator=gen) * 1000 if layout == "ti2v" else torch.tensor(100.0 * i + 5)
        )
        texts.append(torch.randn(text_len, cfg["text_dim"], generator=gen))
        num_images = 2 if "pos_embed_seq_len" in cfg else 1
        images.append(
            torch.randn(num_images * IMAGE_TOKENS, cfg["image_dim"], generator=gen)
            if "image_dim" in cfg
            else None
        )
    with torch.no_grad():
        packed = ours.forward_packed(videos, timesteps, texts, images if "image_dim" in cfg else None)
        for i, out in enumerate(packed):
            image = None if images[i] is None else images[i].reshape(-1, IMAGE_TOKENS, cfg["image_dim"])
            alone = ours(videos[i][None], timesteps[i][None], texts[i][None], image)[0]
            torch.testing.assert_close(out, alone, rtol=0, atol=1e-5)


def test_activation_checkpointing_through_the_parallel_plan() -> None:
    _, ours = _pair("i2v")
    plain = WanDiT(ours.config)
    plain.load_state_dict(ours.state_dict())
    plan = ParallelPlan(components=[Component(name="dit", module=ours, blocks=ours.repeated_blocks())])
    apply_activation_checkpointing(plan, "full")
    inputs = _inputs("i2v")
    ours(**inputs).square().mean().backward()
    plain(**inputs).square().mean().backward()
    reference = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, reference[name].grad, rtol=0, atol=1e-6, msg=name)


def test_meta_build_then_init_weights() -> None:
    config = WanDiTConfig.from_diffusers(LAYOUTS["i2v"])
    with torch.device("meta"):
        model = WanDiT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.proj_out.weight, torch.zeros_like(model.proj_out.weight))  # predicts 0 untrained
    linear = model.blocks[0].attn1.to_q
    bound = (6 / (linear.in_features + linear.out_features)) ** 0.5
    assert linear.weight.abs().max() <= bound and linear.weight.std() > bound / 4
    assert torch.all(model.blocks[0].norm2.weight == 1) and torch.all(
        model.blocks[0].attn1.norm_q.weight == 1
    )
    inputs = _inputs("i2v")
    with torch.no_grad():
        assert torch.equal(model(**inputs), torch.zeros(BATCH, 4, *LATENT))


@pytest.mark.slow
def test_compiled_checkpointed_blocks_through_the_parallel_plan() -> None:
    from forge_lightning.performance.transforms import apply_compile

    _, ours = _pair("ti2v")
    plain = WanDiT(ours.config)
    plain.load_state_dict(ours.state_dict())
    plan = ParallelPlan(components=[Component(name="dit", module=ours, blocks=ours.repeated_blocks())])
    apply_activation_checkpointing(plan, "full")
    apply_compile(plan, enabled=True)
    inputs = _inputs("ti2v")
    out = ours(**inputs)
    out.square().mean().backward()
    expected = plain(**inputs)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    reference = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, reference[name].grad, rtol=0, atol=1e-6, msg=name)
