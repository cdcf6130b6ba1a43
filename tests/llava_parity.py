"""Shared HF parity checks of the LLaVA families (LLaVA with CLIP, LLaVA-OneVision) on tiny random checkpoints
(fp32): logits within 1e-4 (max abs, at the kept tokens), the loss within 1e-5 (relative), every parameter's gradient
within 1e-4 (relative L2); parameters that transformers gives no gradient (encoder layers after the deepest selected
one, ``post_layernorm``) get none here either."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from llm_parity import randomize_weights

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4

# Our prefixes and transformers 5's in-memory ones (longest first).
_HF_NAMES = (
    ("vision.", "model.vision_tower."),
    ("projector.image_newline", "model.image_newline"),
    ("projector.", "model.multi_modal_projector."),
    ("llm.model.", "model.language_model."),
    ("llm.", ""),
)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights ~ N(0, 0.1) that all matter, LayerNorm weights around 1; fp32, eval mode."""
    torch.manual_seed(seed)
    randomize_weights(model, weight_std=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(
                ("layer_norm1.weight", "layer_norm2.weight", "layernorm.weight", "layrnorm.weight")
            ):
                param.copy_(1 + 0.3 * torch.randn_like(param))
    return model.float().eval()


def text(n: int, seed: int, high: int = 400) -> list[int]:
    """``n`` random text tokens in ``[3, high)``."""
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def labels(batch: dict, placeholders: tuple[int, ...]) -> torch.Tensor:
    """The input ids as labels, -100 at padding and at the ``placeholders`` tokens."""
    ids = batch["input_ids"]
    ignore = (batch["attention_mask"] == 0) | torch.isin(ids, torch.tensor(placeholders))
    return ids.masked_fill(ignore, -100)


def shifted_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy ignoring -100."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), ignore_index=-100)


def hf_name(name: str) -> str:
    """transformers 5's in-memory name of our parameter ``name``."""
    ours, theirs = next((o, t) for o, t in _HF_NAMES if name.startswith(o))
    return theirs + name.removeprefix(ours)


def max_logits_diff(model, hf, batch: dict) -> float:
    """Largest absolute logit difference at the kept tokens."""
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        return (model(**batch) - hf(**batch).logits)[keep].abs().max().item()


def assert_matches_transformers(model, hf, batch: dict, placeholders: tuple[int, ...]) -> int:
    """Logits, loss and every gradient of ``model`` against ``hf`` on ``batch``; returns how many parameters get no
    gradient in either."""
    hf.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    target, keep = labels(batch, placeholders), batch["attention_mask"].bool()

    logits = model(**batch)
    out = hf(**batch, labels=target)
    logits_err = (logits - out.logits)[keep].abs().max().item()
    assert logits_err <= LOGITS_TOL, logits_err

    loss = shifted_loss(logits, target)
    assert abs(loss.item() - out.loss.item()) <= LOSS_TOL * out.loss.item()

    loss.backward()
    out.loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert {hf_name(name) for name, _ in model.named_parameters()} == hf_grads.keys()
    unused = 0
    for name, p in model.named_parameters():
        want = hf_grads[hf_name(name)]
        if want is None:
            assert p.grad is None, name
            unused += 1
            continue
        rel = ((p.grad - want).norm() / want.norm()).item()
        assert rel <= GRAD_TOL, f"{name}: relative gradient error {rel:.2e}"
    return unused


def assert_trains(model, batch: dict, placeholders: tuple[int, ...], steps: int = 6) -> None:
    """A few AdamW steps on ``batch`` cut the loss by more than 10%."""
    target = labels(batch, placeholders)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = shifted_loss(model(**batch), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def assert_tower_matches(tower, reference, pixels: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """Every hidden state and the last one of ``tower`` equal ``reference``'s (a transformers vision model) within
    ``tol``, and so do the features of layers 1 and -2 without their first tokens; returns the features."""
    num_layers = tower.config.num_layers
    with torch.no_grad():
        out = reference(pixels, output_hidden_states=True)
        for i in range(-num_layers - 1, num_layers + 1):
            torch.testing.assert_close(
                tower.hidden_states(pixels, [i])[0], out.hidden_states[i], atol=tol, rtol=0
            )
        torch.testing.assert_close(tower.last_hidden_state(pixels), out.last_hidden_state, atol=tol, rtol=0)
        expected = torch.cat([out.hidden_states[1][:, 1:], out.hidden_states[-2][:, 1:]], dim=-1)
        features = tower(pixels)
    torch.testing.assert_close(features, expected, atol=tol, rtol=0)
    return features
