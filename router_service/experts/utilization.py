"""Expert utilization over a sliding time window: what the tiering policy and `status` read.

Counts live in a ring of time buckets; a bucket older than the window is zeroed when its slot is
reused, so reading the window is a sum over the ring and recording is one tensor add.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
        self._counts = torch.zeros(buckets, num_layers, num_experts, dtype=torch.int64)
        self._ids = [-1] * buckets  # which time bucket each slot holds now
        # The router's compute thread adds; the event loop (tiering, status) reads.
        self._lock = threading.Lock()

    def _slot(self) -> int:
        bucket = int(self.clock() // self._bucket_s)
        slot = bucket % self.buckets
        if self._ids[slot] != bucket:
            self._counts[slot].zero_()
            self._ids[slot] = bucket
        return slot

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """Record one MoE layer call: `counts` [experts] tokens routed to each expert."""
        with self._lock:
            self._counts[self._slot(), layer] += counts

    def counts(self) -> torch.Tensor:
        """[layers, experts] float64 tokens routed within the window."""
        current = int(self.clock() // self._bucket_s)
        with self._lock:
            live = [s for s, b in enumerate(self._ids) if current - self.buckets < b <= current]
            if not live:
                return torch.zeros(self._counts.shape[1:], dtype=torch.float64)
            return self._counts[live].sum(0).to(torch.float64)
