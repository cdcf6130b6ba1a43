"""Hot-expert replication: where each expert of one MoE layer lives under expert parallelism (EP).

Plain EP puts expert ``e`` on rank ``e // (E / ep_size)``; skewed routing then makes the ranks holding hot experts
stragglers. Each rank has ``slots_per_rank`` expert slots, ``E / ep_size`` of them for its own (primary) experts
and the rest spare. :func:`plan_replicas` fills spare slots with replicas of hot experts and splits each expert's
tokens among its holders, so as to minimise the most loaded rank with a cost for communication::

    loads [E] (recent tokens per expert) ──▶ plan_replicas ──▶ Placement
                                                                 holders[e] = (primary rank, replica ranks...)
                                                                 shares[e]  = fraction of e's tokens per holder

Communication is priced per token moved between ranks, ``0`` on the same rank, ``1`` inside a node and
``cross_node_cost`` between nodes; tokens originate uniformly over the ranks unless per-rank source loads are
given. A replica also costs ``replica_sync_tokens`` (in token-equivalents, priced by the link between it and the
primary) per step for the gradient sum that keeps it equal to its primary. The planner is greedy: it repeatedly
relieves the most loaded rank with the replica (an expert on that rank, a destination with a free slot) of the
highest net gain (how far the ranks it touches fall below the current maximum, less ``comm_weight / ep_size``
times the communication it adds), re-balancing the expert's shares over its holders by water-filling. It never
raises the most loaded rank above plain EP's, and with equal loads the communication term keeps replicas on their
primary's node. :func:`greedy_replicas` (hottest experts into the least loaded ranks, even shares, no topology)
and :func:`plain_placement` are the baselines the simulator compares against.

Every function is deterministic (ties go to the lowest expert / rank index).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Where one MoE layer's experts live and how their tokens are split.

    Args:
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks sharing a node (``ep_size`` must be a multiple of it, or smaller).
        slots_per_rank: expert slots per rank, the ``E / ep_size`` primaries included.
        holders: per expert, the ranks holding it: its primary first, then its replicas in the order added.
        shares: per expert, the fraction of its tokens each holder takes (sums to one).
        planning_s: seconds the planner took.
    """

    ep_size: int
    ranks_per_node: int
    slots_per_rank: int
    holders: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...]
    planning_s: float = 0.0

    @property
    def num_experts(self) -> int:
        """Experts of the layer."""
        return len(self.holders)

    @property
    def num_replicas(self) -> int:
        """Replicas placed (holders beyond the primaries)."""
        return sum(len(h) - 1 for h in self.holders)

    def rank_slots(self) -> list[list[int]]:
        """Each rank's experts in slot order: its primaries (by expert index), then its replicas (by expert index)."""
        per_rank = self.num_experts // self.ep_size
        slots = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(self.ep_size)]
        for e, ranks in enumerate(self.holders):
            for r in ranks[1:]:
                slots[r].append(e)
        return slots

    def replica_pairs(self) -> set[tuple[int, int]]:
        """``(expert, rank)`` of every replica."""
        return {(e, r) for e, ranks in enumerate(self.holders) for r in ranks[1:]}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (holders, shares and the layout)."""
        return {
            "ep_size": self.ep_size,
            "ranks_per_node": self.ranks_per_node,
            "slots_per_rank": self.slots_per_rank,
            "holders": [list(h) for h in self.holders],
            "shares": [list(s) for s in self.shares],
            "planning_s": self.planning_s,
        }


@dataclass(frozen=True)
class PlacementMetrics:
    """How a placement fares on some loads.

    Args:
        load_max: tokens on the most loaded rank.
        load_mean: mean tokens per rank.
        comm_cost: weighted communication (token moves priced by link, plus replica gradient sums).
        tokens_to_replicas: tokens sent to replicas instead of primaries.
        moved_replicas: replicas not in the previous placement (each copies weights and optimizer state).
        moved_bytes: ``moved_replicas`` times the bytes of one expert's weights and optimizer state.
        planning_s: seconds the planner took.
    """

    load_max: float
    load_mean: float
    comm_cost: float
    tokens_to_replicas: float
    moved_replicas: int
    moved_bytes: float
    planning_s: float

    @property
    def imbalance(self) -> float:
        """``load_max / load_mean`` (1.0: perfectly balanced)."""
        return self.load_max / self.load_mean if self.load_mean else 1.0


def _check_layout(num_experts: int, ep_size: int, ranks_per_node: int, slots_per_rank: int) -> int:
    """Validates the layout; returns the spare slots per rank."""
    if ep_size < 1 or ranks_per_node < 1:
        raise ValueError(f"ep_size ({ep_size}) and ranks_per_node ({ranks_per_node}) must be positive")
    if ep_size > ranks_per_node and ep_size % ranks_per_node:
        raise ValueError(f"ep_size ({ep_size}) must be a multiple of ranks_per_node ({ranks_per_node})")
    if num_experts % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the number of experts ({num_experts})")
    per_rank = num_experts // ep_size
    if slots_per_rank < per_rank:
        raise ValueError(
            f"slots_per_rank ({slots_per_rank}) must hold each rank's {per_rank} primary experts "
            f"({num_experts} experts over ep_size {ep_size})"
        )
    return slots_per_rank - per_rank


def link_costs(ep_size: int, ranks_per_node: int, cross_node_cost: float) -> np.ndarray:
    """``[ep_size, ep_size]`` price of moving one token from a rank to another: 0 on the same rank, 1 inside a
    node, ``cross_node_cost`` between nodes.

    Args:
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks per node.
        cross_node_cost: price of a token between nodes relative to one inside a node.
    """
    node = np.arange(ep_size) // ranks_per_node
    cost = np.where(node[:, None] == node[None, :], 1.0, float(cross_node_cost))
    np.fill_diagonal(cost, 0.0)
    return cost


def _sources(loads: np.ndarray, ep_size: int, source_loads: np.ndarray | None) -> np.ndarray:
    """``[ep_size, E]`` fraction of each expert's tokens that each rank sends (uniform unless given)."""
    if source_loads is None:
        return np.full((ep_size, loads.size), 1.0 / ep_size)
    source_loads = np.asarray(source_loads, dtype=np.float64)
    if source_loads.shape != (ep_size, loads.size):
        raise ValueError(
            f"source_loads has shape {source_loads.shape}; expected [ep_size, num_experts] = "
            f"[{ep_size}, {loads.size}]"
        )
    totals = source_loads.sum(axis=0)
    return np.where(totals > 0, source_loads / np.where(totals > 0, totals, 1.0), 1.0 / ep_size)


def _water_fill(base: np.ndarray, total: float) -> np.ndarray:
    """Amounts adding up to ``total`` that bring the lowest of ``base`` up to one common level (min-max split)."""
    order = np.argsort(base, kind="stable")
    levels = base[order]
    fill = np.zeros_like(base)
    for k in range(1, levels.size + 1):
        level = (total + levels[:k].sum()) / k
        if k == levels.size or level <= levels[k]:
            fill[order[:k]] = level - levels[:k]
            return fill
    return fill


class _State:
    """The planner's working copy: holders, shares, per-rank loads and the communication of each expert."""

    def __init__(
        self,
        loads: np.ndarray,
        ep_size: int,
        ranks_per_node: int,
        costs: np.ndarray,
        src: np.ndarray,
        sync: float,
    ):
        self.loads, self.costs, self.src, self.sync = loads, costs, src, sync
        self.ranks_per_node = ranks_per_node
        per_rank = loads.size // ep_size
        self.holders = [[e // per_rank] for e in range(loads.size)]
        self.shares = [np.ones(1) for _ in range(loads.size)]
        self.rank_load = np.bincount([h[0] for h in self.holders], weights=loads, minlength=ep_size)
        self.expert_cost = np.array(
            [self.cost_of(e, self.holders[e], self.shares[e]) for e in range(loads.size)]
        )

    def cost_of(self, e: int, holders: Sequence[int], shares: np.ndarray) -> float:
        # Each source rank splits its tokens of e by the shares (a token-index split does not see the source).
        tokens = self.loads[e] * float(self.src[:, e] @ self.costs[:, list(holders)] @ shares)
        return tokens + self.sync * float(self.costs[holders[0], list(holders[1:])].sum())

    def split(self, e: int, holders: list[int]) -> np.ndarray:
        """Shares of e over ``holders`` (its current ones, then one more) that level their loads, the other
        experts' loads fixed."""
        base = self.rank_load[holders].copy()
        base[: len(self.shares[e])] -= self.loads[e] * self.shares[e]
        return _water_fill(base, self.loads[e]) / self.loads[e]

    def apply(self, e: int, holders: list[int], shares: np.ndarray) -> None:
        self.rank_load[self.holders[e]] -= self.loads[e] * self.shares[e]
        self.rank_load[holders] += self.loads[e] * shares
        self.holders[e], self.shares[e] = holders, shares
        self.expert_cost[e] = self.cost_of(e, holders, shares)


def plan_replicas(
    loads: Sequence[float] | np.ndarray,
    *,
    ep_size: int,
    ranks_per_node: int,
    slots_per_rank: int,
    cross_node_cost: float = 4.0,
    source_loads: np.ndarray | None = None,
    replica_sync_tokens: float = 0.0,
    comm_weight: float = 1.0,
    max_replicas_per_expert: int | None = None,
) -> Placement:
    """Places replicas of hot experts into spare slots, minimising the most loaded rank plus communication.

    Args:
        loads: ``[E]`` recent tokens (assignments) per expert of one layer.
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks per node.
        slots_per_rank: expert slots per rank, primaries included (``E / ep_size`` means no spare slot).
        cross_node_cost: price of a token sent between nodes relative to one inside a node.
        source_loads: ``[ep_size, E]`` tokens each rank routes to each expert (default: uniform over the ranks).
        replica_sync_tokens: per-step price of keeping one replica equal to its primary (its gradient sum), in
            token-equivalents; priced by the link between replica and primary.
        comm_weight: weight of the per-rank communication (total / ``ep_size``) against the most loaded rank.
        max_replicas_per_expert: replicas one expert may get (default: no limit but the slots).

    Returns:
        The placement; ``planning_s`` holds the planner's time.
    """
    start = time.perf_counter()
    loads = np.asarray(loads, dtype=np.float64)
    spare = _check_layout(loads.size, ep_size, ranks_per_node, slots_per_rank)
    if cross_node_cost < 0 or replica_sync_tokens < 0 or comm_weight < 0:
        raise ValueError("cross_node_cost, replica_sync_tokens and comm_weight must be non-negative")
    if np.any(loads < 0):
        raise ValueError("loads must be non-negative token counts")
    costs = link_costs(ep_size, ranks_per_node, cross_node_cost)
    state = _State(
        loads, ep_size, ranks_per_node, costs, _sources(loads, ep_size, source_loads), replica_sync_tokens
    )
    free = np.full(ep_size, spare)
    limit = ep_size if max_replicas_per_expert is None else max_replicas_per_expert

    while free.any():
        move = _best_move(state, free, limit, comm_weight / ep_size)
        if move is None:
            break
        e, holders, shares = move
        state.apply(e, holders, shares)
        free[holders[-1]] -= 1
    return _placement(state, ep_size, ranks_per_node, slots_per_rank, time.perf_counter() - start)


def _best_move(
    state: _State, free: np.ndarray, limit: int, comm_weight: float
) -> tuple[int, list[int], np.ndarray] | None:
    """The replica (expert on the most loaded rank, destination with a free slot) whose net gain is highest and
    positive: how far the ranks it touches fall below the current maximum, less ``comm_weight`` times the added
    communication. Judging the touched ranks rather than the global maximum lets ties at the top be relieved one
    rank at a time; a move never raises the maximum."""
    loads, peak = state.loads, state.rank_load.max()
    hot = int(np.argmax(state.rank_load))
    on_hot = [e for e in range(loads.size) if hot in state.holders[e] and loads[e] > 0]
    best: tuple[float, int, list[int], np.ndarray] | None = None
    for e in sorted(on_hot, key=lambda e: (-loads[e] * state.shares[e][state.holders[e].index(hot)], e)):
        if len(state.holders[e]) - 1 >= limit:
            continue
        for d in _candidates(state, free, e):
            holders = [*state.holders[e], int(d)]
            shares = state.split(e, holders)
            touched = state.rank_load[holders] + loads[e] * (shares - np.append(state.shares[e], 0.0))
            extra = state.cost_of(e, holders, shares) - state.expert_cost[e]
            gain = peak - touched.max() - comm_weight * extra
            if touched.max() <= peak + 1e-9 and gain > 1e-9 and (best is None or gain > best[0] + 1e-12):
                best = (gain, e, holders, shares)
    return None if best is None else best[1:]


def _candidates(state: _State, free: np.ndarray, e: int, per_node: int = 2) -> list[int]:
    """Destinations worth trying for a replica of ``e``: on each node, the ``per_node`` least loaded ranks with a
    free slot that do not hold ``e`` (a water-fill gains most on the least loaded ranks; which node it is on
    changes the communication)."""
    open_ranks = [int(r) for r in np.flatnonzero(free) if r not in state.holders[e]]
    by_node: dict[int, list[int]] = {}
    for r in sorted(open_ranks, key=lambda r: (state.rank_load[r], r)):
        node = by_node.setdefault(r // state.ranks_per_node, [])
        if len(node) < per_node:
            node.append(r)
    return sorted(r for node in by_node.values() for r in node)


def _placement(state: _State, ep_size: int, ranks_per_node: int, slots: int, seconds: float) -> Placement:
    return Placement(
        ep_size=ep_size,
        ranks_per_node=ranks_per_node,
        slots_per_rank=slots,
        holders=tuple(tuple(int(r) for r in h) for h in state.holders),
        shares=tuple(tuple(float(s) for s in sh) for sh in state.shares),
        planning_s=seconds,
    )


def plain_placement(num_experts: int, *, ep_size: int, ranks_per_node: int, slots_per_rank: int) -> Placement:
    """Plain EP: every expert on its primary rank only.

    Args:
        num_experts: experts of the layer.
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks per node.
        slots_per_rank: expert slots per rank (spare ones stay empty).
    """
    _check_layout(num_experts, ep_size, ranks_per_node, slots_per_rank)
    per_rank = num_experts // ep_size
    return Placement(
        ep_size=ep_size,
        ranks_per_node=ranks_per_node,
        slots_per_rank=slots_per_rank,
        holders=tuple((e // per_rank,) for e in range(num_experts)),
        shares=tuple((1.0,) for _ in range(num_experts)),
    )


def greedy_replicas(
    loads: Sequence[float] | np.ndarray, *, ep_size: int, ranks_per_node: int, slots_per_rank: int
) -> Placement:
    """The baseline: one spare slot at a time, replicate the expert with the most tokens per holder onto the least
    loaded rank with a free slot, splitting each expert evenly over its holders (no topology, no cost).

    Args:
        loads: ``[E]`` recent tokens per expert of one layer.
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks per node (only recorded: the baseline ignores topology).
        slots_per_rank: expert slots per rank, primaries included.
    """
    start = time.perf_counter()
    loads = np.asarray(loads, dtype=np.float64)
    spare = _check_layout(loads.size, ep_size, ranks_per_node, slots_per_rank)
    per_rank = loads.size // ep_size
    holders = [[e // per_rank] for e in range(loads.size)]
    rank_load = np.bincount([h[0] for h in holders], weights=loads, minlength=ep_size)
    free = np.full(ep_size, spare)
    for _ in range(spare * ep_size):
        per_holder = np.array([loads[e] / len(h) for e, h in enumerate(holders)])
        for e in np.argsort(-per_holder, kind="stable"):
            open_ranks = [r for r in np.flatnonzero(free) if r not in holders[e]]
            if open_ranks:
                break
        else:
            break
        d = int(min(open_ranks, key=lambda r: (rank_load[r], r)))
        rank_load[holders[e]] -= per_holder[e]
        holders[e].append(d)
        rank_load[holders[e]] += loads[e] / len(holders[e])
        free[d] -= 1
    return Placement(
        ep_size=ep_size,
        ranks_per_node=ranks_per_node,
        slots_per_rank=slots_per_rank,
        holders=tuple(tuple(h) for h in holders),
        shares=tuple(tuple([1.0 / len(h)] * len(h)) for h in holders),
        planning_s=time.perf_counter() - start,
    )


def rank_loads(placement: Placement, loads: Sequence[float] | np.ndarray) -> np.ndarray:
    """``[ep_size]`` tokens each rank computes under ``placement`` for per-expert ``loads``.

    Args:
        placement: where the experts live.
        loads: ``[E]`` tokens per expert.
    """
    loads = np.asarray(loads, dtype=np.float64)
    out = np.zeros(placement.ep_size)
    for e, (ranks, shares) in enumerate(zip(placement.holders, placement.shares)):
        np.add.at(out, list(ranks), loads[e] * np.asarray(shares))
    return out


def evaluate(
    placement: Placement,
    loads: Sequence[float] | np.ndarray,
    *,
    cross_node_cost: float = 4.0,
    source_loads: np.ndarray | None = None,
    replica_sync_tokens: float = 0.0,
    previous: Placement | None = None,
    expert_state_bytes: float = 0.0,
) -> PlacementMetrics:
    """Loads, communication and movement of ``placement`` on ``loads`` (which need not be those it was planned on).

    Args:
        placement: where the experts live.
        loads: ``[E]`` tokens per expert.
        cross_node_cost: price of a token between nodes relative to one inside a node.
        source_loads: ``[ep_size, E]`` tokens each rank routes to each expert (default uniform).
        replica_sync_tokens: per-step price of one replica's gradient sum, in token-equivalents.
        previous: the placement before a re-plan (``None``: plain EP, no replica yet).
        expert_state_bytes: bytes of one expert's weights plus optimizer state (what moving a replica copies).
    """
    loads = np.asarray(loads, dtype=np.float64)
    per_rank = rank_loads(placement, loads)
    costs = link_costs(placement.ep_size, placement.ranks_per_node, cross_node_cost)
    src = _sources(loads, placement.ep_size, source_loads)
    comm = 0.0
    for e, (ranks, shares) in enumerate(zip(placement.holders, placement.shares)):
        comm += loads[e] * float(src[:, e] @ costs[:, list(ranks)] @ np.asarray(shares))
        comm += replica_sync_tokens * float(costs[ranks[0], list(ranks[1:])].sum())
    moved = placement.replica_pairs() - (previous.replica_pairs() if previous is not None else set())
    to_replicas = sum(loads[e] * (1.0 - shares[0]) for e, shares in enumerate(placement.shares))
    return PlacementMetrics(
        load_max=float(per_rank.max()),
        load_mean=float(per_rank.mean()),
        comm_cost=comm,
        tokens_to_replicas=float(to_replicas),
        moved_replicas=len(moved),
        moved_bytes=len(moved) * float(expert_state_bytes),
        planning_s=placement.planning_s,
    )
