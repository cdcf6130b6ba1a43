"""Muon under MegatronStrategy: the tensor-parallel exchange, the fused-matrix splits and the optimizer's steps.

The 2-process cases run in one launch of ``muon_worker.py`` (TP = 2 and EP = 2 on gloo), shared by the tests;
the ``forge fit`` runs (``fit_plan``) share conftest's ``fit_runs`` launches with the other modules.
"""

from pathlib import Path

import pytest
import torch
from conftest import torchrun
from fit_plan import fit_step
from moe_reference import build_twin, moe_config
from muon_reference import (
    dense_config,
    megatron_optimizer,
    megatron_step,
    native_model,
    native_muon_weights,
    reference_weights,
    step_batches,
)

from forge_lightning.strategies.megatron.muon import FusedQKVSplit, GatedSplit, TensorParallelExchange

HERE = Path(__file__).resolve().parent
TINY_YAML = HERE.parents[1] / "tests" / "configs" / "tiny_llm.yaml"
STRATEGY = "forge_lightning.strategies.megatron.MegatronStrategy"
MUON_CLI = ("--optimizer.name", "muon", "--optimizer.muon.lr", "0.02", "--optimizer.muon.ns_dtype", "float32")
CASES = (
    "exchange",
    "dense_tp2",
    "dense_tp1",
    "dense_pp2",
    "moe_ep2",
    "moe_tp2_sp",
    "moe_tp2_sp_etp1",
    "moe_ep1",
    "deepseek_ep2",
    "resume",
)
# Max |a - b| of a weight after 3 steps, fp32, between layouts and against the one-process reference (measured
# <= 5.6e-7 for the Muon matrices, <= 1.1e-6 for AdamW's norms under sequence parallelism); the output head's AdamW
# update divides by its second moments' root, which magnifies the rounding of near-zero logit gradients
# (vocab-parallel cross-entropy against the native one; measured <= 3.7e-5).
LAYOUT_TOL = 5e-6
HEAD_TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("muon")
    torchrun(HERE / "muon_worker.py", out, *CASES)
    return {case: torch.load(out / f"{case}.pt", weights_only=False) for case in CASES}


def test_splits_invert_and_cut_megatron_layouts():
    q, k, v = torch.randn(2 * 3 * 4, 5), torch.randn(2 * 4, 5), torch.randn(2 * 4, 5)
    split = FusedQKVSplit(heads_per_group=3, head_dim=4)
    fused = split.join([q, k, v])
    # per group g: its 3 query heads, its key head, its value head
    expected = torch.cat(
        [torch.cat([q[12 * g : 12 * g + 12], k[4 * g : 4 * g + 4], v[4 * g : 4 * g + 4]]) for g in range(2)]
    )
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(split.parts(fused), [q, k, v], strict=True))
    gate, up = torch.randn(6, 5), torch.randn(6, 5)
    gathered = torch.cat([gate[:3], up[:3], gate[3:], up[3:]])  # [g_0; u_0; g_1; u_1] of two TP ranks
    assert all(torch.equal(a, b) for a, b in zip(GatedSplit(2).parts(gathered), [gate, up], strict=True))
    assert torch.equal(GatedSplit(2).join([gate, up]), gathered)
    stack = torch.randn(3, 8, 5)  # leading dimensions are kept
    assert torch.equal(GatedSplit(1).join(GatedSplit(1).parts(stack)), stack)
    with pytest.raises(ValueError, match="not whole query groups"):
        split.parts(torch.randn(10, 5))
    with pytest.raises(ValueError, match=r"into 2 \[gate; up\] blocks"):
        GatedSplit(2).parts(torch.randn(6, 5))


def test_one_process_exchange_hands_back_what_it_gets():
    params = [torch.randn(4, 3), torch.randn(2, 5)]
    exchange = TensorParallelExchange(params, [1.0, 2.0])
    assert exchange.owners == [0, 0] and not exchange.replicated
    full = exchange.gather(params)
    assert all(full[i] is params[i] for i in range(2))
    assert all(torch.equal(a, b) for a, b in zip(exchange.publish(full), params, strict=True))
    with pytest.raises(ValueError, match="local shape is"):
        exchange.gather([params[1], params[0]])
    with pytest.raises(ValueError, match="share a dtype"):
        TensorParallelExchange([params[0], params[1].double()], [1.0, 2.0])


def test_tp2_exchange_gathers_the_unsplit_matrices_and_publishes_the_shards(runs):
    run = runs["exchange"]
    assert run["published"]
    config = dense_config()
    hf = native_model(config).state_dict()
    qkv = FusedQKVSplit(config.num_heads // config.num_kv_heads, config.head_dim)
    full = run["full"]
    assert sorted(set(run["owners"].values())) == [0, 1]  # both ranks compute
    for layer in range(config.num_layers):
        megatron, native = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for part, name in zip(
            qkv.parts(full[megatron + "self_attention.linear_qkv.weight"]), "qkv", strict=True
        ):
            torch.testing.assert_close(part, hf[f"{native}self_attn.{name}_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(
            full[megatron + "self_attention.linear_proj.weight"], hf[native + "self_attn.o_proj.weight"]
        )
        gate, up = GatedSplit(2).parts(full[megatron + "mlp.linear_fc1.weight"])
        torch.testing.assert_close(gate, hf[native + "mlp.gate_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(up, hf[native + "mlp.up_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(
            full[megatron + "mlp.linear_fc2.weight"], hf[native + "mlp.down_proj.weight"]
        )
    torch.testing.assert_close(full["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])


def _max_diff(a: dict, b: dict) -> tuple[str, float]:
    assert sorted(a) == sorted(b)
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    return worst, diffs[worst]


def _assert_close(a: dict, b: dict, what: str) -> None:
    head = {"lm_head.weight"}
    worst, diff = _max_diff(
        {k: v for k, v in a.items() if k not in head}, {k: v for k, v in b.items() if k not in head}
    )
    assert diff <= LAYOUT_TOL, (what, worst, diff)
    _, diff = _max_diff({k: a[k] for k in head}, {k: b[k] for k in head})
    assert diff <= HEAD_TOL, (what, "lm_head.weight", diff)


def test_tp2_tp1_and_pp2_equal_torch_muon_on_the_unfused_matrices(runs, monkeypatch):
    config = dense_config()
    reference = reference_weights(config, step_batches(config), monkeypatch)
    initial = native_model(config).state_dict()
    moved = min((reference[k] - initial[k]).abs().max().item() for k in reference)
    assert moved > 1e-3  # every tensor trained
    for layout in ("dense_tp2", "dense_tp1", "dense_pp2"):
        _assert_close(runs[layout], reference, layout)


def test_moe_at_ep2_and_at_tp2_with_split_or_whole_experts_equals_ep1(runs):
    _assert_close(runs["moe_ep2"], runs["moe_ep1"], "moe ep2")
    _assert_close(runs["moe_tp2_sp"], runs["moe_ep1"], "moe tp2 sp")
    _assert_close(runs["moe_tp2_sp_etp1"], runs["moe_ep1"], "moe tp2 sp etp1")


def test_deepseek_v3_at_ep2_equals_the_native_muon_path(runs):
    """MLA and sigmoid-routed experts: megatron's Muon / AdamW split and its fused-matrix splits (experts' fc1,
    ``linear_kv_down_proj``) are the native path's (expert stacks, ``gate_up_proj``, ``kv_a_proj_with_mqa``)."""
    config = moe_config("deepseek_v3")
    _assert_close(runs["deepseek_ep2"], native_muon_weights(config, step_batches(config)), "deepseek ep2")


def test_resume_from_a_dist_checkpoint_continues_exactly(runs):
    run = runs["resume"]
    worst, diff = _max_diff(run["tp2"], run["uninterrupted"])
    assert diff == 0.0, (worst, diff)
    _assert_close(run["tp1"], run["uninterrupted"], "resumed at TP = 1")


def test_groups_follow_the_native_rule_and_the_distributed_optimizer_is_refused(megatron_world):
    chunks = build_twin(native_model(dense_config()))
    (part,) = megatron_optimizer(chunks).chained_optimizers
    groups = {g["name"]: g["param_names"] for g in part.optimizer.param_groups}
    layer = "decoder.layers.0."
    assert [n for n in groups["muon"] if n.startswith(layer)] == [
        layer + name
        for name in (
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        )
    ]
    assert groups["decay"] == ["output_layer.weight"]
    assert "embedding.word_embeddings.weight" in groups["no_decay"]
    assert all("layernorm" in n or "norm" in n for n in groups["no_decay"][1:])
    with pytest.raises(ValueError, match="use_distributed_optimizer=false"):
        megatron_optimizer(chunks, use_distributed_optimizer=True)


def _bf16_twin(config, seed: int = 0) -> tuple[list[torch.nn.Module], object]:
    from moe_reference import decoder_twin

    from forge_lightning.contracts import MegatronDims
    from forge_lightning.strategies.megatron.wrapping import wrap_ddp

    chunks = decoder_twin(native_model(config, seed), bf16=True).build_chunks()
    chunks = wrap_ddp(chunks, MegatronDims(), overlap_grad_reduce=False)
    return chunks, megatron_optimizer(chunks, bf16=True)


def test_bf16_steps_fp32_main_weights_and_resumes_exactly(megatron_world, tmp_path):
    """megatron's bf16 wrapper steps our Muon on its fp32 main copies; its dist-checkpoint (main copies, momentum
    buffers, AdamW moments) resumes to the same weights."""
    from forge_lightning.strategies.megatron import checkpoint as ckpt

    config = dense_config()
    steps = step_batches(config, 2)
    chunks, optimizer = _bf16_twin(config)
    (part,) = optimizer.chained_optimizers
    mains = [p for g in part.optimizer.param_groups if g["use_muon"] for p in g["params"]]
    assert mains and all(p.dtype == torch.float32 for p in mains)
    before = [p.detach().clone() for p in mains]
    megatron_step(chunks, optimizer, config, steps[0])
    assert all(not torch.equal(a, b) for a, b in zip(before, mains, strict=True))
    state = {ckpt.SHARDED_KEY: ckpt.sharded_state_dict(chunks, optimizer, is_loading=False)}
    ckpt.MegatronCheckpointIO().save_checkpoint({**state, ckpt.HF_CONFIG_KEY: config.to_hf()}, tmp_path / "c")
    megatron_step(chunks, optimizer, config, steps[1])
    chunks_2, optimizer_2 = _bf16_twin(config, seed=1)
    template = ckpt.sharded_state_dict(chunks_2, optimizer_2, is_loading=True)
    loaded = ckpt.MegatronCheckpointIO().load_checkpoint(tmp_path / "c", sharded_state_dict=template)
    ckpt.load_into(chunks_2, optimizer_2, loaded.pop(ckpt.SHARDED_KEY))
    megatron_step(chunks_2, optimizer_2, config, steps[1])
    (part_2,) = optimizer_2.chained_optimizers
    for group, group_2 in zip(part.optimizer.param_groups, part_2.optimizer.param_groups, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(group["params"], group_2["params"], strict=True))


def _fit(
    corpus: dict[str, Path],
    name: str,
    *args: str,
    devices: int,
    batch: int,
    error: bool = False,
    muon: bool = True,
) -> dict:
    """The plan step of ``forge fit`` of the tiny YAML (tied embeddings) for 3 steps, with Muon unless not ``muon``."""
    cli = ["fit", "--config", str(TINY_YAML), *(MUON_CLI if muon else ()), "--trainer.max_steps", "3"]
    cli += ["--data.data_prefix", str(corpus["prefix"]), "--data.tokenizer", str(corpus["tokenizer"])]
    cli += [
        "--trainer.limit_val_batches",
        "0",
        "--trainer.devices",
        str(devices),
        "--data.batch_size",
        str(batch),
    ]
    cli += ["--trainer.logger.init_args.name", name, *args]
    return fit_step(name, cli, nproc=devices, expect_error=error)


def fit_plan(corpus: dict[str, Path], root: Path) -> list[dict]:
    """This module's ``forge fit`` runs (names prefixed ``muon_``): the default strategy on one process, megatron
    at TP = 2 (saving a checkpoint at step 2), its checkpoint resumed with AdamW (refused) and the refused
    distributed optimizer."""
    tp = ("--trainer.strategy", STRATEGY, "--trainer.strategy.tensor_model_parallel_size")
    no_ckpt = ("--trainer.enable_checkpointing", "false")
    saving = (
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
        f"{{dirpath: {root / 'ckpt_muon_tp2'}, every_n_train_steps: 2, save_top_k: -1}}}}]"
    )
    resume = ("--ckpt_path", str(root / "ckpt_muon_tp2" / "epoch=0-step=2.ckpt"), *no_ckpt)
    distributed = ("--trainer.strategy.use_distributed_optimizer", "true", *no_ckpt)
    return [
        _fit(corpus, "muon_reference", *no_ckpt, devices=1, batch=4),
        _fit(corpus, "muon_tp2", *tp, "2", saving, devices=2, batch=4),
        _fit(corpus, "muon_resumed_as_adamw", *tp, "2", *resume, devices=2, batch=4, error=True, muon=False),
        _fit(corpus, "muon_distopt_refused", *tp, "1", *distributed, devices=2, batch=2, error=True),
    ]


def _losses(rows: list[dict[str, str]]) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_forge_fit_under_megatron_tp2_matches_the_default_strategy(fit_runs):
    """``optimizer: {name: muon}`` picks the same Muon / AdamW split and updates under both: the losses agree."""
    reference, tp2 = _losses(fit_runs.rows("muon_reference")), _losses(fit_runs.rows("muon_tp2"))
    assert sorted(reference) == sorted(tp2) == [0, 1, 2]
    assert reference[2] < reference[0]
    deltas = {s: abs(tp2[s] - reference[s]) for s in reference}
    assert max(deltas.values()) <= 1e-5, deltas
    assert "use_distributed_optimizer=false" in fit_runs.error("muon_distopt_refused")
    error = fit_runs.error("muon_resumed_as_adamw")
    assert "'muon': True}, this run has {'distributed': False, 'bf16': False}" in error, error
