"""The Euler sampler against diffusers' FlowMatchEulerDiscreteScheduler driving a tiny random Wan DiT."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from forge_lightning.modules.diffusion.sampling import flow_match_sigmas, sample_euler


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    ).eval()
    return model


def _denoiser(model):
    def run(latents, timestep, text):
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)
        return out[0]

    return run


@pytest.mark.parametrize(("steps", "shift"), [(1, 1.0), (4, 3.0), (10, 5.0), (50, 7.0)])
def test_sigmas_match_scheduler(steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    ours = flow_match_sigmas(steps, shift)
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours[:-1] * 1000, scheduler.timesteps, rtol=0, atol=1e-4)


def test_sigmas_reject_bad_arguments():
    with pytest.raises(ValueError, match="num_inference_steps"):
        flow_match_sigmas(0, 3.0)
    with pytest.raises(ValueError, match="shift"):
        flow_match_sigmas(4, 0.0)


def _scheduler_loop(model, latents, text, negative, guidance, steps, shift, mask=None, condition=None):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    for t in scheduler.timesteps:
        x = latents if mask is None else (1 - mask) * condition + mask * latents
        if mask is None:
            timestep = t.expand(latents.shape[0])
        else:  # as WanImageToVideoPipeline with expand_timesteps
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        v = _denoiser(model)(x, timestep, text)
        if guidance != 1.0:
            v_uncond = _denoiser(model)(x, timestep, negative)
            v = v_uncond + guidance * (v - v_uncond)
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    if mask is not None:
        latents = (1 - mask) * condition + mask * latents
    return latents


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_sampler_matches_scheduler_loop(dit, guidance):
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(2, 4, 3, 8, 8, generator=g)
    text = torch.randn(2, 6, 16, generator=g)
    negative = torch.randn(2, 6, 16, generator=g)
    expected = _scheduler_loop(dit, noise, text, negative, guidance, 4, 3.0)
    ours = sample_euler(
        _denoiser(dit), noise, text, num_inference_steps=4, shift=3.0, guidance_scale=guidance,
        negative_text_BLD=negative,
    )  # fmt: skip
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, noise)


def test_sampler_first_frame_condition_matches_ti2v_loop(dit):
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(1, 4, 3, 8, 8, generator=g)
    condition = torch.randn(1, 4, 3, 8, 8, generator=g)
    text, negative = torch.randn(2, 1, 6, 16, generator=g)
    mask = torch.ones(1, 1, 3, 8, 8)
    mask[:, :, 0] = 0
    expected = _scheduler_loop(dit, noise, text, negative, 4.0, 3, 5.0, mask=mask, condition=condition)
    ours = sample_euler(
        _denoiser(dit), noise, text, num_inference_steps=3, shift=5.0, guidance_scale=4.0,
        negative_text_BLD=negative, condition_BCFHW=condition,
    )  # fmt: skip
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[:, :, 0], condition[:, :, 0], rtol=0, atol=0)


def test_guidance_needs_negative_text(dit):
    with pytest.raises(ValueError, match="negative_text_BLD"):
        sample_euler(
            _denoiser(dit), torch.zeros(1, 4, 1, 4, 4), torch.zeros(1, 2, 16), num_inference_steps=2, shift=1.0,
            guidance_scale=3.0,
        )  # fmt: skip
