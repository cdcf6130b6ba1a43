"""The frozen Wan encoders against the diffusers pipeline code path, on tiny random models saved to disk."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from forge_lightning.datamodules.tokenizer import train_bpe_tokenizer
from forge_lightning.modules.diffusion.encoders import WanTextEncoder, WanVAE, clean_prompt


def _vae(z_dim):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(z_dim)
    stats = {
        "latents_mean": (torch.randn(z_dim, generator=g) * 0.5).tolist(),
        "latents_std": (torch.rand(z_dim, generator=g) + 0.5).tolist(),
    }
    common = dict(base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, **stats)
    if z_dim == 16:  # Wan 2.1 layout
        return AutoencoderKLWan(temperal_downsample=[False, True, True], **common)
    # Wan 2.2 TI2V layout: 2x2 patchify into 12 channels, residual down / up sampling, 16x spatial
    return AutoencoderKLWan(
        decoder_base_dim=6, temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16, **common,
    )  # fmt: skip


@pytest.fixture(scope="module", params=[16, 48], ids=["wan2.1", "wan2.2"])
def vae_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"wan_vae_{request.param}")
    _vae(request.param).eval().save_pretrained(root / "vae")
    return root, request.param


def _pipeline_normalise(vae, latents):
    # WanImageToVideoPipeline.prepare_latents
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    return (latents - mean) * inv_std


def test_vae_encode_decode_match_pipeline(vae_dir):
    root, z_dim = vae_dir
    ours = WanVAE.from_pretrained(root, z_dim=z_dim)
    reference = AutoencoderKLWan.from_pretrained(root / "vae").eval()
    s = ours.scale_factor_spatial
    video = torch.rand(2, 3, 5, 2 * s, 2 * s, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = ours.encode(video)
    with torch.no_grad():
        expected = _pipeline_normalise(
            reference, retrieve_latents(reference.encode(video), sample_mode="argmax")
        )
    assert latents.shape == (2, z_dim, 2, 2, 2)
    torch.testing.assert_close(latents, expected, rtol=0, atol=1e-6)
    # WanPipeline's decode: latents / (1 / std) + mean, then the VAE
    with torch.no_grad():
        mean = torch.tensor(reference.config.latents_mean).view(1, z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(reference.config.latents_std).view(1, z_dim, 1, 1, 1)
        expected_video = reference.decode(expected / inv_std + mean, return_dict=False)[0]
    decoded = ours.decode(latents)
    assert decoded.shape == video.shape
    torch.testing.assert_close(decoded, expected_video, rtol=0, atol=1e-6)


def test_vae_is_frozen_and_sampling_is_seeded(vae_dir):
    root, z_dim = vae_dir
    vae = WanVAE.from_pretrained(root)
    vae.train()
    assert not vae.training and not vae.vae.training
    assert not any(p.requires_grad for p in vae.parameters())
    s = vae.scale_factor_spatial
    video = torch.zeros(1, 3, 1, s, s, requires_grad=True)
    a = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(0))
    b = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and not a.requires_grad
    assert not torch.equal(a, vae.encode(video))


def test_vae_dtype(vae_dir):
    root, _ = vae_dir
    vae = WanVAE.from_pretrained(root, dtype=torch.bfloat16)
    assert vae.dtype == torch.bfloat16
    s = vae.scale_factor_spatial
    assert vae.encode(torch.zeros(1, 3, 1, s, s)).dtype == torch.float32


def test_vae_errors(vae_dir, tmp_path):
    root, z_dim = vae_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WanVAE.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        WanVAE.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="z_dim"):
        WanVAE.from_pretrained(root, z_dim=64 - z_dim)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ValueError, match="not an AutoencoderKLWan"):
        WanVAE.from_pretrained(tmp_path)
    vae = WanVAE.from_pretrained(root / "vae")
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        vae.encode(torch.zeros(1, 3, 4, 16, 16))
    with pytest.raises(ValueError, match=r"\[B, 3, F, H, W\]"):
        vae.encode(torch.zeros(1, 4, 1, 16, 16))
    with pytest.raises(ValueError, match="latents must be"):
        vae.decode(torch.zeros(1, z_dim + 1, 1, 2, 2))


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_text")
    train_bpe_tokenizer(
        ["a red fox jumps over the lazy dog in the snow at night. " * 8] * 4, 300, root / "tokenizer"
    )
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    UMT5EncoderModel(config).eval().save_pretrained(root / "text_encoder")
    return root


PROMPTS = ["a red fox  jumps", "the lazy dog &amp; the snow at night over the fox"]


@pytest.mark.parametrize("max_length", [512, 7])
def test_text_embeddings_match_pipeline(text_dir, max_length):
    ours = WanTextEncoder.from_pretrained(text_dir, dtype=torch.float32, max_length=max_length)
    reference = SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(text_dir / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(text_dir / "text_encoder").eval(),
    )
    with torch.no_grad():
        expected = WanPipeline._get_t5_prompt_embeds(
            reference, PROMPTS, max_sequence_length=max_length, device=torch.device("cpu")
        )
    embeddings = ours.encode(PROMPTS)
    assert embeddings.shape == (2, max_length, 32)
    torch.testing.assert_close(embeddings, expected, rtol=0, atol=1e-6)
    if max_length == 512:
        lengths = (embeddings.abs().sum(-1) > 0).sum(1)
        assert lengths.tolist() == [len(reference.tokenizer(clean_prompt(p)).input_ids) for p in PROMPTS]
        assert (embeddings[0, lengths[0] :] == 0).all()


def test_text_encoder_frozen_dtype_and_errors(text_dir, tmp_path):
    encoder = WanTextEncoder.from_pretrained(text_dir, max_length=16)
    encoder.train()
    assert encoder.dtype == torch.bfloat16 and not encoder.encoder.training
    assert not any(p.requires_grad for p in encoder.parameters())
    out = encoder("a fox")
    assert out.shape == (1, 16, 32) and out.dtype == torch.bfloat16
    assert clean_prompt("  a &amp;amp;\n fox ") == "a & fox"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WanTextEncoder.from_pretrained(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="not 'umt5'"):
        WanTextEncoder.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        WanTextEncoder.from_pretrained(text_dir / "text_encoder")
