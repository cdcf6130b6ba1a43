"""DeepSeek-V3's multi-token prediction (arXiv:2412.19437, sec. 2.2) against a hand-written reference of the paper's
equations on tiny random weights (fp32): for depth k, ``h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]``,
``h^k = TRM_k(h')``, ``P^k_{i+k+1} = OutHead(h^k_i)``, ``L_MTP = lambda / D * sum_k CE_k / T``. The reference runs
each depth on the whole sequence with the embeddings rolled (megatron-core's layout) and masks the positions
without a target, where the model cuts the sequence instead."""

import json

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from forge_lightning.modules.llm import CausalLM
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.hf import load_hf_weights, load_pretrained, save_pretrained
from forge_lightning.modules.llm.loss import LMLoss
from forge_lightning.modules.llm.megatron.tf_config import check_supported
from forge_lightning.modules.llm.model import DecoderLayer, DecoderLM
from forge_lightning.modules.llm.mtp import mtp_loss_sum

DEPTHS = 2
# max |ours - reference| per gradient tensor / its max |reference|, fp32 (measured <= 1.3e-6: the reference runs each
# depth on the whole rolled sequence, so its attention and norms sum in another order than the cut sequence's).
GRAD_RTOL = 2e-6
LAMBDA = 0.3
B, S = 2, 12


def _config(depths: int = DEPTHS, **overrides) -> LLMConfig:
    # MLA, a dense layer, then MoE layers: the first MTP module holds experts (as DeepSeek-V3's layer 61).
    return LLMConfig.from_preset("debug-deepseek", num_layers=2, num_nextn_predict_layers=depths, **overrides)


def _model(config: LLMConfig) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))  # norms that are not all ones
    return model


def _batch(vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_sums(model: DecoderLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per depth, the summed cross-entropy of predicting ``t_{i+k+1}`` over the positions that have it, by the
    paper's equations (the transformer block TRM_k is the MTP module's own decoder block)."""
    c = model.config
    ids, labels = batch["input_ids"], batch["labels"]
    emb_W = model.model.embed_tokens.weight
    h_BSD = model.hidden_states(ids)  # h^0: the main model's (final-normed) representation
    rope = model.model.rotary_emb(torch.arange(S)[None])
    sums = []
    for k, mtp in enumerate(model.mtp, start=1):
        # Emb(t_{i+k}) at position i: the ids rolled left by k, the last k positions without a token (zero).
        ahead = torch.zeros_like(ids)
        ahead[:, : S - k] = ids[:, k:]
        emb_BSD = emb_W[ahead]
        joined = torch.cat(
            [_rms(emb_BSD, mtp.enorm.weight, c.rms_norm_eps), _rms(h_BSD, mtp.hnorm.weight, c.rms_norm_eps)],
            -1,
        )
        h_prime = joined @ mtp.eh_proj.weight.T  # M_k
        trm = DecoderLayer.forward(mtp, h_prime, rope)  # TRM_k, causal over the whole rolled sequence
        h_BSD = _rms(trm, mtp.shared_head.norm.weight, c.rms_norm_eps)  # h^k
        logits = h_BSD @ model.lm_head.weight.T  # the shared output head
        target = torch.zeros_like(ids)
        target[:, : S - k] = labels[:, k:]  # t_{i+k+1} = labels[i + k]
        valid = torch.arange(S)[None] < S - k
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
        sums.append((ce * valid).sum())
    return torch.stack(sums)


def _grads(model: DecoderLM) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, g in want.items():
        torch.testing.assert_close(
            got[k], g, rtol=0, atol=GRAD_RTOL * max(g.abs().max().item(), 1e-12), msg=k
        )


def test_mtp_loss_and_gradients_equal_the_papers_equations():
    model = _model(_config())
    batch = _batch(model.config.vocab_size)
    tokens = batch["labels"].numel()

    ref = reference_mtp_sums(model, batch)
    (LAMBDA / DEPTHS * ref.sum() / tokens).backward()
    want = _grads(model)
    model.zero_grad()

    total, per_depth = mtp_loss_sum(
        model, model.hidden_states(batch["input_ids"]), batch, LMLoss(backend="torch")
    )
    (LAMBDA / DEPTHS * total / tokens).backward()
    torch.testing.assert_close(per_depth, ref.detach(), rtol=1e-6, atol=1e-6)
    _assert_grads_close(_grads(model), want)
    # Every MTP parameter is trained, and the embedding and head through every depth.
    assert all(k in want for k, _ in model.mtp.named_parameters(prefix="mtp"))


def test_packed_rows_predict_within_their_documents():
    """A packed row (two documents): depth k leaves out the positions whose token k ahead is in the next
    document, and attends within documents: each document's MTP sums equal those of the document alone."""
    model = _model(_config())
    batch = _batch(model.config.vocab_size)
    lengths = (5, 7)
    document_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None].expand(B, S)
    labels = batch["labels"].clone()
    labels[:, lengths[0] - 1] = -100  # the first document's last token predicts nothing
    packed = {**batch, "labels": labels, "document_ids": document_ids}
    loss = LMLoss(backend="torch")
    hidden = model.hidden_states(batch["input_ids"], document_ids=document_ids)
    _, per_depth = mtp_loss_sum(model, hidden, packed, loss)
    alone = torch.zeros(DEPTHS)
    start = 0
    for n in lengths:
        doc = {"input_ids": batch["input_ids"][:, start : start + n], "labels": labels[:, start : start + n]}
        alone += mtp_loss_sum(model, model.hidden_states(doc["input_ids"]), doc, loss)[1]
        start += n
    torch.testing.assert_close(per_depth, alone, rtol=1e-5, atol=1e-5)


class _Capture(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.logged: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {k: p.grad.clone() for k, p in pl_module.model.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, *args) -> None:
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit_one_step(module: CausalLM, batches: list[dict]) -> _Capture:
    capture = _Capture()
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        accumulate_grad_batches=len(batches),
        callbacks=[capture],
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return capture


def _module(depths: int, weight: float) -> CausalLM:
    module = CausalLM(
        config=_config(0).to_hf(),
        num_nextn_predict_layers=depths,
        mtp_loss_weight=weight,
        optimizer={"lr": 1e-3},  # the gradient is captured before the step
        performance={"kernels": {"cross_entropy": "torch"}},
    )
    assert module.config == _config(depths)
    return module


def _step_batches(vocab: int) -> list[dict]:
    batches = [_batch(vocab, seed) for seed in (1, 2)]
    step = torch.tensor(sum(b["labels"].numel() for b in batches))
    return [{**b, "step_tokens": step} for b in batches]


def test_training_step_adds_lambda_over_depths_of_the_mtp_losses_over_the_main_tokens():
    """Two micro-batches: the step's gradient is that of the main token mean plus ``lambda / D * sum_k CE_k / T``
    over the step's tokens T (the one batch rule, as the main loss); ``train/mtp_loss`` logs the last micro-batch's
    mean over depths of ``CE_k / its tokens``."""
    module = _module(DEPTHS, LAMBDA)
    module.model.load_state_dict(_model(_config()).state_dict())
    batches = _step_batches(module.config.vocab_size)
    reference = _model(_config())
    T = sum(b["labels"].numel() for b in batches)
    for b in batches:
        logits = reference(b["input_ids"])
        main = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum")
        mtp = reference_mtp_sums(reference, b)
        (main / T + LAMBDA / DEPTHS * mtp.sum() / T).backward()
    want = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}

    capture = _fit_one_step(module, batches)
    # The router z-loss and load-balancing losses are off in the preset: the gradient is the LM and MTP losses'.
    _assert_grads_close(capture.grads, want)
    last = batches[-1]
    expected = (reference_mtp_sums(reference, last) / last["labels"].numel()).mean().item()
    assert abs(capture.logged[-1]["train/mtp_loss"] - expected) <= 1e-6


def test_mtp_off_leaves_the_model_and_its_loss_as_they_were():
    """Without MTP modules the model has no ``mtp`` parameters and the step's loss and gradient are those of the
    main loss alone; with them the logged main loss is unchanged (same main weights)."""
    assert not any(k.startswith("mtp") for k in DecoderLM(_config(0)).state_dict())
    batches = _step_batches(256)
    weights = _model(_config()).state_dict()
    plain = _module(0, 0.0)
    plain.model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    with_mtp = _module(DEPTHS, LAMBDA)
    with_mtp.model.load_state_dict(weights)
    off, on = _fit_one_step(plain, batches), _fit_one_step(with_mtp, batches)
    assert off.logged[-1]["train/loss"] == on.logged[-1]["train/loss"]
    assert "train/mtp_loss" not in off.logged[-1]
    reference = _model(_config(0))
    reference.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    T = sum(b["labels"].numel() for b in batches)
    for b in batches:
        logits = reference(b["input_ids"])
        (F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum") / T).backward()
    _assert_grads_close(off.grads, {k: p.grad for k, p in reference.named_parameters()})


def test_hf_checkpoint_holds_the_mtp_layers_under_deepseek_v3s_names(tmp_path):
    config = _config()
    model = _model(config)
    out = save_pretrained(model, config, tmp_path / "hf")
    files = load_file(out / "model.safetensors")
    L = config.num_layers
    for k in range(DEPTHS):
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "input_layernorm.weight",
        ):
            assert f"model.layers.{L + k}.{name}" in files, name
        # DeepSeek-V3's files hold copies of the shared embedding and head in each MTP layer.
        assert torch.equal(
            files[f"model.layers.{L + k}.embed_tokens.weight"], files["model.embed_tokens.weight"]
        )
        assert torch.equal(files[f"model.layers.{L + k}.shared_head.head.weight"], files["lm_head.weight"])
    assert f"model.layers.{L}.mlp.experts.0.gate_proj.weight" in files  # the first MTP module's experts
    assert not any(k.startswith("mtp.") for k in files)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == DEPTHS

    with torch.device("meta"):
        loaded = DecoderLM(config)
    load_pretrained(loaded, out)
    state = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(state)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    # A model without MTP modules loads the main weights and leaves the MTP layers out (as transformers does).
    plain = DecoderLM(_config(0))
    load_pretrained(plain, out)
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight)
    # A copy of the shared head that differs is refused.
    files[f"model.layers.{L}.shared_head.head.weight"] = files["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="shares the embedding and the output head"):
        load_hf_weights(DecoderLM(config), files)


def test_mtp_settings_are_checked():
    with pytest.raises(ValueError, match=r"mtp_loss_weight \(0.3\) needs multi-token prediction modules"):
        CausalLM(config="debug-deepseek", mtp_loss_weight=0.3)
    with pytest.raises(
        ValueError, match=r"num_nextn_predict_layers \(1\) builds multi-token prediction modules"
    ):
        CausalLM(config="debug-deepseek", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers \(-1\) must be 0"):
        _config(-1)
    with pytest.raises(ValueError, match="needs each sequence's hidden states whole"):
        _model(_config()).mtp_hidden_states(torch.zeros(1, 4, 64), torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="too short"):
        _model(_config()).mtp_hidden_states(torch.zeros(1, 2, 64), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="not yet supported by the megatron twin"):
        check_supported(_config(1))
