"""Context-parallel attention equals full-sequence attention: Ulysses, ring and hybrid (Ulysses x ring).

One process: ring attention's pieces (the per-step plans of chunk pairs, the fp32 matmul block kernel and the
log-sum-exp merge, forward and backward) simulated over every rank of a ring, against SDPA at fp32 (1e-5); the
FlashAttention block's op calls on the meta device (shapes only), and on a GPU (``gpu`` marker) the FlashAttention
blocks in the same simulated ring, bf16, against SDPA. Then
``cp_worker.py`` on 2 gloo processes (Ulysses, ring) and 4 (ring, hybrid 2 x 2): outputs and gradients of each
rank's positions against one-process attention, fp64 (1e-12) and fp32 (1e-5).
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from procs import run_workers

from forge_lightning.distributed.context_parallel import (
    ContextParallel,
    _FlashBlock,
    _MathBlock,
    _merge,
    _ring_plans,
)

WORKER = Path(__file__).with_name("cp_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(WORKER, 2, tmp_path_factory.mktemp("cp"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return run_workers(WORKER, 4, tmp_path_factory.mktemp("cp4"))


@pytest.mark.parametrize("case", ["contiguous", "load_balanced", "packed_documents"])
def test_ulysses_matches_full_attention_outputs_and_gradients(results, case):
    for rank in results:
        assert rank[case]["shape"] == [2, 4, 8, 8]  # [B, H, S/P, D]: this rank's positions, all heads
        assert rank[case]["max_error"] < 1e-12, rank[case]


def test_heads_not_divisible_by_the_group_are_refused(results):
    assert "head count (3) divisible by the context-parallel size (2)" in results[0]["error"]


RING_CASES = ["ring_contiguous", "ring_load_balanced", "ring_mqa_narrow_values", "ring_fp32"]


@pytest.mark.parametrize("case", RING_CASES)
def test_ring_matches_full_attention_on_2_ranks(results, case):
    for rank in results:
        assert rank[case]["shape"][:3] == [2, 4, 8]
        assert rank[case]["max_error"] < (1e-5 if case.endswith("fp32") else 1e-12), rank[case]


@pytest.mark.parametrize("case", [*RING_CASES, "hybrid_load_balanced", "hybrid_mqa", "hybrid_contiguous"])
def test_ring_and_hybrid_match_full_attention_on_4_ranks(results4, case):
    for rank in results4:
        assert rank[case]["shape"][:3] == [2, 4, 4]
        assert rank[case]["max_error"] < (1e-5 if case.endswith("fp32") else 1e-12), rank[case]
    assert "do not tile the context-parallel group" in results4[1]["error"]


def _simulated_ring(q, k, v, grad_out, held, causal, block=_MathBlock):
    """Every rank of a ring on one process: each rank's plan of kernel calls, the block kernel (``_MathBlock`` or
    ``_FlashBlock``) and the merge into fp32 accumulators; then the backward blocks from the output rounded to the
    inputs' dtype (as ring attention saves it), their gradients scattered to the positions they belong to."""
    B, H, S, Dv = grad_out.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    world, per = len(held), len(held[0])
    c = S // (world * per)  # chunk length

    def local(x, r):
        return torch.cat([x[:, :, i * c : (i + 1) * c] for i in held[r]], dim=2)

    def scatter(into, grad, chunks):
        for j, chunk in enumerate(chunks):
            into[:, :, chunk * c : (chunk + 1) * c] += grad[:, :, j * c : (j + 1) * c]

    out_full, grads = torch.zeros_like(grad_out), [torch.zeros_like(t, dtype=acc) for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    for r in range(world):
        plans, q_r = _ring_plans(held, r, causal), local(q, r)
        out = torch.zeros(B, H, per * c, Dv, dtype=acc, device=q.device)
        lse = torch.full((B, H, per * c), float("-inf"), dtype=acc, device=q.device)
        blocks = [
            (slice(first * c, end * c), n, causal_block, (r - step) % world)
            for step, plan in enumerate(plans)
            for first, end, n, causal_block in plan
        ]
        for rows, n, causal_block, owner in blocks:
            k_o, v_o = local(k, owner)[:, :, : n * c], local(v, owner)[:, :, : n * c]
            _merge(
                out[:, :, rows],
                lse[:, :, rows],
                *block.forward(q_r[:, :, rows], k_o, v_o, causal_block, scale),
            )
        out = out.to(q.dtype)
        scatter(out_full, out, held[r])
        dout = local(grad_out, r)
        delta = block.prepare(dout, out)
        for rows, n, causal_block, owner in blocks:
            k_o, v_o = local(k, owner)[:, :, : n * c], local(v, owner)[:, :, : n * c]
            dq, dk, dv = block.backward(
                dout[:, :, rows], q_r[:, :, rows], k_o, v_o, out[:, :, rows], lse[:, :, rows],
                None if delta is None else delta[:, :, rows], causal_block, scale,
            )  # fmt: skip
            scatter(grads[0], dq, held[r][rows.start // c : rows.stop // c])
            scatter(grads[1], dk, held[owner][:n])
            scatter(grads[2], dv, held[owner][:n])
    return out_full, grads


@pytest.mark.parametrize(
    "held, kv_heads, v_dim, causal",
    [
        ([[0, 3], [1, 2]], 2, 8, True),  # megatron's load-balanced split of 2 ranks, GQA
        ([[0], [1], [2], [3]], 4, 8, True),  # contiguous split of 4 ranks
        ([[0, 7], [1, 6], [2, 5], [3, 4]], 1, 6, True),  # load-balanced, 4 ranks, MQA, narrower values (MLA)
        ([[0, 1, 6, 7], [2, 3, 4, 5]], 2, 8, True),  # the ring of the hybrid 2 x 2 (2 a2a ranks' chunks each)
        ([[0, 3], [1, 2]], 2, 8, False),
    ],
)
def test_ring_blocks_and_merge_match_sdpa(held, kv_heads, v_dim, causal):
    gen = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 4, 32, 8
    shapes = [(B, H, S, D), (B, kv_heads, S, D), (B, kv_heads, S, v_dim), (B, H, S, v_dim)]
    q, k, v, grad_out = (torch.randn(s, generator=gen) for s in shapes)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=kv_heads < H)
    (reference * grad_out).sum().backward()
    out, grads = _simulated_ring(q, k, v, grad_out, held, causal)
    torch.testing.assert_close(out, reference.detach(), atol=1e-5, rtol=0)
    for grad, ref in zip(grads, full):
        torch.testing.assert_close(grad, ref.grad, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "held, kv_heads, v_dim, causal",
    [
        ([[0, 3], [1, 2]], 2, 64, True),  # load-balanced, 2 ranks, GQA
        ([[0, 7], [1, 6], [2, 5], [3, 4]], 1, 32, True),  # 4 ranks, MQA, narrower values (padded for the op)
        ([[0, 3], [1, 2]], 8, 64, False),
    ],
)
def test_ring_flash_blocks_match_sdpa_on_cuda(held, kv_heads, v_dim, causal):
    """The CUDA block kernel (FlashAttention's ops, bf16) in the same simulated ring, against fp32 SDPA of the same
    bf16 inputs: outputs and q, k, v gradients within bf16 rounding (relative to each tensor's largest value)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, S, D = 2, 8, 512, 64
    shapes = [(B, H, S, D), (B, kv_heads, S, D), (B, kv_heads, S, v_dim), (B, H, S, v_dim)]
    q, k, v, grad_out = (torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes)
    assert _FlashBlock.usable(q, k, v)
    full = [t.float().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=kv_heads < H)
    (reference * grad_out.float()).sum().backward()
    out, grads = _simulated_ring(q, k, v, grad_out, held, causal, block=_FlashBlock)

    def rel_err(actual, expected):
        return ((actual.float() - expected).abs().max() / expected.abs().max()).item()

    assert rel_err(out, reference.detach()) < 2e-2
    for grad, ref in zip(grads, full):
        assert rel_err(grad, ref.grad) < 3e-2


def test_load_balanced_ring_steps_are_one_half_block_each():
    """Causal, load-balanced: after the own block, every step is one unmasked call over half the pairs."""
    held = [[0, 7], [1, 6], [2, 5], [3, 4]]
    for rank in range(4):
        plans = _ring_plans(held, rank, causal=True)
        assert plans[0] == [(0, 2, 2, True)]
        for step, plan in enumerate(plans[1:], start=1):
            # kv from a lower rank: both query chunks see its first chunk; from a higher one: our second chunk
            # sees both of its chunks.
            assert plan == ([(0, 2, 1, False)] if step <= rank else [(1, 2, 2, False)]), (rank, step)


def test_flash_block_calls_fit_the_aten_ops():
    """FlashAttention's ops on the meta device: arguments and shapes only (GQA expanded, narrow values padded)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = (
        torch.empty(2, 4, 16, 16, **meta),
        torch.empty(2, 2, 32, 16, **meta),
        torch.empty(2, 2, 32, 8, **meta),
    )
    out, lse = _FlashBlock.forward(q, k, v, False, 0.25)
    assert out.shape == (2, 4, 16, 8) and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    dq, dk, dv = _FlashBlock.backward(torch.empty_like(out), q, k, v, out, lse, None, False, 0.25)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not _FlashBlock.usable(q.float(), k.float(), v.float())  # fp32: the matmul kernel


def test_context_parallel_options_are_checked():
    with pytest.raises(ValueError, match=r"cp_comm_type \('ring'\) must be one of a2a, p2p, a2a\+p2p"):
        ContextParallel(group=None, comm_type="ring")
    with pytest.raises(ValueError, match="must list each chunk"):
        ContextParallel(group=None, chunk_order=(0, 0, 1, 2))
    with pytest.raises(ValueError, match="needs both an a2a_group and a p2p_group"):
        ContextParallel(group=None, comm_type="a2a+p2p")
