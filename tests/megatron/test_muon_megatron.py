"""Muon under MegatronStrategy: the tensor-parallel exchange, the fused-matrix splits and the optimizer's steps.

The 2-process cases run in one launch of ``muon_worker.py`` (TP = 2 and EP = 2 on gloo), shared by the tests.
"""

from pathlib import Path

import pytest
import torch
from conftest import torchrun
from muon_reference import dense_config, native_model

from forge_lightning.strategies.megatron.muon import FusedQKVSplit, GatedSplit, TensorParallelExchange

HERE = Path(__file__).resolve().parent
CASES = ("exchange",)


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
