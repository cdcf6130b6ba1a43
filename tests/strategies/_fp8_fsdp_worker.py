"""One rank of the 2-process checks in test_fp8_fsdp_comm.py: ``python _fp8_fsdp_worker.py RANK WORLD STORE OUT``.

Every check uses real gloo collectives under ``fully_shard``; the bytes a rank sends are counted by wrapping the
collectives themselves (:class:`ByteCounter`), not read back from the code under test.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny.py

BF16_EPS = 2.0**-8  # bf16 spacing relative to a value's magnitude (at most)


class ByteCounter:
    """Wrap the collectives FSDP2 and the compressed paths use; count the bytes this rank sends."""

    def __init__(self) -> None:
        self.sent = 0
        self.world = dist.get_world_size()
        for name, share in (
            ("all_gather_into_tensor", self.world - 1),  # own input to every other rank
            ("all_gather_single", self.world - 1),
            ("all_to_all_single", (self.world - 1) / self.world),  # all rows but its own
            ("reduce_scatter_single", (self.world - 1) / self.world),
        ):
            setattr(dist, name, self._wrap(getattr(dist, name), share))

    def _wrap(self, fn, share):
        def counted(*args, **kwargs):
            tensor = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            self.sent += round(tensor.numel() * tensor.element_size() * share)
            return fn(*args, **kwargs)

        return counted

    def take(self) -> int:
        sent, self.sent = self.sent, 0
        return sent


def _everyone(x: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def _multiscale(n: int, gen: torch.Generator) -> torch.Tensor:
    """Gradient-like values spanning five orders of magnitude across elements."""
    return torch.randn(n, generator=gen) * torch.logspace(-5, 0, n)[torch.randperm(n, generator=gen)]


# ----- standalone reduce-scatter ----------------------------------------------------------------------------------
def reduce_scatter_check(rank: int, world: int, counter: ByteCounter) -> dict:
    from forge_lightning.strategies.comm import compressed_reduce_scatter, compressed_reduce_scatter_bytes

    chunk = 5_000  # not a multiple of 256: a partial last block in every row
    gen = torch.Generator().manual_seed(10 + rank)
    x = _multiscale(world * chunk, gen)
    inputs_WN = _everyone(x)  # [W, W * C]: every rank's input
    exact = inputs_WN.view(world, world, chunk)[:, rank].mean(0)
    out = {}
    for dtype in ("fp8", "bf16"):
        counter.take()
        got = compressed_reduce_scatter(torch.empty(chunk), x, dtype=dtype)
        sent = counter.take()
        mine_WC = inputs_WN.view(world, world, chunk)[:, rank]  # what each rank sent me
        amax = mine_WC.view(world, -1).abs().amax(dim=1)  # loose: block amax <= row amax
        if dtype == "fp8":
            # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); values below the block's normal range lose at
            # most scale * 2^-10 = amax / 448 / 1024. Each rank's contribution is rounded once; the sum is fp32.
            bound = (mine_WC.abs() / 16 + amax[:, None] / 448 / 1024).sum(0) / world
        else:
            bound = (mine_WC.abs() * 2.0**-8).sum(0) / world + 1e-12  # bf16: 8 significant bits
        err = (got - exact).abs()
        out[dtype] = {
            "max_err_over_bound": float((err / bound).max()),
            "rel_l2": float(err.norm() / exact.norm()),
            "bytes_counted": sent,
            "bytes_formula": compressed_reduce_scatter_bytes(chunk, world, dtype),
            "bytes_fp32": (world - 1) * chunk * 4,
        }
    out["error_feedback"] = _error_feedback_check(rank, world)
    return out


def _error_feedback_check(rank: int, world: int, steps: int = 16, chunk: int = 2_048) -> dict:
    """Sum of the applied (reduce-scattered) gradients over K steps vs the exact sum, with and without EF."""
    from forge_lightning.strategies.comm import compressed_reduce_scatter

    gen = torch.Generator().manual_seed(20 + rank)
    base = _multiscale(world * chunk, gen)  # a persistent gradient direction plus per-step noise
    grads = [base + 0.3 * _multiscale(world * chunk, gen) for _ in range(steps)]
    exact_sum = sum(_everyone(g).view(world, world, chunk)[:, rank].mean(0) for g in grads)
    errors = {}
    for name, residual in (("without", None), ("with", torch.zeros(world * chunk))):
        applied = sum(compressed_reduce_scatter(torch.empty(chunk), g, residual=residual) for g in grads)
        errors[name] = float((applied - exact_sum).norm() / exact_sum.norm())
    return errors


# ----- FSDP2 models -----------------------------------------------------------------------------------------------
def _mp_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    # Sizes whose shards are not multiples of 256: partial blocks, FSDP padding (33 rows over 2 ranks).
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 33), nn.GELU(), nn.Linear(33, 8))


def _shard_linear_stack(model: nn.Sequential, mesh, reshard_after_forward: bool = True) -> list[nn.Module]:
    from torch.distributed.fsdp import fully_shard

    blocks = [model[0], model[2]]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=_mp_policy(), reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=_mp_policy(), reshard_after_forward=False)
    return [*blocks, model[4]]


def _unit_shard_numels(model: nn.Module) -> list[int]:
    from forge_lightning.strategies.comm.fp8_reduce_scatter import fsdp_units

    return [sum(fp._sharded_param_data.numel() for fp in group.fsdp_params) for _, group in fsdp_units(model)]


def _capture_used_params(layers: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Record the (unsharded, bf16) weights each layer computes with, at its forward."""
    used: dict[str, torch.Tensor] = {}

    def hook(module, _args):
        for name, p in module.named_parameters(recurse=False):
            used[f"{id(module)}.{name}"] = p.detach().clone()

    for layer in layers:
        layer.register_forward_pre_hook(hook)
    return used


def _exact_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The exact gathered parameters: the fp32 master shards, gathered, cast to the compute dtype."""
    from forge_lightning.strategies.comm.fp8_reduce_scatter import fsdp_units

    return {
        f"{id(fp._module_info.module)}.{fp._module_info.param_name}": fp.sharded_param.detach()
        .full_tensor()
        .to(torch.bfloat16)
        for _, group in fsdp_units(model)
        for fp in group.fsdp_params
    }


def _max_abs(a: dict, b: dict | None = None) -> float:
    return max(float((a[k].float() - (b[k].float() if b else 0)).abs().max()) for k in a)


def _within_delta_bound(used: dict, exact: dict, prev_used: dict) -> bool:
    """Each element's error is at most the e4m3 rounding of its delta block plus one rounding to bf16.

    The delta of a step is d = exact - previous reconstruction (it carries the previous step's error, which is
    why the error does not accumulate); e4m3 rounds d within |d_block_max| / 16, and adding it to the bf16
    reconstruction rounds once more, by at most 2^-8 of the value.
    """
    d_max = _max_abs(exact, prev_used)
    return all(
        bool(
            (
                (used[k].float() - exact[k].float()).abs() <= d_max / 16 + BF16_EPS * exact[k].float().abs()
            ).all()
        )
        for k in used
    )


def delta_run(
    rank: int, world: int, counter: ByteCounter, *, resync_every: int, keep_unsharded: bool, steps: int
) -> dict:
    """Train the linear stack for a few AdamW steps with the delta all-gather; record per-step errors and bytes."""
    from torch.distributed.device_mesh import init_device_mesh

    from forge_lightning.strategies.comm import delta_all_gather_bytes, enable_delta_fp8_all_gather

    model = _linear_stack()
    layers = _shard_linear_stack(model, init_device_mesh("cpu", (world,)))
    handle = enable_delta_fp8_all_gather(model, resync_every=resync_every, keep_unsharded=keep_unsharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if keep_unsharded:
        handle.attach(optimizer)
    used = _capture_used_params(layers)
    gen = torch.Generator().manual_seed(30 + rank)
    record = {k: [] for k in ("err", "update", "bound_ok", "identical", "forward", "backward", "step")}
    prev_used, prev_exact = None, None
    for _ in range(steps):
        exact = _exact_params(model)  # before forward: the values this step should gather
        counter.take()
        loss = model(torch.randn(16, 48, generator=gen)).float().square().mean()
        record["forward"].append(counter.take())
        loss.backward()
        record["backward"].append(counter.take())
        optimizer.step()
        record["step"].append(counter.take())
        optimizer.zero_grad()
        record["err"].append(_max_abs(used, exact))
        record["identical"].append(all(torch.equal(*_everyone(v.float())) for v in used.values()))
        if prev_exact is not None:
            record["update"].append(_max_abs(exact, prev_exact))
            record["bound_ok"].append(_within_delta_bound(used, exact, prev_used))
        prev_used, prev_exact = {k: v.clone() for k, v in used.items()}, exact
    handle.request_resync()
    exact = _exact_params(model)
    with torch.no_grad():
        model(torch.randn(16, 48, generator=gen))
    record["err_after_request"] = _max_abs(used, exact)
    # Forward passes without an optimizer step in between (micro-batches): the same parameters.
    repeats = []
    for _ in range(2):
        with torch.no_grad():
            model(torch.randn(16, 48, generator=gen))
        repeats.append({k: v.clone() for k, v in used.items()})
    record["repeat_identical"] = all(torch.equal(repeats[0][k], repeats[1][k]) for k in used)
    shards = _unit_shard_numels(model)
    record["bytes_formula_delta"] = sum(delta_all_gather_bytes(s, world) for s in shards)
    record["bytes_formula_bf16"] = sum((world - 1) * 2 * s for s in shards)
    record["bytes_formula_fp32_reduce_scatter"] = sum((world - 1) * 4 * s for s in shards)
    record["stats"] = vars(handle.stats)
    return record


def fsdp_reduce_scatter_check(rank: int, world: int, counter: ByteCounter) -> dict:
    """The sharded gradients FSDP2 produces with the compressed reduce-scatter vs with its own."""
    from torch.distributed.device_mesh import init_device_mesh

    from forge_lightning.strategies.comm import compressed_reduce_scatter_bytes, enable_fp8_reduce_scatter

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(40 + rank))
    grads, sent = {}, {}
    for mode in ("exact", "fp8", "bf16"):
        model = _linear_stack()
        _shard_linear_stack(model, mesh, reshard_after_forward=False)  # backward then only reduce-scatters
        if mode != "exact":
            enable_fp8_reduce_scatter(model, dtype=mode, error_feedback=False)
        loss = model(x).float().square().mean()
        counter.take()
        loss.backward()
        sent[mode] = counter.take()
        grads[mode] = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    shards = _unit_shard_numels(model)
    out = {}
    for mode in ("fp8", "bf16"):
        err = grads[mode] - grads["exact"]
        out[mode] = {
            "rel_l2": float(err.norm() / grads["exact"].norm()),
            "bytes_counted": sent[mode],
            "bytes_formula": sum(compressed_reduce_scatter_bytes(s, world, mode) for s in shards),
        }
    out["exact_bytes_counted"] = sent["exact"]
    out["exact_bytes_fp32_formula"] = sum((world - 1) * 4 * s for s in shards)
    return out


# ----- the tiny LLM -----------------------------------------------------------------------------------------------
def llm_losses(rank: int, world: int, options: dict | None, steps: int = 5) -> list[float]:
    """Per-step mean loss (over ranks) of the tiny LLM under FSDP2 with bf16 params and fp32 master weights."""
    from tiny import TINY_LLM
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from forge_lightning.modules.llm.config import LLMConfig
    from forge_lightning.modules.llm.model import DecoderLM
    from forge_lightning.strategies.comm import apply_fsdp_comm_options

    torch.manual_seed(0)
    model = DecoderLM(LLMConfig.load(TINY_LLM), attention_backend="sdpa")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=_mp_policy())
    fully_shard(model, mesh=mesh, mp_policy=_mp_policy(), reshard_after_forward=False)
    handles = apply_fsdp_comm_options(model, **options) if options is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if handles is not None and handles.all_gather is not None:
        handles.all_gather.attach(optimizer)
    gen = torch.Generator().manual_seed(50 + rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (4, 33), generator=gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(_everyone(loss.detach()).mean()))
    return losses


def training_check(rank: int, world: int) -> dict:
    compressed = {"param_all_gather": "delta_fp8", "gradient_reduce": "fp8", "fp8_error_feedback": True}
    return {
        "plain": llm_losses(rank, world, None),
        "exact_options": llm_losses(rank, world, {"param_all_gather": "exact", "gradient_reduce": "exact"}),
        "delta_fp8_rs": llm_losses(rank, world, compressed),
        "zero2_delta_bf16_rs": llm_losses(
            rank,
            world,
            {"param_all_gather": "delta_fp8", "gradient_reduce": "bf16", "delta_keep_unsharded": True},
        ),
    }


def main() -> None:
    rank, world, store_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    counter = ByteCounter()
    result = {
        "reduce_scatter": reduce_scatter_check(rank, world, counter),
        "fsdp_reduce_scatter": fsdp_reduce_scatter_check(rank, world, counter),
        "delta": delta_run(rank, world, counter, resync_every=0, keep_unsharded=False, steps=16),
        "delta_resync": delta_run(rank, world, counter, resync_every=4, keep_unsharded=False, steps=10),
        "zero2": delta_run(rank, world, counter, resync_every=4, keep_unsharded=True, steps=10),
        "training": training_check(rank, world),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # The results are written. Interpreter teardown after a gloo group occasionally aborts in a C++ thread
    # destructor ("terminate called without an active exception", torch 2.13 CPU), so exit without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
