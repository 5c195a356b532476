"""Bounded admission with priorities: a fixed number of in-flight places and a bounded waiting queue.

A request beyond both is refused at once (ResourceExhaustedError with a retry hint) instead of
queueing without bound; waiting requests get freed places highest priority first, then FIFO.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from moe_mesh.common.errors import ResourceExhaustedError


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, retry_after_s: float) -> None:
        self.max_in_flight, self.max_queued, self.retry_after_s = (
            max_in_flight,
            max_queued,
            retry_after_s,
        )
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold an in-flight place for the body; wait for one (bounded) or raise ResourceExhaustedError."""
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self.in_flight < self.max_in_flight and not self.queued:
            self.in_flight += 1
            return
        if self.queued >= self.max_queued:
            self.rejected += 1
            raise ResourceExhaustedError(
                f"server busy: {self.in_flight} requests in flight and {self.queued} "
                f"queued (max_queued={self.max_queued})",
                self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._order), waiter))
        try:
            await waiter  # _release hands its place over: in_flight stays counted
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the place arrived as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            *_, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1
