"""2-process worker for the Muon-under-megatron tests: every case in one set of processes (gloo, CPU shim).

``python -m torch.distributed.run --nproc-per-node 2 muon_worker.py OUT_DIR CASE...``; each case writes
``OUT_DIR/<case>.pt`` on global rank 0 (``torch.load(..., weights_only=False)``):

* ``exchange``: the dense debug twin at TP = 2: the full matrices :class:`TensorParallelExchange` gathers for each
  owner (by megatron name), and whether ``publish`` of ``2 * full + rank`` gives each rank ``2 * shard + owner``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_shim

cuda_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from muon_reference import dense_config, twin_chunks  # noqa: E402

from forge_lightning.optim.muon_exchange import newton_schulz_flops  # noqa: E402
from forge_lightning.strategies.megatron.muon import TensorParallelExchange  # noqa: E402


@torch.no_grad()
def exchange_case() -> dict:
    """Gather every 2-D parameter of the TP = 2 twin onto its owner, publish a result that names its owner."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    (chunk,) = twin_chunks(dense_config(), tensor_model_parallel_size=2)
    named = [(n, p) for n, p in chunk.named_parameters() if p.ndim == 2]
    params = [p for _, p in named]  # the parameters themselves: they carry megatron's TP marks
    group = parallel_state.get_tensor_model_parallel_group()
    exchange = TensorParallelExchange(params, [newton_schulz_flops(p.shape) for p in params], group)
    full = exchange.gather(params)
    owners = {n: exchange.owners[i] for i, (n, _) in enumerate(named)}
    results = {i: 2 * f + exchange.rank for i, f in full.items()}
    out = exchange.publish(results)
    published = all(
        torch.equal(o, 2 * p + exchange.owners[i]) for i, (o, p) in enumerate(zip(out, params, strict=True))
    )

    gathered = [None, None]
    dist.all_gather_object(gathered, {named[i][0]: f for i, f in full.items()})
    parallel_state.destroy_model_parallel()
    return {
        "full": {**gathered[0], **gathered[1]},
        "owners": owners,
        "published": published,
        "sharded": [n for n, p in named if getattr(p, "tensor_model_parallel", False)],
    }


CASES = {"exchange": exchange_case}


def main(out: Path, cases: list[str]) -> None:
    dist.init_process_group("gloo")
    for case in cases:
        result = CASES[case]()
        if dist.get_rank() == 0:
            torch.save(result, out / f"{case}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
