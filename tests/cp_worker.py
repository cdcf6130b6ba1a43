"""One rank of the context-parallel checks (run on 2 and 4 gloo processes by tests/test_context_parallel.py).

Every case splits the same random q, k, v (and output gradient) over the ranks, runs one context-parallel attention
and writes the largest difference from full-sequence attention on one process, over the output and q, k, v's
gradients (each rank checks its own positions).
"""

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from worker_exit import finish_worker

from forge_lightning.distributed.context_parallel import (
    ContextParallel,
    hybrid_attention,
    ring_attention,
    ulysses_attention,
)
from forge_lightning.modules.layers.attention import DocumentMask, attention

B, H, K, S, D = 2, 4, 2, 16, 8


def _load_balanced(world: int) -> list[int]:
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


def _case(
    rank: int,
    world: int,
    order: list[int] | None,
    attend: Callable[..., torch.Tensor],
    *,
    documents: bool = False,
    kv_heads: int = K,
    v_dim: int = D,
    dtype: torch.dtype = torch.float64,
) -> dict:
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, H, S, D), (B, kv_heads, S, D), (B, kv_heads, S, v_dim), (B, H, S, v_dim)]
    q, k, v, grad_out = (torch.randn(s, generator=gen, dtype=dtype) for s in shapes)
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 4 + [2] * 3])
    mask = DocumentMask.build(doc_ids, "sdpa") if documents else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = attention(*full, causal=True, documents=mask)
    (reference * grad_out).sum().backward()

    order = list(order) if order is not None else list(range(world))
    per_rank = len(order) // world
    mine = order[rank * per_rank : (rank + 1) * per_rank]

    def local(x: torch.Tensor) -> torch.Tensor:  # this rank's chunks of the sequence dim
        chunks = x.chunk(len(order), dim=2)
        return torch.cat([chunks[c] for c in mine], dim=2)

    parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
    out = attend(*parts, order=None if order == list(range(world)) else order, documents=mask)
    (out * local(grad_out)).sum().backward()
    errors = [(out - local(reference)).abs().max().item()]
    errors += [(p.grad - local(f.grad)).abs().max().item() for p, f in zip(parts, full)]
    return {"max_error": max(errors), "shape": list(out.shape)}


def _ulysses(q, k, v, *, order, documents):
    cp = ContextParallel(group=dist.group.WORLD, chunk_order=order)
    return ulysses_attention(q, k, v, cp, causal=True, documents=documents)


def _ring(q, k, v, *, order, documents):
    return ring_attention(q, k, v, ContextParallel(dist.group.WORLD, order, comm_type="p2p"))


def _hybrid_groups(world: int, a2a: int) -> tuple:
    """megatron's hierarchical layout: a2a groups of consecutive ranks, rings of ranks ``a2a`` apart."""
    rank, mine = dist.get_rank(), {}
    for name, groups in (
        ("a2a", [list(range(j * a2a, (j + 1) * a2a)) for j in range(world // a2a)]),
        ("p2p", [list(range(i, world, a2a)) for i in range(a2a)]),
    ):
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    return mine["a2a"], mine["p2p"]


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    balanced = _load_balanced(world)
    results = {
        "ring_contiguous": _case(rank, world, None, _ring),
        "ring_load_balanced": _case(rank, world, balanced, _ring),
        "ring_mqa_narrow_values": _case(rank, world, balanced, _ring, kv_heads=1, v_dim=6),
        "ring_fp32": _case(rank, world, balanced, _ring, dtype=torch.float32),
    }
    if world == 2:
        results |= {
            "contiguous": _case(rank, world, None, _ulysses),
            "load_balanced": _case(rank, world, (0, 3, 1, 2), _ulysses),
            "packed_documents": _case(rank, world, None, _ulysses, documents=True),
        }
        try:
            from forge_lightning.distributed.context_parallel import to_head_parallel

            to_head_parallel(torch.zeros(1, 3, 4, 2), ContextParallel(group=dist.group.WORLD))
        except ValueError as err:
            results["error"] = str(err)
    if world == 4:
        a2a_group, p2p_group = _hybrid_groups(world, a2a=2)

        def hybrid(q, k, v, *, order, documents):
            cp = ContextParallel(dist.group.WORLD, order, "a2a+p2p", a2a_group, p2p_group)
            return hybrid_attention(q, k, v, cp)

        results |= {
            "hybrid_load_balanced": _case(rank, world, balanced, hybrid),
            "hybrid_mqa": _case(rank, world, balanced, hybrid, kv_heads=1),  # repeated to the query heads
            "hybrid_contiguous": _case(rank, world, None, hybrid),
        }
        try:  # a2a and p2p groups swapped: not megatron's layout
            ContextParallel(dist.group.WORLD, balanced, "a2a+p2p", p2p_group, a2a_group)
        except ValueError as err:
            results["error"] = str(err)
    finish_worker(out, rank, results)


if __name__ == "__main__":
    main()
