"""Replaying router-load traces against expert placements, and synthetic skewed traces.

A trace is ``loads`` ``[steps, layers, experts]`` (tokens per expert of each optimizer step, as
:class:`~forge_lightning.callbacks.router_load.RouterLoadRecorder` writes it). :func:`replay` walks it step by
step: every ``replan_every`` steps each method re-plans every layer from the mean loads of the last ``window``
steps, and each step is scored with the placement then in force (planned on the past, judged on the present)::

    step:     0 .. window-1 | window .............. window+N-1 | window+N ...
    placement: (history)    | planned on steps [0, window)     | planned on [N, window+N) ...
    scored:         -       | each step's own loads             | ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from forge_lightning.distributed.expert_placement import (
    Placement,
    evaluate,
    greedy_replicas,
    plain_placement,
    plan_replicas,
)

Planner = Callable[[np.ndarray], Placement]


@dataclass(frozen=True)
class Layout:
    """The EP layout and prices a replay runs at.

    Args:
        ep_size: expert-parallel ranks.
        ranks_per_node: ranks per node.
        spare_slots: spare expert slots per rank (beyond its primaries).
        cross_node_cost: price of a token between nodes relative to one inside a node.
        replica_sync_tokens: per-step price of one replica's gradient sum, in token-equivalents.
        expert_state_bytes: bytes of one expert's weights plus optimizer state.
    """

    ep_size: int
    ranks_per_node: int = 8
    spare_slots: int = 1
    cross_node_cost: float = 4.0
    replica_sync_tokens: float = 0.0
    expert_state_bytes: float = 0.0

    def planners(self, num_experts: int) -> dict[str, Planner]:
        """Plain EP, the greedy baseline and :func:`plan_replicas`, each as ``loads [E] -> Placement``."""
        layout = dict(
            ep_size=self.ep_size,
            ranks_per_node=self.ranks_per_node,
            slots_per_rank=num_experts // self.ep_size + self.spare_slots,
        )
        plain = plain_placement(num_experts, **layout)
        return {
            "plain EP": lambda loads: plain,
            "greedy replication": lambda loads: greedy_replicas(loads, **layout),
            "ours (topology-aware)": lambda loads: plan_replicas(
                loads,
                **layout,
                cross_node_cost=self.cross_node_cost,
                replica_sync_tokens=self.replica_sync_tokens,
            ),
        }


def replay(
    loads_SLE: np.ndarray, layout: Layout, *, window: int, replan_every: int
) -> dict[str, dict[str, float]]:
    """Scores plain EP, greedy replication and ours on a trace.

    Args:
        loads_SLE: ``[steps, layers, experts]`` tokens per expert.
        layout: EP layout and prices.
        window: past steps each plan reads (their mean loads).
        replan_every: steps between re-plans.

    Returns:
        Per method: ``imbalance`` (mean over scored steps and layers of max / mean rank load), ``imbalance_max``,
        ``comm_per_token`` (weighted communication per routed assignment), ``replicas`` (mean per layer),
        ``moved_replicas_per_replan`` and ``moved_gb`` (total, all layers), ``planning_ms`` (mean and max per plan).
    """
    steps, layers, experts = loads_SLE.shape
    if window < 1 or replan_every < 1 or steps <= window:
        raise ValueError(
            f"the trace has {steps} steps; window ({window}) and replan_every ({replan_every}) must be positive "
            "and the trace longer than the window"
        )
    results = {}
    for name, planner in layout.planners(experts).items():
        imbalance, comm, tokens, replicas, moved, plan_s = [], 0.0, 0.0, [], 0, []
        for layer in range(layers):
            current: Placement | None = None
            for step in range(window, steps):
                previous = current
                if (step - window) % replan_every == 0:
                    current = planner(loads_SLE[step - window : step, layer].mean(axis=0))
                    plan_s.append(current.planning_s)
                    replicas.append(current.num_replicas)
                m = evaluate(
                    current,
                    loads_SLE[step, layer],
                    cross_node_cost=layout.cross_node_cost,
                    replica_sync_tokens=layout.replica_sync_tokens,
                    previous=previous,
                    expert_state_bytes=layout.expert_state_bytes,
                )
                imbalance.append(m.imbalance)
                comm, tokens, moved = (
                    comm + m.comm_cost,
                    tokens + loads_SLE[step, layer].sum(),
                    moved + m.moved_replicas,
                )
        replans = len(plan_s)
        results[name] = {
            "imbalance": float(np.mean(imbalance)),
            "imbalance_max": float(np.max(imbalance)),
            "comm_per_token": comm / tokens if tokens else 0.0,
            "replicas": float(np.mean(replicas)),
            "moved_replicas_per_replan": moved / replans,
            "moved_gb": moved * layout.expert_state_bytes / 1e9,
            "planning_ms_mean": 1e3 * float(np.mean(plan_s)),
            "planning_ms_max": 1e3 * float(np.max(plan_s)),
        }
    return results


def synthetic_trace(
    *,
    steps: int,
    layers: int,
    experts: int,
    assignments_per_step: int,
    zipf: float = 1.1,
    drift: float = 0.05,
    seed: int = 0,
) -> np.ndarray:
    """A synthetic skewed trace: per layer, expert popularity ``~ 1 / rank^zipf`` over a random ranking that drifts
    (each step, every pair of adjacent popularity ranks swaps with probability ``drift``); each step's loads are a
    multinomial draw of ``assignments_per_step``.

    Args:
        steps: optimizer steps.
        layers: MoE layers.
        experts: experts per layer.
        assignments_per_step: routed assignments (tokens x top-k) per step and layer.
        zipf: skew exponent (0: uniform).
        drift: per-step swap probability of each pair of adjacent popularity ranks.
        seed: random seed.

    Returns:
        ``[steps, layers, experts]`` loads.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** zipf
    weights /= weights.sum()
    out = np.zeros((steps, layers, experts))
    for layer in range(layers):
        ranking = rng.permutation(experts)  # ranking[i]: the expert with the i-th highest popularity
        for step in range(steps):
            for i in np.flatnonzero(rng.random(experts - 1) < drift):
                ranking[[i, i + 1]] = ranking[[i + 1, i]]
            probs = np.empty(experts)
            probs[ranking] = weights
            out[step, layer] = rng.multinomial(assignments_per_step, probs)
    return out
