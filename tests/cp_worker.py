"""One rank of the Ulysses context-parallel check (run twice by tests/test_context_parallel.py)."""

import json
import sys

import torch
import torch.distributed as dist

from forge_lightning.modules.layers.attention import DocumentMask, attention
from forge_lightning.strategies.context_parallel import ContextParallel, ulysses_attention

B, H, K, S, D = 2, 4, 2, 16, 8


def _case(rank: int, world: int, order, documents: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, K, K))
    grad_out = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
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

    cp = ContextParallel(group=dist.group.WORLD, chunk_order=None if order == list(range(world)) else order)
    parts = [local(t).clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*parts, cp, causal=True, documents=mask)
    (out * local(grad_out)).sum().backward()
    errors = [(out - local(reference)).abs().max().item()]
    errors += [(p.grad - local(f.grad)).abs().max().item() for p, f in zip(parts, full)]
    return {"max_error": max(errors), "shape": list(out.shape)}


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {
        "contiguous": _case(rank, world, None, documents=False),
        "load_balanced": _case(rank, world, (0, 3, 1, 2), documents=False),
        "packed_documents": _case(rank, world, None, documents=True),
    }
    try:
        ContextParallel(group=dist.group.WORLD)
        from forge_lightning.strategies.context_parallel import to_head_parallel

        to_head_parallel(torch.zeros(1, 3, 4, 2), ContextParallel(group=dist.group.WORLD))
    except ValueError as err:
        results["error"] = str(err)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
