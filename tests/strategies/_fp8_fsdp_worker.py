"""One rank of the checks in test_fp8_fsdp_comm.py: ``python _fp8_fsdp_worker.py RANK WORLD STORE OUT [SUITE]``.

SUITE ``fsdp`` (default): 1-D FSDP checks on 2 processes; ``hsdp``: the replicate 2 x shard ``WORLD/2`` checks.

Every check uses real gloo collectives under ``fully_shard``; the bytes a rank sends are counted by wrapping the
collectives themselves (:class:`ByteCounter`), not read back from the code under test.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from worker_exit import exit_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny.py

BF16_EPS = 2.0**-8  # bf16 spacing relative to a value's magnitude (at most)


class ByteCounter:
    """Wrap the collectives FSDP2 and the compressed paths use; count the bytes this rank sends.

    Shares are taken over the size of the group each call runs on (the shard group under HSDP, not the world).
    ``all_reduce`` (FSDP2's HSDP all-reduce across replicas) is counted apart, as the elements it reduces.
    """

    SHARES = {
        "all_gather_into_tensor": lambda w: w - 1,  # own input to every other rank
        "all_gather_single": lambda w: w - 1,
        "all_to_all_single": lambda w: (w - 1) / w,  # all rows but its own
        "reduce_scatter_single": lambda w: (w - 1) / w,
    }

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.all_reduce_numel = 0
        for name, share in self.SHARES.items():
            setattr(dist, name, self._wrap(name, getattr(dist, name), share))
        all_reduce = dist.all_reduce

        def counted_all_reduce(tensor, *args, **kwargs):
            self.all_reduce_numel += tensor.numel()
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted_all_reduce

    def _wrap(self, name, fn, share):
        def counted(*args, **kwargs):
            tensor = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            world = dist.get_world_size(kwargs.get("group"))
            sent = round(tensor.numel() * tensor.element_size() * share(world))
            self.sent[name] = self.sent.get(name, 0) + sent
            return fn(*args, **kwargs)

        return counted

    def take(self) -> int:
        """Bytes sent since the last take, all collectives together."""
        return sum(self.take_each().values())

    def take_each(self) -> dict[str, int]:
        """Bytes sent since the last take per kind (``all_gather``, ``all_to_all``, ``reduce_scatter``)."""
        each: dict[str, int] = {}
        for name, sent in self.sent.items():
            kind = name.removesuffix("_single").removesuffix("_into_tensor")
            each[kind] = each.get(kind, 0) + sent
        self.sent = {}
        return each

    def take_all_reduce_numel(self) -> int:
        numel, self.all_reduce_numel = self.all_reduce_numel, 0
        return numel


def _everyone(x: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def _same_everywhere(x: torch.Tensor) -> bool:
    """Whether ``x`` is bit-identical on every rank (gathered in fp32, which holds bf16 values exactly)."""
    x = x.float()
    return all(torch.equal(x, other) for other in _everyone(x))


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
        record["identical"].append(all(_same_everywhere(v) for v in used.values()))
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
def _tiny_llm() -> nn.Module:
    from tiny import TINY_LLM

    from forge_lightning.modules.llm.config import LLMConfig
    from forge_lightning.modules.llm.model import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(LLMConfig.load(TINY_LLM), attention_backend="sdpa")


def _llm_batch(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 512, (4, 33), generator=gen)  # [B, T + 1]: one data-parallel rank's batch


def _llm_loss(model: nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    logits = model(tokens_BT[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, 512), tokens_BT[:, 1:].reshape(-1))


def _capture_unsharded_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Record the gathered (non-DTensor) parameters each module computes with, at its forward."""
    from torch.distributed.tensor import DTensor

    used: dict[str, torch.Tensor] = {}

    def hook(module, _args):
        for name, p in module.named_parameters():
            if not isinstance(p, DTensor):
                used[f"{id(module)}.{name}"] = p.detach().clone()

    for module in modules:
        module.register_forward_pre_hook(hook)
    return used


def llm_run(
    rank: int,
    options: dict | None,
    *,
    mesh,
    mp_policy=None,
    steps: int = 5,
    counter: ByteCounter | None = None,
) -> dict:
    """Train the tiny LLM under FSDP2 (1-D mesh) or HSDP (2-D replicate x shard mesh) for a few AdamW steps.

    Returns the per-step mean loss over ranks, the bytes each phase of each step sent (with ``counter``), and
    whether the parameters ended bit-identical: the gathered ones on every rank, the sharded ones across replicas.
    """
    from torch.distributed.fsdp import fully_shard

    from forge_lightning.strategies.comm import apply_fsdp_comm_options

    model = _tiny_llm()
    mp_policy = mp_policy or _mp_policy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    handles = apply_fsdp_comm_options(model, **options) if options is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if handles is not None and handles.all_gather is not None:
        handles.all_gather.attach(optimizer)
    used = _capture_unsharded_params([model, *model.model.layers])
    gen = torch.Generator().manual_seed(50 + rank)
    record = {k: [] for k in ("losses", "forward", "backward", "step", "all_reduce_numel")}
    for _ in range(steps):
        take = counter.take_each if counter else dict
        take()
        loss = _llm_loss(model, _llm_batch(gen))
        record["forward"].append(take())
        loss.backward()
        record["backward"].append(take())
        record["all_reduce_numel"].append(counter.take_all_reduce_numel() if counter else 0)
        optimizer.step()
        optimizer.zero_grad()
        record["step"].append(take())
        record["losses"].append(float(_everyone(loss.detach()).mean()))
    with torch.no_grad():  # one more forward: the gathered parameters after the last update
        _llm_loss(model, _llm_batch(gen))
    record["gathered_identical"] = all(_same_everywhere(v) for v in used.values())
    if mesh.ndim == 2:  # HSDP: the sharded (fp32 master) parameters of the replicas of one shard
        from forge_lightning.strategies.comm.fp8_reduce_scatter import fsdp_units

        shards = torch.cat([fp._sharded_param_data for _, g in fsdp_units(model) for fp in g.fsdp_params])
        replicas = [torch.empty_like(shards) for _ in range(mesh.size(0))]
        dist.all_gather(replicas, shards, group=mesh.get_group(0))
        record["shards_identical_across_replicas"] = all(torch.equal(replicas[0], r) for r in replicas)
    record["shard_numels"] = _unit_shard_numels(model)
    return record


def llm_losses(rank: int, world: int, options: dict | None, steps: int = 5) -> list[float]:
    """Per-step mean loss (over ranks) of the tiny LLM under FSDP2 with bf16 params and fp32 master weights."""
    from torch.distributed.device_mesh import init_device_mesh

    return llm_run(rank, options, mesh=init_device_mesh("cpu", (world,)), steps=steps)["losses"]


def llm_reference_losses(world: int, steps: int = 5) -> list[float]:
    """The same steps on one process without FSDP, on the concatenated batches of the ``world`` ranks (fp32)."""
    model = _tiny_llm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gens = [torch.Generator().manual_seed(50 + rank) for rank in range(world)]
    losses = []
    for _ in range(steps):
        loss = _llm_loss(model, torch.cat([_llm_batch(gen) for gen in gens]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
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


# ----- HSDP (replicate x shard) -------------------------------------------------------------------------------------
HSDP_RUNS = {
    "exact": None,
    "bf16_rs": {"gradient_reduce": "bf16"},
    "fp8_rs": {"gradient_reduce": "fp8", "fp8_error_feedback": True},
    "delta_fp8": {"param_all_gather": "delta_fp8"},
    "zero2_delta_fp8_rs": {
        "param_all_gather": "delta_fp8",
        "delta_keep_unsharded": True,
        "gradient_reduce": "fp8",
    },
}


def hsdp_scaling_check(rank: int, mesh) -> dict:
    """Sharded gradients of the bf16 reduce-scatter (lossless for bf16 gradients) against FSDP2's exact HSDP
    reduction, for each divide-factor path of ``_get_gradient_divide_factors``: the default (AVG reduce-scatter
    in the shard group, AVG all-reduce across replicas), a factor equal to the shard size (AVG, then SUM), any
    other factor (PREMUL_SUM(1/f), then SUM) and forced SUM (SUM, SUM, then a division by the data-parallel size).

    gloo has no PREMUL_SUM, so the exact reference runs only the default; a factor ``f`` scales it by ``dp / f``.
    """
    from torch.distributed.fsdp import FSDPModule

    from forge_lightning.strategies.comm import enable_fp8_reduce_scatter

    dp = mesh.size()
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(60 + rank))
    grads = {}
    for mode in ("exact", "default", "factor_shard", "factor_3", "force_sum"):
        model = _linear_stack()
        _shard_linear_stack(model, mesh, reshard_after_forward=False)
        if mode != "exact":
            enable_fp8_reduce_scatter(model, dtype="bf16", error_feedback=False)
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            if mode.startswith("factor"):
                unit.set_gradient_divide_factor(float(mesh.size(1)) if mode == "factor_shard" else 3.0)
            unit.set_force_sum_reduction_for_comms(mode == "force_sum")
        model(x).float().square().mean().backward()
        grads[mode] = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    factors = {"default": dp, "factor_shard": mesh.size(1), "factor_3": 3.0, "force_sum": dp}
    return {
        mode: float((grads[mode] - grads["exact"] * dp / f).norm() / grads["exact"].norm())
        for mode, f in factors.items()
    }


def hsdp_check(rank: int, world: int, counter: ByteCounter) -> dict:
    """The tiny LLM in fp32 on a ``2 x world/2`` HSDP mesh with each compressed collective, the one-process
    reference (rank 0 only) and the reduce-scatter's scaling under HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {
        name: llm_run(rank, options, mesh=mesh, mp_policy=MixedPrecisionPolicy(), counter=counter)
        for name, options in HSDP_RUNS.items()
    }
    out["reference"] = llm_reference_losses(world) if rank == 0 else None
    out["scaling"] = hsdp_scaling_check(rank, mesh)
    return out


def main() -> None:
    rank, world, store_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    suite = sys.argv[5] if len(sys.argv) > 5 else "fsdp"
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    counter = ByteCounter()
    if suite == "hsdp":
        result = {"hsdp": hsdp_check(rank, world, counter)}
    else:
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
    exit_worker()


if __name__ == "__main__":
    main()
