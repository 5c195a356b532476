"""Expert utilization over a sliding time window: what the tiering policy and `status` read.

Counts live in a ring of time buckets; a bucket older than the window is zeroed when its slot is
reused, so reading the window is a sum over the ring. They are Python ints: the router records
every MoE layer call, and a decode at batch 1 routes one token to k experts, which Python adds in
a microsecond where a torch add costs ten.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch


class UtilizationWindow:
    """Tokens routed per (layer, expert) in the last `window_s` seconds, at `window_s / buckets` resolution."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window_s: float = 60.0,
        buckets: int = 12,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self.window_s, self.buckets, self.clock = window_s, buckets, clock
        self._bucket_s = window_s / buckets
        self.num_layers, self.num_experts = num_layers, num_experts
        self._counts = [self._zeros() for _ in range(buckets)]  # [bucket][layer][expert]
        self._ids = [-1] * buckets  # which time bucket each slot holds now
        # The router's compute thread adds; the event loop (tiering, status) reads.
        self._lock = threading.Lock()

    def _zeros(self) -> list[list[int]]:
        return [[0] * self.num_experts for _ in range(self.num_layers)]

    def _slot(self) -> int:
        bucket = int(self.clock() // self._bucket_s)
        slot = bucket % self.buckets
        if self._ids[slot] != bucket:
            self._counts[slot] = self._zeros()
            self._ids[slot] = bucket
        return slot

    def add(self, layer: int, routed: Iterable[tuple[int, int]]) -> None:
        """Record one MoE layer call: (expert, tokens routed to it) pairs."""
        with self._lock:
            row = self._counts[self._slot()][layer]
            for expert, n in routed:
                row[expert] += n

    def counts(self) -> torch.Tensor:
        """[layers, experts] float64 tokens routed within the window."""
        current = int(self.clock() // self._bucket_s)
        with self._lock:
            live = [s for s, b in enumerate(self._ids) if current - self.buckets < b <= current]
            total = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
            for s in live:
                total += torch.tensor(self._counts[s], dtype=torch.float64)
            return total
