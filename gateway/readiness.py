"""Whether a gateway is ready: at least one of its routers serves and has a replica of every MoE
layer's every expert. Load balancers and orchestrators read it (HTTP /health/ready, the gRPC health
service), so a mesh missing an expert group gets no new traffic instead of failing it.

Each router says so on its named health service EXPERTS_HEALTH (common/status.py), which follows
its placement table and goes NOT_SERVING with the router itself (engine loop gone, shutting down).
The gateway keeps one health Watch stream per router: changes arrive as they happen, with no
polling and nothing to compute here. A router that cannot be reached counts as not serving until
its stream is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2

from common.status import EXPERTS_HEALTH

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
# Between attempts to (re)open a router's Watch stream once it failed.
RETRY_S = 0.5


class Watchable(Protocol):
    """A router as readiness sees it: its address and a health stub (RouterClient)."""

    address: str
    health: object  # grpc_health.v1 HealthStub


class Readiness:
    """`ready` while some router's EXPERTS_HEALTH is SERVING; `on_change(ready)` runs after each
    change (never two at once, always with the latest value)."""

    def __init__(self, on_change: Callable[[bool], Awaitable[None]]) -> None:
        self.on_change = on_change
        self.serving: dict[str, bool | None] = {}  # router address -> SERVING (None: not heard yet)
        self._watches: dict[str, asyncio.Task] = {}
        self._clients: dict[str, Watchable] = {}  # the client each watch runs on
        self._reported: bool | None = None
        self._report: asyncio.Task | None = None
        self._heard = asyncio.Event()  # set once every router followed has answered or failed

    @property
    def ready(self) -> bool:
        return any(self.serving.values())

    def follow(self, routers: Sequence[Watchable]) -> None:
        """Watch these routers from now on (start new watches, end those of routers gone or
        replaced by a new client at the same address: the old one's channel is closing)."""
        wanted = {r.address: r for r in routers}
        for address in list(self._watches):
            if self._clients.get(address) is not wanted.get(address):
                self._watches.pop(address).cancel()
                self._clients.pop(address, None)
                self.serving.pop(address, None)
        for address, router in wanted.items():
            if address not in self._watches:
                self.serving[address] = None
                self._clients[address] = router
                self._watches[address] = asyncio.create_task(
                    self._watch(router), name=f"readiness-{address}"
                )
        self._changed()

    async def heard(self, timeout_s: float) -> bool:
        """Wait until every router followed has answered (or failed) once, up to `timeout_s`."""
        try:
            await asyncio.wait_for(self._heard.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def _watch(self, router: Watchable) -> None:
        request = health_pb2.HealthCheckRequest(service=EXPERTS_HEALTH)
        while True:
            # No wait_for_ready: a router that cannot be reached is an error at once (so it counts
            # as not serving and is tried again), not a call that waits and leaves readiness unsaid.
            try:
                async for reply in router.health.Watch(request):  # type: ignore[attr-defined]
                    self._set(router.address, reply.status == SERVING)
            except grpc.aio.AioRpcError as e:
                log.debug("readiness watch of router %s: %s", router.address, e.code().name)
            except Exception as e:  # e.g. a channel closed under it: still not serving, try again
                log.debug("readiness watch of router %s: %r", router.address, e)
            self._set(router.address, False)  # stream ended: the router is gone or going
            await asyncio.sleep(RETRY_S)

    def _set(self, address: str, serving: bool) -> None:
        if address in self.serving and self.serving[address] is not serving:
            self.serving[address] = serving
            self._changed()

    def _changed(self) -> None:
        if all(v is not None for v in self.serving.values()):
            self._heard.set()
        if not self._heard.is_set():  # not before the first answers: nothing to say yet
            return
        if self._report is None or self._report.done():
            self._report = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        while self._reported is not self.ready:  # again if it changed while on_change ran
            self._reported = ready = self.ready
            log.info("gateway %s", "ready" if ready else f"not ready: {self.why()}")
            await self.on_change(ready)

    def why(self) -> str:
        """Why not ready, in words (for logs and tests)."""
        if not self.serving:
            return "no router"
        return (
            "no router serves every expert ("
            + ", ".join(
                f"{a}: {'unreachable or not serving' if v is False else 'not heard from yet'}"
                for a, v in sorted(self.serving.items())
            )
            + ")"
        )

    async def close(self) -> None:
        tasks = [*self._watches.values(), *([self._report] if self._report else [])]
        self._watches.clear()
        self._clients.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
