"""Muon for hidden matrices and AdamW for everything else, in one tensor-wise distributed optimizer.

A Muon step (``torch.optim.Muon``'s update, https://kellerjordan.github.io/posts/muon/)::

    every rank                         owner of matrix i                     every rank
    buf <- lerp(buf, g, 1 - mu)  ->    full_i = gather(u_i)           ->     out_i = publish(results)_i
    u = lerp(g, buf, mu) | buf         split, Newton-Schulz (batched         p <- p (1 - lr wd) - lr_adj out_i
                                       over same-shape parts), join

The exchange (``muon_exchange``) decides who owns each matrix and how its full update reaches the owner: under
DDP / ZeRO-1 every rank holds every matrix (only owners keep momentum and compute), under FSDP2 each rank holds a
shard (every rank keeps the momentum of its shard). Parameters outside Muon groups (embeddings, the output head,
norms, biases) get torch's AdamW update; with ``shard_adamw_state`` their state lives on one owner each under a
replicated exchange, and owners publish the new values.

A parameter without a gradient on this rank is skipped: no momentum update, no decay, no step. Its matrix still
takes part in the exchange (as zeros) so that every rank makes the same collective calls; under DDP / FSDP2 a
parameter lacks its gradient on every rank at once, so the skip is the same everywhere.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from forge_lightning.optim.muon_exchange import (
    LocalExchange,
    MatrixExchange,
    ReplicatedExchange,
    newton_schulz_flops,
)
from forge_lightning.optim.newton_schulz import (
    ADJUST_LR_FNS,
    adjusted_lr,
    check_newton_schulz_args,
    newton_schulz,
)

ExchangeBuilder = Callable[[Sequence[Tensor], Sequence[float]], MatrixExchange]


class MatrixSplit(Protocol):
    """How a parameter's full matrix (or ``[E, m, n]`` stack) is cut into parts orthogonalised separately (e.g. a
    fused gate-up projection into its gate and up halves)."""

    def parts(self, full: Tensor) -> list[Tensor]:
        """The parts of ``full``, each ``[..., m_k, n_k]``."""
        ...

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The full tensor from its parts: the inverse of :meth:`parts`."""
        ...


class SplitRows:
    """Cuts dim -2 into consecutive row blocks of ``sizes`` (HF MoE ``gate_up_proj [E, 2I, D]`` -> ``[I, I]``)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
            raise ValueError(f"SplitRows sizes ({list(sizes)}) must be positive integers, one per row block")
        self.sizes = tuple(sizes)

    def parts(self, full: Tensor) -> list[Tensor]:
        """The row blocks of ``full``."""
        if full.ndim < 2 or full.shape[-2] != sum(self.sizes):
            raise ValueError(
                f"SplitRows{self.sizes} cuts {sum(self.sizes)} rows, but the matrix is {tuple(full.shape)}"
            )
        return list(full.split(self.sizes, dim=-2))

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The row blocks stacked back along dim -2."""
        return torch.cat(list(parts), dim=-2)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _default_exchange_builder(params: Sequence[Tensor], costs: Sequence[float]) -> MatrixExchange:
    try:
        sharded = importlib.import_module("forge_lightning.optim.muon_sharded")
    except ModuleNotFoundError as err:
        if err.name != "forge_lightning.optim.muon_sharded":
            raise
    else:
        return sharded.default_exchange(params, costs)
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "Muon got DTensor parameters but no sharded exchange (forge_lightning.optim.muon_sharded) is installed; "
            "pass one with Muon.set_exchange_builder"
        )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ReplicatedExchange(params, costs)
    return LocalExchange(len(params))


def _scalar_dtype() -> torch.dtype:
    # torch's AdamW keeps "step" as a CPU scalar of this dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Muon(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``'s update) on the matrices of Muon groups, torch's AdamW on the rest.

    Param groups are dicts: ``params``, ``use_muon`` (required), optionally ``param_names`` (one per param, for
    messages), ``name``, ``lr``, ``weight_decay``; AdamW groups (``use_muon: False``) may carry ``betas`` and
    ``eps`` (the AdamW epsilon; it defaults to ``adam_eps``). Every param of a Muon group must have ``ndim >= 2``:
    a 2-D param is one matrix, a 3-D one a stack of matrices (MoE experts ``[E, m, n]``), orthogonalised per matrix.

    Args:
        params: the param groups.
        lr: learning rate (Muon groups: before the shape adjustment).
        weight_decay: decoupled weight decay (``p <- p (1 - lr wd)``).
        momentum: Muon's momentum.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients: the quintic Newton-Schulz coefficients ``(a, b, c)``.
        eps: the lower bound of the norm Newton-Schulz divides by.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None`` / ``"original"`` (``sqrt(max(1, rows / cols))``) or ``"match_rms_adamw"``
            (``0.2 sqrt(max(rows, cols))``), from each part's shape.
        ns_dtype: the dtype Newton-Schulz runs in (and full updates travel in).
        betas: AdamW's ``(beta1, beta2)`` for groups without their own.
        adam_eps: AdamW's epsilon for groups without their own ``eps``.
        shard_adamw_state: under a replicated exchange (DDP), keep each AdamW param's state on one owner rank,
            which computes its update and publishes the new values.
    """

    def __init__(
        self,
        params: Iterable[dict],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        shard_adamw_state: bool = False,
    ) -> None:
        if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
            raise ValueError(
                f"ns_dtype ({ns_dtype}) must be a floating-point torch dtype, e.g. torch.bfloat16"
            )
        _check_betas(betas, "betas")
        if not adam_eps >= 0:
            raise ValueError(f"adam_eps ({adam_eps}) must be >= 0; AdamW's usual value is 1e-8")
        # Kept out of param_groups (and so out of state_dict): checkpoints load with weights_only.
        self._ns_dtype = ns_dtype
        self._betas = tuple(betas)
        self._adam_eps = adam_eps
        self._shard_adamw_state = shard_adamw_state
        self._splits: dict[Tensor, MatrixSplit] = {}
        self._full_shapes: dict[Tensor, torch.Size] = {}
        self._lr_shapes: dict[Tensor, tuple[int, int]] = {}
        self._builder: ExchangeBuilder | None = None
        self._built = False
        self._muon: list[tuple[Tensor, dict]] = []
        self._adamw: list[tuple[Tensor, dict]] = []
        self._muon_exchange: MatrixExchange = LocalExchange(0)
        self._adamw_exchange: MatrixExchange | None = None
        self._consolidated: dict[int, dict[str, Any]] = {}
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a Muon (``use_muon: True``) or AdamW (``use_muon: False``) group, before the first step."""
        self._check_not_built("add_param_group")
        if not isinstance(param_group, dict) or not isinstance(param_group.get("use_muon"), bool):
            raise ValueError(
                "every Muon param group is a dict with 'use_muon': True (hidden matrices) or False (AdamW: "
                "embeddings, head, norms, biases)"
            )
        group = dict(param_group)
        if not group["use_muon"]:
            group.setdefault("betas", self._betas)
            group.setdefault("eps", self._adam_eps)
        super().add_param_group(group)
        _check_group(self.param_groups[-1])

    def set_matrix_split(self, param: Tensor, split: MatrixSplit) -> None:
        """Orthogonalise ``param``'s full matrix as the parts ``split`` cuts it into (each with its own lr
        adjustment). Call it on every rank, before the first step."""
        self._check_not_built("set_matrix_split")
        group = self._group_of(param)
        if not group["use_muon"]:
            raise ValueError(
                f"{_name(group, param)} is in an AdamW group: only Muon params take a matrix split"
            )
        probe = torch.empty(self._full_shape(param), device="meta")
        parts = split.parts(probe)
        if not parts or any(p.ndim < 2 for p in parts) or split.join(parts).shape != probe.shape:
            raise ValueError(
                f"the split of {_name(group, param)} must cut its {tuple(probe.shape)} matrix into parts of "
                "ndim >= 2 that join back to it"
            )
        self._splits[param] = split

    def set_matrix_shape(self, param: Tensor, shape: Sequence[int]) -> None:
        """The whole matrix's shape of a param that holds a plain slice of it (Megatron's tensor parallelism),
        which the lr adjustment and the split use. DTensors and whole tensors need no call. Call it on every rank,
        before the first step."""
        self._check_not_built("set_matrix_shape")
        group = self._group_of(param)
        if len(shape) != param.ndim:
            raise ValueError(
                f"the full shape {tuple(shape)} of {_name(group, param)} must have {param.ndim} dims"
            )
        self._full_shapes[param] = torch.Size(shape)

    def set_shard_adamw_state(self, enabled: bool) -> None:
        """Keep each AdamW param's state on one owner rank under a replicated exchange (ZeRO-1), which computes its
        update and publishes the new values. Call it on every rank, before the first step."""
        self._check_not_built("set_shard_adamw_state")
        self._shard_adamw_state = enabled

    def set_exchange_builder(self, builder: ExchangeBuilder) -> None:
        """How the exchanges are made: ``builder(params, costs)``, called at the first step for the Muon params
        (costs: Newton-Schulz FLOPs) and, with ``shard_adamw_state``, for the AdamW params (costs: numel)."""
        self._check_not_built("set_exchange_builder")
        self._builder = builder

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon + AdamW step; ``closure`` (re-evaluating the loss) runs first, with gradients enabled."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._built:
            self._build()
        self._refresh()
        self._muon_step()
        self._adamw_step()
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Bring the state that only owners keep (replicated exchanges) to rank ``to`` of the exchange's group,
        whose next :meth:`state_dict` is then the full, one-process state dict. Call it on every rank."""
        self._consolidated = {}
        if not self._built:
            return  # no exchange yet: every rank holds all of its state
        self._refresh()
        index = {p: k for k, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for exchange, params in ((self._muon_exchange, self._muon), (self._adamw_exchange, self._adamw)):
            if exchange is None or not exchange.replicated or isinstance(exchange, LocalExchange):
                continue
            if not isinstance(exchange, ReplicatedExchange):
                raise ValueError(
                    f"consolidate_state_dict gathers over a ReplicatedExchange's group; {type(exchange).__name__} "
                    "is replicated but has no group: save its state with its own checkpointing"
                )
            mine = {
                index[p]: {
                    k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in self.state[p].items()
                }
                for i, (p, _) in enumerate(params)
                if exchange.is_owner(i) and exchange.owners[i] != to and p in self.state
            }
            gathered = [None] * dist.get_world_size(exchange.group) if exchange.rank == to else None
            dist.gather_object(mine, gathered, group=exchange.group, group_dst=to)
            if gathered is not None:
                for states in gathered:
                    self._consolidated.update(states)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict; after :meth:`consolidate_state_dict`, on its rank ``to``, with every
        owner's state."""
        sd = super().state_dict()
        if self._consolidated:
            sd["state"] = dict(sorted({**sd["state"], **self._consolidated}.items()))
            self._consolidated = {}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (a full one on any rank, at any world size): state this rank does not own is dropped
        when the exchanges are built."""
        saved = state_dict.get("param_groups", [])
        if any("use_muon" not in g for g in saved):
            raise ValueError(
                "the optimizer state to load is not Muon's (its parameter groups have no 'use_muon'): it was saved "
                "by another optimizer (e.g. AdamW); resume with that optimizer.name, or start Muon from the "
                "weights only (load them as pretrained weights instead of --ckpt_path)"
            )
        super().load_state_dict(state_dict)
        if self._built:
            self._refresh()
            self._prune()

    def _check_not_built(self, what: str) -> None:
        if self._built:
            raise ValueError(f"Muon builds its exchanges at the first step: call {what} before it")

    def _group_of(self, param: Tensor) -> dict:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ValueError("the tensor is not a parameter of this optimizer: pass one of its params")

    def _full_shape(self, param: Tensor) -> torch.Size:
        return self._full_shapes.get(param, param.shape)

    def _part_shapes(self, param: Tensor) -> list[torch.Size]:
        probe = torch.empty(self._full_shape(param), device="meta")
        split = self._splits.get(param)
        return [t.shape for t in split.parts(probe)] if split is not None else [probe.shape]

    def _refresh(self) -> None:
        # The groups themselves, each step: load_state_dict replaces the group dicts, schedulers edit their lr.
        self._muon = [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"]]
        self._adamw = [(p, g) for g in self.param_groups if not g["use_muon"] for p in g["params"]]

    def _build(self) -> None:
        self._refresh()
        # The matrix the lr adjustment reads: the first part's (other parts are rescaled to it in _join).
        self._lr_shapes = {p: tuple(self._part_shapes(p)[0][-2:]) for p, _ in self._muon}
        builder = self._builder or _default_exchange_builder
        if self._muon:
            costs = [
                sum(newton_schulz_flops(s, g["ns_steps"]) for s in self._part_shapes(p))
                for p, g in self._muon
            ]
            self._muon_exchange = builder([p for p, _ in self._muon], costs)
        if self._shard_adamw_state and self._adamw:
            exchange = builder([p for p, _ in self._adamw], [float(p.numel()) for p, _ in self._adamw])
            if not exchange.replicated:
                raise ValueError(
                    "shard_adamw_state needs replicated params (DDP, ZeRO-1); sharded params (FSDP2) already shard "
                    "AdamW's state: set shard_adamw_state to false"
                )
            self._adamw_exchange = exchange
        self._built = True
        self._prune()

    def _prune(self) -> None:
        for exchange, params in ((self._muon_exchange, self._muon), (self._adamw_exchange, self._adamw)):
            if exchange is not None and exchange.replicated:
                for i, (p, _) in enumerate(params):
                    if not exchange.is_owner(i):
                        self.state.pop(p, None)

    def _muon_step(self) -> None:
        exchange = self._muon_exchange
        local: list[Tensor | None] = []
        for i, (p, group) in enumerate(self._muon):
            if exchange.replicated and not exchange.is_owner(i):
                local.append(None)
            elif p.grad is None:
                local.append(torch.zeros(_local(p).shape, dtype=self._ns_dtype, device=_local(p).device))
            else:
                # Newton-Schulz casts first: casting before the exchange halves what travels, same numbers.
                local.append(self._momentum_update(p, group).to(self._ns_dtype))
        results = self._orthogonalize(exchange.gather(local))
        outs = exchange.publish(results)
        for i, (p, group) in enumerate(self._muon):
            if p.grad is None:
                continue
            p_local = _local(p)
            p_local.mul_(1 - group["lr"] * group["weight_decay"])
            rows, cols = self._lr_shapes[p]
            p_local.add_(outs[i], alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], rows, cols))

    def _momentum_update(self, p: Tensor, group: dict) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _orthogonalize(self, full: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """Each owned full update's Newton-Schulz result, contiguous, in its param's dtype; parts of one shape (and the same
        iteration settings) run as one batched call."""
        parts: dict[int, list[Tensor]] = {}
        batches: dict[tuple, list[tuple[int, int]]] = {}
        for i, x in full.items():
            p, group = self._muon[i]
            if x.shape != self._full_shape(p):
                raise ValueError(
                    f"the exchange gave {_name(group, p)} as {tuple(x.shape)}, not its full shape "
                    f"{tuple(self._full_shape(p))}: for a param holding a plain slice of its matrix (tensor "
                    "parallelism), call Muon.set_matrix_shape with the whole matrix's shape"
                )
            split = self._splits.get(p)
            parts[i] = split.parts(x) if split is not None else [x]
            for k, part in enumerate(parts[i]):
                key = (*part.shape[-2:], group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"])
                batches.setdefault(key, []).append((i, k))
        for (_, _, steps, coefficients, eps), members in batches.items():
            inputs = [parts[i][k] for i, k in members]
            if len(inputs) == 1:
                outputs = [newton_schulz(inputs[0], steps, coefficients, eps, self._ns_dtype)]
            else:
                # [sum of stack sizes, m, n]: one batched iteration over every matrix of this shape.
                stacked = torch.cat([t.reshape(-1, *t.shape[-2:]) for t in inputs])
                done = newton_schulz(stacked, steps, coefficients, eps, self._ns_dtype)
                sizes = [math.prod(t.shape[:-2]) for t in inputs]
                outputs = [o.reshape(t.shape) for o, t in zip(done.split(sizes), inputs, strict=True)]
            for (i, k), out in zip(members, outputs, strict=True):
                parts[i][k] = out
        return {i: self._join(i, done_parts) for i, done_parts in parts.items()}

    def _join(self, i: int, done: list[Tensor]) -> Tensor:
        p, group = self._muon[i]
        done = [t.to(p.dtype) for t in done]
        shapes = [t.shape[-2:] for t in done]
        if any(s != shapes[0] for s in shapes):
            # Parts of other shapes get their own lr adjustment, relative to the first part's (which step applies).
            fn = group["adjust_lr_fn"]
            ref = adjusted_lr(1.0, fn, *shapes[0])
            done = [t * (adjusted_lr(1.0, fn, *s) / ref) for t, s in zip(done, shapes, strict=True)]
        split = self._splits.get(p)
        joined = split.join(done) if split is not None else done[0]
        return joined.contiguous()  # a tall matrix comes back transposed; exchanges may send raw storage

    def _adamw_step(self) -> None:
        exchange = self._adamw_exchange
        updated: dict[int, list[Tensor]] = {}  # id(group) -> the params this rank steps
        groups: dict[int, dict] = {}
        for i, (p, group) in enumerate(self._adamw):
            if p.grad is not None and (exchange is None or exchange.is_owner(i)):
                updated.setdefault(id(group), []).append(p)
                groups[id(group)] = group
        for key, params in updated.items():
            self._adamw_update(params, groups[key])
        if exchange is not None:
            results = {i: p.detach() for i, (p, _) in enumerate(self._adamw) if exchange.is_owner(i)}
            outs = exchange.publish(results)
            for i, (p, _) in enumerate(self._adamw):
                if not exchange.is_owner(i):
                    p.copy_(outs[i])

    def _adamw_update(self, params: list[Tensor], group: dict) -> None:
        """torch.optim.AdamW's update (decoupled decay) of one group's params on their local tensors, with foreach
        ops per device and dtype (torch's default on accelerators; on CPU the same numbers as its per-tensor
        loop)."""
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            local = _local(p)
            buckets.setdefault((local.device, local.dtype), []).append(p)
        for bucket in buckets.values():
            states = [self.state[p] for p in bucket]
            param = [_local(p) for p in bucket]
            grad = [_local(p.grad) for p in bucket]
            exp_avg = [_local(s["exp_avg"]) for s in states]
            exp_avg_sq = [_local(s["exp_avg_sq"]) for s in states]
            steps = [s["step"].item() for s in states]
            if weight_decay != 0:
                torch._foreach_mul_(param, 1 - lr * weight_decay)
            torch._foreach_lerp_(exp_avg, grad, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grad, grad, 1 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, [(1 - beta2**step) ** 0.5 for step in steps])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(param, exp_avg, denom, [-(lr / (1 - beta1**step)) for step in steps])


def _name(group: dict, param: Tensor) -> str:
    names = group.get("param_names")
    if names is not None:
        for name, p in zip(names, group["params"], strict=True):
            if p is param:
                return f"param {name!r}"
    where = f" of group {group['name']!r}" if "name" in group else ""
    return f"a param of shape {tuple(param.shape)}{where}"


def _check_betas(betas: Sequence[float], field: str) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{field} ({tuple(betas)}) must be two numbers in [0, 1), e.g. (0.9, 0.95)")


def _check_group(group: dict) -> None:
    where = f"param group {group['name']!r}" if "name" in group else "a param group"
    names = group.get("param_names")
    if names is not None and len(names) != len(group["params"]):
        raise ValueError(
            f"{where} has {len(names)} param_names for {len(group['params'])} params: give one each"
        )
    if not group["lr"] >= 0:
        raise ValueError(f"lr ({group['lr']}) of {where} must be >= 0")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"weight_decay ({group['weight_decay']}) of {where} must be >= 0")
    if not group["use_muon"]:
        _check_betas(group["betas"], f"betas of {where}")
        if not group["eps"] >= 0:
            raise ValueError(f"eps ({group['eps']}) of AdamW {where} must be >= 0, e.g. 1e-8")
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(
            f"momentum ({group['momentum']}) of {where} must be in [0, 1); Muon's default is 0.95"
        )
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"adjust_lr_fn ({group['adjust_lr_fn']!r}) of {where} must be None, 'original' or 'match_rms_adamw'"
        )
    check_newton_schulz_args(group["ns_steps"], group["ns_coefficients"], group["eps"])
    for p in group["params"]:
        if p.ndim < 2:
            raise ValueError(
                f"{_name(group, p)} has {p.ndim} dim(s): Muon orthogonalises matrices (ndim >= 2); "
                "put it in an AdamW group (use_muon: False)"
            )
