"""Tiered placement: the hottest experts computed in the router, the rest on expert services.

`choose_hot` is the policy, a pure function of the utilization window: it fills a byte budget
with the experts that take clearly more than their share of their layer's tokens, hottest first.
Incumbents get a hysteresis bonus and every expert a minimum dwell time in its tier, so noise in
the window does not move weights back and forth.

`Tierer` applies the policy live. Promotion loads the weights first (off the event loop) and then
publishes a table that computes the expert here; demotion publishes a table without it, so calls
go to a healthy remote replica, and the weights are freed when the last call holding the old
table finishes. An expert with no healthy remote replica is never demoted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from common import runtime
from common.checkpoint import Checkpoint
from common.placement import Pair, format_experts
from common.weights import FFNWeights
from router_service.experts.backends import ColocatedExperts, LivePlacement
from router_service.experts.utilization import UtilizationWindow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TieringConfig:
    budget_bytes: int  # colocated experts' weights at most (pinned ones count too)
    expert_bytes: int  # one routed expert's weights
    hot_factor: float = 1.5  # hot: at least this multiple of its layer's mean load
    hysteresis: float = 0.2  # an incumbent's load counts this much more when ranking
    min_dwell_s: float = 30.0  # an expert stays at least this long in a tier it moved to
    min_layer_tokens: int = (
        64  # a layer with fewer routed tokens in the window has no hot experts yet
    )
    pinned_hot: frozenset[Pair] = frozenset()
    pinned_remote: frozenset[Pair] = frozenset()


def choose_hot(
    load: torch.Tensor,
    moe_layers: Collection[int],
    current: Collection[Pair],
    config: TieringConfig,
    has_remote: Collection[Pair],
    frozen: Collection[Pair] = (),
) -> set[Pair]:
    """The experts to colocate. `load` [layers, experts] tokens in the window; `frozen` pairs keep their tier.

    Pinned-hot pairs, frozen hot pairs and hot pairs without a remote replica stay; then candidates
    fill the rest of the budget in order of load (incumbents' raised by `hysteresis`).
    """
    current = set(current)
    keep = set(config.pinned_hot) | {p for p in current if p in frozen or p not in has_remote}
    ranked: list[tuple[float, Pair]] = []
    for layer in moe_layers:
        row = load[layer]
        total = float(row.sum())
        if total < config.min_layer_tokens:
            continue
        mean = total / row.numel()
        for expert, tokens in enumerate(row.tolist()):
            pair = (layer, expert)
            score = tokens * (1 + config.hysteresis if pair in current else 1.0)
            if (
                score >= config.hot_factor * mean
                and pair not in keep
                and pair not in config.pinned_remote
                and (pair in current or pair not in frozen)
            ):
                ranked.append((score, pair))
    chosen = set(keep)
    room = config.budget_bytes - len(chosen) * config.expert_bytes
    for _, pair in sorted(ranked, key=lambda sp: (-sp[0], sp[1])):
        if room < config.expert_bytes:
            break
        chosen.add(pair)
        room -= config.expert_bytes
    return chosen


@dataclass
class Tierer:
    """Runs `choose_hot` every `interval_s` and moves experts between this process and remote replicas."""

    checkpoint: Checkpoint
    placement: LivePlacement
    window: UtilizationWindow
    config: TieringConfig
    interval_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    promotions: int = 0
    demotions: int = 0
    _moved_at: dict[Pair, float] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def hot(self) -> set[Pair]:
        return set(self.placement.colocated.weights)

    def colocated_bytes(self) -> int:
        return sum(w.nbytes for w in self.placement.colocated.weights.values())

    def target(self) -> set[Pair]:
        now = self.clock()
        frozen = {p for p, t in self._moved_at.items() if now - t < self.config.min_dwell_s}
        return choose_hot(
            self.window.counts(),
            self.checkpoint.spec.moe_layer_ids,
            self.hot,
            self.config,
            self.placement.remote,
            frozen,
        )

    async def step(self) -> None:
        await self.apply(self.target())

    async def apply(self, target: set[Pair]) -> None:
        """Colocate exactly `target`, except pairs that would be left with no replica at all."""
        async with self._lock:
            current = self.hot
            demote = {p for p in current - target if p in self.placement.remote}
            promote = target - current
            if not promote and not demote:
                return
            loaded = await asyncio.to_thread(self._load, sorted(promote)) if promote else {}
            kept = {p: w for p, w in self.placement.colocated.weights.items() if p not in demote}
            self.placement.set_colocated(ColocatedExperts({**kept, **loaded}))
            now = self.clock()
            for pair in promote | demote:
                self._moved_at[pair] = now
            self.promotions += len(promote)
            self.demotions += len(demote)
            log.info(
                "re-tiered: colocated %s, demoted %s; %d colocated (%.1f MiB)",
                format_experts(sorted(promote)) or "-",
                format_experts(sorted(demote)) or "-",
                len(kept) + len(loaded),
                self.colocated_bytes() / 2**20,
            )

    def _load(self, pairs: list[Pair]) -> dict[Pair, FFNWeights]:
        """Load on a worker thread, then end that thread's OpenMP workers: left idle beside the
        compute thread's they would slow it (runtime.release_openmp_threads)."""
        try:
            return self.checkpoint.load_experts(pairs)
        finally:
            runtime.release_openmp_threads()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            # A failed re-tiering keeps the current placement; the next one retries.
            except Exception:
                log.exception("re-tiering failed")
