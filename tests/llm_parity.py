"""Shared HF parity checks of the LLM families (dense and MoE): logits, loss and every parameter's gradient."""

from pathlib import Path

import torch
import torch.nn.functional as F

from forge_lightning.modules.llm import DecoderLM, LLMConfig
from forge_lightning.modules.llm.hf import load_pretrained


def load_forge(path: Path) -> DecoderLM:
    """Our decoder built from the HF directory ``path`` and loaded with its weights."""
    return load_pretrained(DecoderLM(LLMConfig.load(path)), path)


def shifted_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` ``[B, S, V]`` against ``input_ids`` ``[B, S]``."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def assert_matches_transformers(model, hf_model, input_ids: torch.Tensor, label: str = "") -> None:
    """Logits within 1e-4 (max abs), loss within 1e-5 (relative), each gradient within 1e-4 (relative L2)."""
    logits = model(input_ids)
    hf_logits = hf_model(input_ids).logits
    assert (logits - hf_logits).abs().max().item() <= 1e-4

    loss, hf_loss = shifted_ce(logits, input_ids), shifted_ce(hf_logits, input_ids)
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())

    loss.backward()
    hf_loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    assert grads.keys() == hf_grads.keys()
    for name, hf_grad in hf_grads.items():
        # ||g - g_hf||_2 / ||g_hf||_2 per parameter tensor.
        rel = (grads[name] - hf_grad).norm() / hf_grad.norm()
        assert rel.item() <= 1e-4, f"{label} {name}: relative gradient error {rel.item():.2e}"


def randomize_weights(model: torch.nn.Module, weight_std: float) -> None:
    """Redraw every parameter so each one matters: norms around 1, biases N(0, 0.2), weights N(0, weight_std)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if name.endswith("bias") else weight_std)
