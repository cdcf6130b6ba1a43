"""Flow-matching targets, timestep samplers and loss weights: hand-worked values, diffusers' training utilities,
seeded reproducibility and the samplers' distributions."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from forge_lightning.modules.diffusion.flow_matching import (
    FlowMatching,
    FlowMatchingConfig,
    add_noise,
    dit_timesteps,
    drop_text,
    first_frame_mask,
    loss_weights,
    per_token_timesteps,
    sample_sigmas,
    sample_u,
    shift_sigmas,
    velocity_target,
)


def test_noising_and_target_hand_worked():
    x0 = torch.tensor([[2.0, -1.0], [0.5, 4.0]])
    eps = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    sigma = torch.tensor([0.25, 1.0])
    # 0.75 * x0 + 0.25 * eps for the first sample; pure noise for the second
    torch.testing.assert_close(add_noise(x0, eps, sigma), torch.tensor([[1.75, -0.5], [-2.0, 0.0]]))
    torch.testing.assert_close(velocity_target(x0, eps), torch.tensor([[-1.0, 2.0], [-2.5, -4.0]]))
    torch.testing.assert_close(dit_timesteps(torch.tensor([0.25, 0.999])), torch.tensor([250.0, 999.0]))


def test_noising_matches_scheduler_scale_noise():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 2, 3, 2, 4, 4, generator=g)
    for index in (0, 400, 999):
        t = scheduler.timesteps[index : index + 1]
        expected = scheduler.scale_noise(x0, t, eps)
        ours = add_noise(x0, eps, scheduler.sigmas[index : index + 1].expand(2))
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_shift_hand_worked_and_scheduler_table():
    # shift 3 at 0.5: 1.5 / 2 = 0.75; the end points stay fixed
    torch.testing.assert_close(
        shift_sigmas(torch.tensor([0.0, 0.5, 1.0]), 3.0), torch.tensor([0.0, 0.75, 1.0])
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    u = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
    torch.testing.assert_close(shift_sigmas(u, 5.0), scheduler.sigmas, rtol=0, atol=1e-7)


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode"])
def test_density_matches_diffusers(scheme):
    config = FlowMatchingConfig(timestep_sampling=scheme, logit_mean=0.3, logit_std=0.8, mode_scale=1.29)
    ours = sample_u(config, 64, generator=torch.Generator().manual_seed(5))
    expected = compute_density_for_timestep_sampling(
        scheme, 64, logit_mean=0.3, logit_std=0.8, mode_scale=1.29, generator=torch.Generator().manual_seed(5)
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["none", "sigma_sqrt", "cosmap"])
def test_loss_weights_match_diffusers(scheme):
    sigma = torch.linspace(0.05, 1.0, 20)
    expected = compute_loss_weighting_for_sd3(scheme, sigma)
    torch.testing.assert_close(loss_weights(FlowMatchingConfig(loss_weighting=scheme), sigma), expected)
    # hand-worked at sigma 0.5: sigma**-2 = 4; cosmap 2 / (pi * 0.5)
    value = loss_weights(FlowMatchingConfig(loss_weighting=scheme), torch.tensor([0.5])).item()
    assert value == pytest.approx({"none": 1.0, "sigma_sqrt": 4.0, "cosmap": 4 / math.pi}[scheme])


def test_sampling_is_seeded():
    config = FlowMatchingConfig(timestep_sampling="logit_normal", shift=3.0)
    a = sample_sigmas(config, 16, generator=torch.Generator().manual_seed(7))
    b = sample_sigmas(config, 16, generator=torch.Generator().manual_seed(7))
    c = sample_sigmas(config, 16, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    fm = FlowMatching(config)
    x0 = torch.randn(2, 4, 3, 4, 4)
    s1 = fm.prepare(x0, generator=torch.Generator().manual_seed(3))
    s2 = fm.prepare(x0, generator=torch.Generator().manual_seed(3))
    for name in ("x_t", "target", "sigma", "timestep"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name


N = 200_000


def test_uniform_shift_distribution():
    # sigma = s u / (1 + (s - 1) u)  =>  P(sigma <= q) = u(q) = q / (s - (s - 1) q)
    s = 3.0
    sigma = sample_sigmas(FlowMatchingConfig(shift=s), N, generator=torch.Generator().manual_seed(0))
    for q in (0.25, 0.5, 0.75, 0.9):
        assert (sigma <= q).float().mean().item() == pytest.approx(q / (s - (s - 1) * q), abs=5e-3)
    # mean of the shifted uniform: integral_0^1 s u / (1 + (s - 1) u) du
    mean = s / (s - 1) * (1 - math.log(s) / (s - 1))
    assert sigma.mean().item() == pytest.approx(mean, abs=3e-3)


def test_logit_normal_distribution():
    config = FlowMatchingConfig(timestep_sampling="logit_normal", shift=1.0, logit_mean=0.5, logit_std=1.2)
    sigma = sample_sigmas(config, N, generator=torch.Generator().manual_seed(1))
    logits = torch.logit(sigma.double())
    assert logits.mean().item() == pytest.approx(0.5, abs=0.01)
    assert logits.std().item() == pytest.approx(1.2, abs=0.01)
    # the median of a logit-normal is sigmoid(mean)
    assert sigma.median().item() == pytest.approx(1 / (1 + math.exp(-0.5)), abs=5e-3)


def test_mode_distribution():
    # u = 1 - x - c (cos^2(pi x / 2) - 1 + x) with x uniform; its mean is 1/2 - c (1/2 - 1 + 1/2) = 1/2
    c = 1.29
    config = FlowMatchingConfig(timestep_sampling="mode", shift=1.0, mode_scale=c)
    sigma = sample_sigmas(config, N, generator=torch.Generator().manual_seed(2))
    assert sigma.mean().item() == pytest.approx(0.5, abs=3e-3)
    assert sigma.min().item() >= 0 and sigma.max().item() <= 1
    # it is monotone decreasing in x, so P(sigma <= f(x)) = 1 - x
    x = 0.3
    q = 1 - x - c * (math.cos(math.pi * x / 2) ** 2 - 1 + x)
    assert (sigma <= q).float().mean().item() == pytest.approx(1 - x, abs=5e-3)


def test_text_dropout_rate_and_replacement():
    text = torch.randn(4000, 3, 2)
    empty = torch.full((3, 2), 7.0)
    out, dropped = drop_text(text, empty, 0.1, generator=torch.Generator().manual_seed(0))
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.015)
    assert torch.equal(out[dropped], empty.expand(int(dropped.sum()), 3, 2))
    assert torch.equal(out[~dropped], text[~dropped])
    again, _ = drop_text(text, empty, 0.1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match="empty prompt"):
        drop_text(text, torch.zeros(5, 2), 0.1)


def test_first_frame_mask_and_per_token_timesteps_as_pipeline():
    latents = torch.zeros(2, 4, 3, 4, 6)
    mask = first_frame_mask(latents)
    assert mask.shape == (2, 1, 3, 4, 6) and mask[:, :, 0].sum() == 0 and mask[:, :, 1:].min() == 1
    t = torch.tensor([700.0, 700.0])
    ours = per_token_timesteps(t, mask, (1, 2, 2))
    # WanPipeline / WanImageToVideoPipeline with expand_timesteps
    expected = (mask[0][0][:, ::2, ::2] * t[0]).flatten().unsqueeze(0).expand(2, -1)
    assert torch.equal(ours, expected)
    assert ours.shape == (2, 3 * 2 * 3) and ours[:, :6].sum() == 0 and (ours[:, 6:] == 700).all()


def test_clean_first_frame_training_sample():
    fm = FlowMatching(FlowMatchingConfig(shift=1.0))
    x0 = torch.randn(2, 4, 3, 4, 4)
    s = fm.prepare(x0, generator=torch.Generator().manual_seed(0), clean_first_frame=True)
    assert torch.equal(s.x_t[:, :, 0], x0[:, :, 0])
    assert s.timestep.shape == (2, 3 * 2 * 2) and (s.timestep[:, :4] == 0).all()
    torch.testing.assert_close(s.timestep[:, 4:], (s.sigma * 1000)[:, None].expand(2, 8))
    # an error only on the clean frame costs nothing
    pred = s.target.clone()
    pred[:, :, 0] += 10
    assert torch.equal(fm.loss(pred, s), torch.zeros(2))


def test_loss_hand_worked_and_weighted():
    fm = FlowMatching(FlowMatchingConfig(loss_weighting="sigma_sqrt"))
    x0 = torch.zeros(2, 1, 1, 1, 2)
    s = fm.prepare(x0, generator=torch.Generator().manual_seed(0))
    pred = s.target + torch.tensor([1.0, 3.0]).view(1, 1, 1, 1, 2)  # squared errors 1 and 9, mean 5
    torch.testing.assert_close(fm.loss(pred, s), 5.0 * s.sigma**-2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timestep_sampling": "beta"}, "timestep_sampling"),
        ({"loss_weighting": "snr"}, "loss_weighting"),
        ({"shift": 0.0}, "shift"),
        ({"logit_std": -1.0}, "logit_std"),
        ({"mode_scale": 3.0}, "mode_scale"),
        ({"num_train_timesteps": 0}, "num_train_timesteps"),
        ({"text_dropout": 1.0}, "text_dropout"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlowMatchingConfig(**kwargs)
