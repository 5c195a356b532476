"""Bounded admission with priorities: a fixed number of in-flight places and a bounded waiting queue.

A request beyond both is refused at once (ResourceExhaustedError with a retry hint) instead of
queueing without bound; waiting requests get freed places highest priority first, then FIFO.

A request may need several places at once (the n choices of one streamed response): it takes all of
them together or waits for all of them, never holding some while it waits for the rest, so two such
requests cannot each hold what the other waits for. The first in line waits until its places are
free; those behind it do not overtake it (a large request is not starved by small ones).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from common.errors import ResourceExhaustedError, UnavailableError


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, retry_after_s: float) -> None:
        self.max_in_flight, self.max_queued, self.retry_after_s = (
            max_in_flight,
            max_queued,
            retry_after_s,
        )
        self.in_flight = 0
        # (-priority, arrival, places, waiter)
        self._waiting: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    async def acquire(self, priority: int = 0, places: int = 1) -> None:
        """Take `places` (at most max_in_flight) together, waiting for them in line (bounded), or
        raise ResourceExhaustedError; give each back with release()."""
        if not 1 <= places <= self.max_in_flight:
            raise ValueError(f"{places} places of {self.max_in_flight}")
        if self.in_flight + places <= self.max_in_flight and not self.queued:
            self.in_flight += places
            return
        if self.queued >= self.max_queued:
            self.rejected += 1
            raise ResourceExhaustedError(
                f"server busy: {self.in_flight} requests in flight and {self.queued} "
                f"queued (max_queued={self.max_queued})",
                self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._order), places, waiter))
        try:
            await waiter  # _grant counted our places in in_flight
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(places)  # they arrived as we were cancelled: pass them on
            else:
                self._grant()  # we no longer block those behind us
            raise

    def refuse_waiting(self, reason: str) -> None:
        """Every request waiting in line fails with UnavailableError(reason) (the gateway is
        stopping); those holding places keep them."""
        for *_, waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(UnavailableError(reason))

    def release(self, places: int = 1) -> None:
        self.in_flight -= places
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            *_, places, waiter = self._waiting[0]
            if waiter.done():  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            if self.in_flight + places > self.max_in_flight:
                return
            heapq.heappop(self._waiting)
            self.in_flight += places
            waiter.set_result(None)
