"""Muon under megatron-core tensor parallelism: each matrix is gathered whole from its TP shards onto one owner rank,
orthogonalised there and scattered back; megatron's fused matrices are split into the matrices they stand for.

::

    TP rank 0: W[0]   ──┐                                     ┌──> TP rank 0: O[0]
    TP rank 1: W[1]   ──┼─ all_to_all ─> owner: W = [W[0]; W[1]]  ─ Newton-Schulz ─ O ─ all_to_all ─┼──> TP rank 1: O[1]

Every data-parallel replica does the same on its own copy (the state stays per rank, shaped like each parameter,
so megatron's dist-checkpointing saves it like Adam's). Parameters that are whole on every TP rank (norms aside:
a router, a replicated down projection) get an owner too, which computes for the group and sends the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from forge_lightning.optim.muon_exchange import assign_owners


def partition_dim(param: Tensor, group_size: int) -> int | None:
    """The dimension megatron split ``param`` along over a TP group of ``group_size`` ranks (``None``: whole on every
    rank), from megatron's ``tensor_model_parallel`` / ``partition_dim`` marks.

    A ``partition_stride`` above 1 (a gated fc1: each rank holds its gate rows, then its up rows) needs no care here:
    the shards are concatenated in rank order either way, and Newton-Schulz commutes with permuting rows or columns
    (``NS(P A) = P NS(A)``); only a split into parts must know the order (:class:`GatedSplit`).
    """
    if group_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim % param.ndim


class FusedQKVSplit:
    """megatron's fused ``linear_qkv`` weight ``[G * (h + 2) * D, H]`` (per query group: its ``h`` query heads, its
    key, its value, each head ``D`` rows) as the query, key and value matrices ``[G * h * D, H]``, ``[G * D, H]``,
    ``[G * D, H]`` (heads in order: Hugging Face's ``q_proj`` / ``k_proj`` / ``v_proj``).

    The group count is read off the rows, so a TP shard (whole groups) splits as its full matrix does; leading
    dimensions (a stack of matrices) are kept.

    Args:
        heads_per_group: query heads per key/value group (``num_attention_heads / num_query_groups``).
        head_dim: rows per head (megatron's ``kv_channels``).
    """

    def __init__(self, heads_per_group: int, head_dim: int) -> None:
        if heads_per_group < 1 or head_dim < 1:
            raise ValueError(
                f"heads_per_group ({heads_per_group}) and head_dim ({head_dim}) must be positive"
            )
        self.sizes = (heads_per_group * head_dim, head_dim, head_dim)

    def parts(self, full: Tensor) -> list[Tensor]:
        """``[q, k, v]`` of a fused ``[..., G * (h + 2) * D, H]`` matrix."""
        per_group = sum(self.sizes)
        rows = full.shape[-2]
        if rows % per_group:
            raise ValueError(
                f"a fused QKV matrix of {rows} rows is not whole query groups of {per_group} rows"
            )
        grouped = full.unflatten(-2, (rows // per_group, per_group))  # [..., G, (h + 2) * D, H]
        return [t.flatten(-3, -2) for t in grouped.split(self.sizes, dim=-2)]

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The fused matrix of ``[q, k, v]`` (inverse of :meth:`parts`)."""
        q, k, v = parts
        groups = k.shape[-2] // self.sizes[1]
        grouped = [t.unflatten(-2, (groups, n)) for t, n in zip((q, k, v), self.sizes, strict=True)]
        return torch.cat(grouped, dim=-2).flatten(-3, -2)  # [..., G * (h + 2) * D, H]


class GatedSplit:
    """A gated MLP's ``linear_fc1`` weight gathered over ``blocks`` TP ranks, ``[g_0; u_0; g_1; u_1; ...]`` (each
    rank holds its rows of the gate, then its rows of the up projection), as the whole gate and the whole up
    matrices ``[I, H]`` each (Hugging Face's ``gate_proj`` / ``up_proj``). ``blocks`` = 1: the two halves.

    Args:
        blocks: the TP ranks fc1 was split over (the expert TP size for routed experts).
    """

    def __init__(self, blocks: int) -> None:
        if blocks < 1:
            raise ValueError(f"blocks ({blocks}) must be positive")
        self.blocks = blocks

    def parts(self, full: Tensor) -> list[Tensor]:
        """``[gate, up]`` of a gathered ``[..., 2 * I, H]`` fc1 matrix."""
        rows = full.shape[-2]
        if rows % (2 * self.blocks):
            raise ValueError(
                f"a gated fc1 matrix of {rows} rows does not split into {self.blocks} [gate; up] blocks"
            )
        blocks = full.unflatten(-2, (self.blocks, 2, rows // (2 * self.blocks)))  # [..., T, 2, I / T, H]
        return [blocks.select(-3, half).flatten(-3, -2) for half in (0, 1)]

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The gathered fc1 matrix of ``[gate, up]`` (inverse of :meth:`parts`)."""
        gate, up = (t.unflatten(-2, (self.blocks, t.shape[-2] // self.blocks)) for t in parts)
        return torch.stack([gate, up], dim=-3).flatten(-4, -2)  # [..., 2 * I, H]


class TensorParallelExchange:
    """The :class:`~forge_lightning.optim.muon_exchange.MatrixExchange` of megatron's tensor parallelism.

    A TP-sharded parameter's owner receives every rank's shard and concatenates them along the parameter's
    ``partition_dim`` (the TP rank order is the shard order); its result goes back cut the same way. A parameter
    whole on every rank is computed by its owner only and sent whole. Owners balance the costs over the group.
    Each direction is one ``all_to_all``: every rank's tensors for one destination travel packed in one buffer, the
    updates in their own dtype (Muon's Newton-Schulz dtype), the results in the parameters' (megatron's optimizer
    steps fp32 main parameters).

    Args:
        params: the parameters (this rank's shards), index ``i`` everywhere; one dtype.
        costs: each parameter's Newton-Schulz cost (the same on every rank of the group).
        group: the TP group (the expert TP group for routed experts); ``None``: the default group.
    """

    replicated = False

    def __init__(
        self, params: Sequence[Tensor], costs: Sequence[float], group: dist.ProcessGroup | None = None
    ) -> None:
        if len(params) != len(costs):
            raise ValueError(f"{len(params)} parameters but {len(costs)} costs: give one cost per parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"the parameters of one tensor-parallel exchange must share a dtype, got {sorted(map(str, dtypes))}"
            )
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.owners = assign_owners(costs, self.size)
        self._dims = [partition_dim(p, self.size) for p in params]
        self._shapes = [tuple(p.shape) for p in params]
        self._dtype = dtypes.pop() if dtypes else torch.float32
        self._device = params[0].device if params else torch.device("cpu")

    def is_owner(self, index: int) -> bool:
        """Whether this rank orthogonalises parameter ``index``."""
        return self.owners[index] == self.rank

    def gather(self, local: Sequence[Tensor | None]) -> dict[int, Tensor]:
        """The full matrices of the parameters this rank owns, from every TP rank's shard ``local[i]`` (one dtype,
        in which they travel: Muon casts to its Newton-Schulz dtype first)."""
        self._check(local)
        dtype = local[0].dtype if local else self._dtype
        sharded = [i for i, d in enumerate(self._dims) if d is not None]
        mine = [i for i in sharded if self.is_owner(i)]
        sends = [[local[i] for i in sharded if self.owners[i] == dest] for dest in range(self.size)]
        recv = [[] if src == self.rank else mine for src in range(self.size)]
        received = self._all_to_all(sends, recv, dtype)
        full = {i: local[i] for i, d in enumerate(self._dims) if d is None and self.is_owner(i)}
        for k, i in enumerate(mine):
            shards = [local[i] if src == self.rank else received[src][k] for src in range(self.size)]
            full[i] = torch.cat(shards, dim=self._dims[i])
        return full

    def publish(self, results: Mapping[int, Tensor]) -> list[Tensor]:
        """Every parameter's result as this rank's part (its local shape, in the parameters' dtype), from the
        owners' full ``results``."""
        count = len(self.owners)
        owned = [i for i in range(count) if self.is_owner(i)]
        missing = [i for i in owned if i not in results]
        if missing:
            raise ValueError(f"publish lacks the results of parameters {missing}, which this rank owns")
        pieces = {i: self._cut(i, results[i].to(self._dtype)) for i in owned}
        sends = [[pieces[i][dest] for i in owned] for dest in range(self.size)]
        recv = [
            [] if src == self.rank else [i for i in range(count) if self.owners[i] == src]
            for src in range(self.size)
        ]
        received = self._all_to_all(sends, recv, self._dtype)
        out: list[Tensor] = [None] * count  # type: ignore[list-item]  # every index is filled below
        for i in owned:
            out[i] = pieces[i][self.rank]
        for src, indices in enumerate(recv):
            for k, i in enumerate(indices):
                out[i] = received[src][k]
        return out

    def _check(self, local: Sequence[Tensor | None]) -> None:
        if len(local) != len(self._shapes):
            raise ValueError(
                f"gather got {len(local)} tensors for an exchange of {len(self._shapes)} parameters"
            )
        for i, t in enumerate(local):
            if t is None or tuple(t.shape) != self._shapes[i]:
                got = None if t is None else tuple(t.shape)
                raise ValueError(
                    f"gather: tensor {i} has shape {got}; its parameter's local shape is {self._shapes[i]}"
                )

    def _cut(self, index: int, full: Tensor) -> list[Tensor]:
        """``full`` as the part of each rank of the group (the whole tensor for a parameter whole on every rank)."""
        dim = self._dims[index]
        if dim is None:
            return [full] * self.size
        return list(full.chunk(self.size, dim=dim))

    def _all_to_all(
        self, sends: list[list[Tensor]], recv: list[list[int]], dtype: torch.dtype
    ) -> list[list[Tensor]]:
        """Send ``sends[dest]`` to every other rank; receive from each rank ``src`` the local-shaped tensors of the
        parameters ``recv[src]``, in order (nothing travels to or from this rank itself), all in ``dtype``."""
        if self.size == 1:
            return [[]]
        sends = [[] if dest == self.rank else ts for dest, ts in enumerate(sends)]
        flat_in = [t.reshape(-1).to(dtype) for ts in sends for t in ts]
        in_sizes = [sum(t.numel() for t in ts) for ts in sends]
        out_sizes = [sum(_numel(self._shapes[i]) for i in indices) for indices in recv]
        device = flat_in[0].device if flat_in else self._device
        out = torch.empty(sum(out_sizes), dtype=dtype, device=device)
        packed = torch.cat(flat_in) if flat_in else torch.empty(0, dtype=dtype, device=device)
        dist.all_to_all_single(out, packed, out_sizes, in_sizes, group=self.group)
        received = []
        for indices, chunk in zip(recv, out.split(out_sizes), strict=True):
            sizes = [_numel(self._shapes[i]) for i in indices]
            received.append(
                [t.view(self._shapes[i]) for i, t in zip(indices, chunk.split(sizes), strict=True)]
            )
        return received


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ----- the optimizer over megatron's chunks -------------------------------------------------------------------------


def _full_shape(param: Tensor, group_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    dim = partition_dim(param, group_size)
    if dim is not None:
        shape[dim] *= group_size
    return tuple(shape)


def matrix_split(name: str, config: Any, blocks: int) -> Any | None:
    """The split of megatron parameter ``name`` into the matrices it fuses (``None``: orthogonalised whole).

    Args:
        name: the parameter's name in its chunk.
        config: the chunk's ``TransformerConfig``.
        blocks: the TP ranks the parameter is split over (those of the expert TP group for experts apart).
    """
    from forge_lightning.optim.muon import SplitRows

    if name.endswith("self_attention.linear_qkv.weight"):
        groups = config.num_query_groups or config.num_attention_heads
        return FusedQKVSplit(config.num_attention_heads // groups, config.kv_channels)
    if name.endswith("linear_fc1.weight") and config.gated_linear_unit:
        return GatedSplit(blocks)
    if name.endswith("self_attention.linear_kv_down_proj.weight"):
        # MLA: [key/value latent; shared rotary key]
        return SplitRows((config.kv_lora_rank, config.qk_pos_emb_head_dim))
    return None


def _groups(choices: Sequence[Any], config: Any, tables: set[int], *, expert: bool) -> list[dict[str, Any]]:
    """The Muon group and AdamW's decay / no-decay groups of ``choices`` (all three, empty or not, so that every
    rank has the same groups), with the keys megatron's checkpoint loading matches groups by. AdamW's decay rule is
    megatron's plain path's: not the embedding ``tables``, megatron's tied-embedding copy, norms or biases."""
    decay_all = config.decay_norms_biases_embeddings

    def decayed(c: Any) -> bool:
        shared = getattr(c.param, "shared_embedding", False)
        return decay_all or (c.param.ndim >= 2 and id(c.param) not in tables and not shared)

    members = {
        "muon": [c for c in choices if c.use_muon],
        "decay": [c for c in choices if not c.use_muon and decayed(c)],
        "no_decay": [c for c in choices if not c.use_muon and not decayed(c)],
    }
    settings = {
        "muon": (config.muon_lr, config.muon_weight_decay),
        "decay": (config.lr, config.weight_decay),
        "no_decay": (config.lr, 0.0),
    }
    groups = []
    for kind, chosen in members.items():
        lr, weight_decay = settings[kind]
        groups.append(
            {
                "params": [c.param for c in chosen],
                "param_names": [c.name for c in chosen],
                "use_muon": kind == "muon",
                "lr": lr,
                "weight_decay": weight_decay,
                "name": f"{'experts/' if expert else ''}{kind}",
                # megatron's checkpoint load matches groups by these keys (param_group_identifier_keys); the Muon
                # group has its own learning rate (optimizer.muon.lr), hence is_decoupled_lr, which keeps it
                # apart from AdamW's decayed group. Our scheduler sets the rates; megatron's would read them.
                "wd_mult": 0.0 if kind == "no_decay" else 1.0,
                "lr_mult": 1.0,
                "is_expert_parallel": expert,
                "is_decoupled_lr": kind == "muon",
                "max_lr": lr,
                "min_lr": 0.0,
                "default_config": kind != "muon",
            }
        )
    return groups


def _init_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """megatron's ``init_state_fn``: the zero state a fresh optimizer lacks before it loads a checkpoint."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state[param]:
                continue
            if group["use_muon"]:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
            else:
                optimizer.state[param].update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(param),
                    exp_avg_sq=torch.zeros_like(param),
                )


def build_muon_optimizer(chunks: Sequence[nn.Module], config: Any, megatron_config: Any) -> Any:
    """Our :class:`~forge_lightning.optim.muon.Muon` inside megatron's plain optimizer wrappers, chained as
    megatron chains its Adam: one part for the parameters whose gradients megatron reduces over the data-parallel
    group (exchanged over the TP group), one for the routed experts it reduces over the expert-data-parallel group
    (EP > 1 or ETP != TP; exchanged over the expert TP group), when any rank has them.

    megatron's gradient reduction, clipping (the norm over each part's model-parallel group), loss scaling,
    bf16 main weights (``Float16OptimizerWithFloat16Params``; ``FP32Optimizer`` in fp32) and
    ``sharded_state_dict`` work as for its Adam. Which parameters Muon takes is the native rule
    (:func:`~forge_lightning.optim.muon_groups.choose_params` on megatron's names: the default
    ``optimizer.muon.adamw_params`` send ``*word_embeddings*`` and ``*output_layer*`` to AdamW); with
    ``optimizer.muon.split_fused`` the fused ``linear_qkv`` (q, k, v), gated ``linear_fc1`` (gate, up) and MLA's
    ``linear_kv_down_proj`` are orthogonalised part by part, as the unfused Hugging Face matrices would be.

    Args:
        chunks: the DDP-wrapped model chunks (and a composed model's encoder side).
        config: the module's optimizer settings (``name: muon``).
        megatron_config: megatron's ``OptimizerConfig`` (its ``bf16``, ``clip_grad``; not distributed).
    """
    from megatron.core import parallel_state
    from megatron.core.optimizer import ChainedOptimizer

    from forge_lightning.optim.muon_groups import choose_params
    from forge_lightning.strategies.megatron.optimizer import embedding_tables

    inner = [getattr(chunk, "module", chunk) for chunk in chunks]
    prefixes = [""] if len(inner) == 1 else [f"chunk{i}." for i in range(len(inner))]
    choices = choose_params(
        list(zip(prefixes, inner, strict=True)), config.muon, config.decay_norms_biases_embeddings
    )
    apart = [c for c in choices if not getattr(c.param, "allreduce", True)]
    # Every rank builds the same parts (a pipeline stage without experts too): their gradient norms are collective.
    device = next((p.device for chunk in inner for p in chunk.parameters()), torch.device("cpu"))
    any_apart = torch.tensor([float(bool(apart))], device=device)
    dist.all_reduce(any_apart, op=dist.ReduceOp.MAX)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    specs = [([c for c in choices if getattr(c.param, "allreduce", True)], False, tp_group)]
    if any_apart.item():
        specs.append((apart, True, parallel_state.get_expert_tensor_parallel_group()))
    tables = embedding_tables(inner)
    parts = [
        _part(members, config, megatron_config, tables, apart=is_apart, group=group, chunk=chunks[0])
        for members, is_apart, group in specs
    ]
    for part in parts:
        part.tp_group = tp_group
    return ChainedOptimizer(parts)


def _part(
    members: Sequence[Any],
    config: Any,
    megatron_config: Any,
    tables: set[int],
    *,
    apart: bool,
    group: dist.ProcessGroup,
    chunk: nn.Module,
) -> Any:
    """One megatron optimizer of the chain: Muon over ``members`` (``ParamChoice`` s), wrapped, its matrices'
    full shapes and splits set and its exchange over ``group``."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    from forge_lightning.optim import optimizer_for_groups
    from forge_lightning.optim.muon import SplitRows
    from forge_lightning.strategies.megatron.wrapping import chunk_config

    muon = optimizer_for_groups(_groups(members, config, tables, expert=apart), config)
    if megatron_config.bf16:
        wrapped = Float16OptimizerWithFloat16Params(muon, megatron_config, None, _init_state)
    else:
        wrapped = FP32Optimizer(muon, megatron_config, _init_state)
    wrapped.grad_stats_parallel_group = (
        parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        if apart
        else parallel_state.get_model_parallel_group()
    )
    size, tf_config = dist.get_world_size(group), chunk_config(chunk)
    for c in members:
        if not c.use_muon:
            continue
        main = getattr(c.param, "main_param", c.param)  # the fp32 copy the bf16 wrapper steps
        muon.set_matrix_shape(main, _full_shape(c.param, size))
        if c.parts is not None:  # declared by a plain module (a composed model's encoder side)
            split = SplitRows(c.parts)
        else:
            split = matrix_split(c.name, tf_config, size) if config.muon.split_fused else None
        if split is not None:
            muon.set_matrix_split(main, split)
    muon.set_exchange_builder(_tensor_parallel_builder(group))
    return wrapped


def _tensor_parallel_builder(group: dist.ProcessGroup) -> Callable[[Sequence[Tensor], Sequence[float]], Any]:
    def build(params: Sequence[Tensor], costs: Sequence[float]) -> TensorParallelExchange:
        return TensorParallelExchange(params, costs, group)

    return build
