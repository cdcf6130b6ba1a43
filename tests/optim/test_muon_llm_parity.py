"""The product path (``optimizer: {name: muon}`` through ``build_optimizer``, as ``CausalLM.configure_optimizers``
builds it) trains the tiny LLM to the same weights as ``torch.optim.Muon`` on its hidden matrices plus
``torch.optim.AdamW`` on the embedding (= tied head) and norms."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import TINY_LLM

from forge_lightning.modules.llm import CausalLM
from forge_lightning.optim import Muon, OptimizerConfig, build_optimizer


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_from_config_equals_torch_muon_plus_adamw(adjust_lr_fn):
    torch.manual_seed(0)
    ours = CausalLM(config=TINY_LLM).model
    start, theirs = copy.deepcopy(ours), copy.deepcopy(ours)
    config = OptimizerConfig(
        name="muon", lr=1e-3, weight_decay=0.1, muon={"lr": 0.02, "adjust_lr_fn": adjust_lr_fn}
    )
    optimizer = build_optimizer(ours, config)
    assert isinstance(optimizer, Muon)

    named = dict(theirs.named_parameters())
    hidden = [p for n, p in named.items() if p.ndim == 2 and "embed_tokens" not in n]
    rest = [p for n, p in named.items() if not (p.ndim == 2 and "embed_tokens" not in n)]
    assert len(hidden) == 14 and len(rest) == 6  # 2 layers x 7 matrices; embedding (= head) + 5 norms
    reference = [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn),
        torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8),
    ]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        tokens = torch.randint(0, TINY_LLM["vocab_size"], (2, 17), generator=gen)
        for model, optimizers in ((ours, [optimizer]), (theirs, reference)):
            _loss(model, tokens).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), (name, (p - q).abs().max().item())
    assert all(not torch.equal(p, s) for p, s in zip(ours.parameters(), start.parameters(), strict=True))
