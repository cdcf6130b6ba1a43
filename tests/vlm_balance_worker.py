"""One rank of the load-balancing check (2 gloo processes, started by tests/vlm/test_vlm_balance.py).

Each rank takes its micro-batches of the first optimizer step from ``VLMDataModule``'s training loader (balanced or
not), sums its token losses normalised by the global batch's trained tokens (``step_tokens`` summed over the ranks),
back-propagates, and all-reduces the gradients: the step's global loss and gradient. Rank 0 also computes them on
one process over the whole global batch. Each rank writes ``rank<r>.pt``.

Usage: ``vlm_balance_worker.py RANK WORLD STORE OUT DATA``.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from vlm_pack_case import datamodule, model, token_losses
from worker_exit import exit_worker

from forge_lightning.datamodules.vlm.balance import item_costs

BATCH, ACCUMULATE = 2, 2


def _step(dm, world: int, rank: int, reduce: bool) -> dict:
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(), world_size=world, global_rank=rank, accumulate_grad_batches=ACCUMULATE
    )
    loader = dm.train_dataloader()
    indices = loader._batch_indices(0, 0)[:ACCUMULATE]
    costs = item_costs(dm.train_dataset, dm.balance_cost)
    vlm = model(dm)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for _, batch in zip(range(ACCUMULATE), loader):
        total = batch["step_tokens"].double()
        if reduce:
            dist.all_reduce(total)
        losses = token_losses(vlm, batch).sum()
        (losses / total).backward()
        loss_sum += losses.detach().double() / total
    grads = {name: p.grad for name, p in vlm.named_parameters() if p.grad is not None}
    if reduce:
        dist.all_reduce(loss_sum)
        for grad in grads.values():
            dist.all_reduce(grad)
    return {
        "loss": loss_sum,
        "grads": grads,
        "indices": indices,
        "cost": [sum(costs[i] for i in b) for b in indices],
    }


def main() -> None:
    rank, world, store, out, data = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        Path(sys.argv[5]),
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    files = (data / "tokenizer", data / "train.jsonl")
    result = {
        mode: _step(
            datamodule(*files, batch_size=BATCH, balance=mode == "balanced"), world, rank, reduce=True
        )
        for mode in ("unbalanced", "balanced")
    }
    if rank == 0:
        result["single"] = _step(datamodule(*files, batch_size=BATCH * world), 1, 0, reduce=False)
    torch.save(result, out / f"rank{rank}.pt")
    exit_worker()


if __name__ == "__main__":
    main()
