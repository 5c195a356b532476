"""Expert placement from measured load (DeepSeek's EPLB idea): what the router keeps in-process, which
experts get redundant remote replicas, and how the rest is packed into expert-service groups.

Pure and deterministic: the same load and options always give the same proposal (ties break by
(layer, expert) and group index), so a plan proposed twice from one window diffs empty.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from common.placement import Pair

MAX_REPLICAS = (
    8  # beyond this a pair's replicas mostly idle: the router sends each token to one of them
)


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of `propose`; `extra_replicas=None` means one extra slot per 8 MoE pairs."""

    budget_bytes: int
    groups: int = 4
    extra_replicas: int | None = None
    hot_factor: float = 1.5

    def __post_init__(self) -> None:
        for name, low in (
            ("budget_bytes", 0),
            ("groups", 1),
            ("extra_replicas", 0),
            ("hot_factor", 0),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class GroupProposal:
    name: str
    pairs: tuple[Pair, ...]
    replicas: int
    load_share: (
        float  # share of all routed tokens its processes serve together (colocated pairs count 0)
    )


@dataclass(frozen=True)
class Proposal:
    colocated: tuple[Pair, ...]  # the router's predicted in-process set, hottest first
    colocated_bytes: int
    replicas: dict[Pair, int]  # remote replicas of every MoE pair, >= 1
    groups: tuple[GroupProposal, ...]
    in_process_share: float  # colocated load / total load
    imbalance_before: float  # max / mean load per remote replica, one replica per pair
    imbalance_after: float


def propose(load: dict[Pair, float], expert_bytes: int, options: PlanOptions) -> Proposal:
    """Place every MoE pair in `load` (tokens routed to it in the window; dense layers absent)."""
    if not load:
        raise ValueError("load names no MoE pair")
    if expert_bytes < 1:
        raise ValueError(f"expert_bytes must be >= 1, got {expert_bytes}")
    colocated = _colocate(load, expert_bytes, options)
    extra = len(load) // 8 if options.extra_replicas is None else options.extra_replicas
    replicas = _replicate(load, set(colocated), extra)
    remote = {p: 0.0 if p in colocated else x for p, x in load.items()}
    total = sum(load.values())
    return Proposal(
        colocated=tuple(colocated),
        colocated_bytes=len(colocated) * expert_bytes,
        replicas=replicas,
        groups=tuple(_groups(remote, replicas, options.groups, total)),
        in_process_share=sum(load[p] for p in colocated) / total if total else 0.0,
        imbalance_before=imbalance({p: (x, 1) for p, x in load.items()}),
        # A colocated pair's remote replica is a standby for demotion: no traffic, so not a slot.
        imbalance_after=imbalance({p: (load[p], replicas[p]) for p in load if p not in colocated}),
    )


def imbalance(slots: dict[Pair, tuple[float, int]]) -> float:
    """EPLB's balance metric: max over replica slots of load / mean load per slot (1.0 is perfect).

    `slots` maps a pair to (its load, its replicas); each replica carries load / replicas.
    """
    count = sum(r for _, r in slots.values())
    total = sum(x for x, _ in slots.values())
    if not count or not total:
        return 1.0
    return max(x / r for x, r in slots.values()) / (total / count)


def _colocate(load: dict[Pair, float], expert_bytes: int, options: PlanOptions) -> list[Pair]:
    by_layer: dict[int, list[float]] = {}
    for (layer, _), x in load.items():
        by_layer.setdefault(layer, []).append(x)
    mean = {layer: sum(xs) / len(xs) for layer, xs in by_layer.items()}
    # Only pairs well above their layer's mean: on an even window colocating saves little and
    # the router's live policy would undo the prediction anyway.
    hot = [p for p, x in load.items() if x > 0 and x >= options.hot_factor * mean[p[0]]]
    hot.sort(key=lambda p: (-load[p], p))
    return hot[: options.budget_bytes // expert_bytes]  # every expert has the same size


def _replicate(load: dict[Pair, float], colocated: set[Pair], extra: int) -> dict[Pair, int]:
    replicas = dict.fromkeys(sorted(load), 1)
    # Max-heap of load per replica; colocated pairs are served in-process and idle pairs need no copies.
    heap = [(-x, p) for p, x in load.items() if p not in colocated and x > 0]
    heapq.heapify(heap)
    for _ in range(extra):
        if not heap:
            break
        _, p = heapq.heappop(heap)
        replicas[p] += 1
        if replicas[p] < MAX_REPLICAS:
            heapq.heappush(heap, (-load[p] / replicas[p], p))
    return replicas


def _groups(
    remote: dict[Pair, float], replicas: dict[Pair, int], count: int, total: float
) -> list[GroupProposal]:
    def share(pairs: list[Pair]) -> float:
        return sum(remote[p] for p in pairs) / total if total else 0.0

    out = []
    for r in sorted({r for r in replicas.values() if r > 1}, reverse=True):
        pairs = sorted(p for p, n in replicas.items() if n == r)
        out.append(GroupProposal(f"hot-r{r}", tuple(pairs), r, share(pairs)))
    bins: list[list[Pair]] = [[] for _ in range(count)]
    sums = [0.0] * count
    singles = sorted((p for p, n in replicas.items() if n == 1), key=lambda p: (-remote[p], p))
    for p in singles:
        # LPT; equal loads (idle or colocated pairs) go to the group with fewer experts, so that
        # memory stays even when the load says nothing.
        i = min(range(count), key=lambda j: (sums[j], len(bins[j]), j))
        bins[i].append(p)
        sums[i] += remote[p]
    out += [
        GroupProposal(f"experts-{i}", tuple(sorted(b)), 1, share(b))
        for i, b in enumerate(bins)
        if b
    ]
    return out
