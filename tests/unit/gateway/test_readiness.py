"""The gateway's readiness decision, against real gRPC health services on loopback: ready exactly
while some router says it serves every expert (EXPERTS_HEALTH SERVING), reported on each change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.status import EXPERTS_HEALTH
from gateway.readiness import Readiness
from tests.support.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Router:
    """A router as readiness sees it: an address and a health stub; `servicer` sets what it says."""

    address: str
    health: health_pb2_grpc.HealthStub
    servicer: health.aio.HealthServicer
    server: grpc.aio.Server


@asynccontextmanager
async def router(experts: int | None = SERVING) -> AsyncIterator[Router]:
    """A health service on loopback; `experts` None registers no EXPERTS_HEALTH (an old router)."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    if experts is not None:
        await servicer.set(EXPERTS_HEALTH, experts)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            yield Router(address, health_pb2_grpc.HealthStub(channel), servicer, server)
        finally:
            await server.stop(0)


class Reports:
    def __init__(self) -> None:
        self.seen: list[bool] = []

    async def __call__(self, ready: bool) -> None:
        self.seen.append(ready)


async def test_ready_while_some_router_serves_every_expert_and_each_change_is_reported() -> None:
    reports = Reports()
    readiness = Readiness(reports)
    async with router(SERVING) as a, router(NOT_SERVING) as b:
        readiness.follow([a, b])
        assert await readiness.heard(5)
        await eventually(lambda: reports.seen == [True], 5, "ready: a serves every expert")
        await a.servicer.set(EXPERTS_HEALTH, NOT_SERVING)  # a lost an expert group
        await eventually(lambda: reports.seen == [True, False], 5, "not ready")
        assert not readiness.ready and "unreachable or not serving" in readiness.why()
        await b.servicer.set(EXPERTS_HEALTH, SERVING)  # b has every expert now
        await eventually(lambda: reports.seen == [True, False, True], 5, "ready again")
        readiness.follow([a])  # b left: its vote goes with it
        await eventually(lambda: reports.seen[-1] is False, 5, "not ready without b")
        await readiness.close()


async def test_a_router_shutting_down_or_gone_counts_as_not_serving() -> None:
    reports = Reports()
    readiness = Readiness(reports)
    async with router(SERVING) as a:
        readiness.follow([a])
        await eventually(lambda: reports.seen == [True], 5, "ready")
        await a.servicer.enter_graceful_shutdown()  # every service NOT_SERVING, as on stop
        await eventually(lambda: reports.seen == [True, False], 5, "not ready on shutdown")
        await a.servicer.set(EXPERTS_HEALTH, SERVING)  # ignored: it is shutting down
    async with router(SERVING) as gone:
        readiness.follow([gone])
        await eventually(lambda: readiness.ready, 5, "ready with the new router")
        await gone.server.stop(0)
        await eventually(lambda: not readiness.ready, 5, "a stopped router's stream ends")
    await readiness.close()


async def test_not_ready_without_routers_or_with_one_that_does_not_say() -> None:
    reports = Reports()
    readiness = Readiness(reports)
    readiness.follow([])
    assert await readiness.heard(1) and not readiness.ready
    await eventually(lambda: reports.seen == [False], 5, "reported not ready")
    assert readiness.why() == "no router"
    async with router(experts=None) as old:  # SERVICE_UNKNOWN: no claim it serves every expert
        readiness.follow([old])
        assert await readiness.heard(5) and not readiness.ready
    await readiness.close()
    assert reports.seen == [False]


async def test_an_unreachable_router_does_not_freeze_what_the_others_report() -> None:
    """A router the gateway cannot reach (dead, wrong certificate) counts as not serving at once,
    so readiness is said, and a live router's changes are still reported."""
    reports = Reports()
    readiness = Readiness(reports)
    async with router(SERVING) as live, router(SERVING) as gone:
        await gone.server.stop(0)  # its address now refuses connections
        readiness.follow([live, gone])
        assert await readiness.heard(5), readiness.why()
        await eventually(lambda: reports.seen == [True], 5, "ready through the live router")
        await live.servicer.set(EXPERTS_HEALTH, NOT_SERVING)
        await eventually(lambda: reports.seen == [True, False], 5, "the live router's change")
        await readiness.close()


async def test_a_new_client_at_the_same_address_is_watched_instead_of_the_old() -> None:
    reports = Reports()
    readiness = Readiness(reports)
    async with router(SERVING) as a:
        readiness.follow([a])
        await eventually(lambda: reports.seen == [True], 5, "ready")
        async with grpc.aio.insecure_channel(a.address) as channel:
            replaced = Router(a.address, health_pb2_grpc.HealthStub(channel), a.servicer, a.server)
            readiness.follow([replaced])
            assert readiness._clients[a.address] is replaced
            await a.servicer.set(EXPERTS_HEALTH, NOT_SERVING)
            await eventually(lambda: reports.seen[-1] is False, 5, "seen through the new client")
            await readiness.close()
