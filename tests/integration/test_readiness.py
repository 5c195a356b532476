"""A real router and gateway: the gateway's HTTP /health/ready and its gRPC health service ("" and
Inference) say not-ready, together, exactly while the router lacks a replica of some expert, and
the router's own EXPERTS_HEALTH says why; a request sent meanwhile waits for the expert instead of
failing."""

from __future__ import annotations

import asyncio

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.status import EXPERTS_HEALTH
from gateway.app import SERVICE_NAME
from router_service.experts.backends import ColocatedExperts
from tests.support.meshes import local_mesh
from tests.support.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


async def _readiness(m, h: httpx.AsyncClient) -> tuple:
    """(HTTP /health/ready code, gateway "" and Inference health, the router's EXPERTS_HEALTH)."""
    return (
        (await h.get("/health/ready")).status_code,
        await _health(m.grpc_address, ""),
        await _health(m.grpc_address, SERVICE_NAME),
        await _health(m.router.server.address, EXPERTS_HEALTH),
    )


async def test_not_ready_exactly_while_an_expert_has_no_replica(checkpoint) -> None:
    path = checkpoint("mixtral")
    router = {"missing_expert_wait_s": 30.0}
    async with local_mesh(path, router) as m, httpx.AsyncClient(base_url=m.http_base_url) as h:
        ready = (200, SERVING, SERVING, SERVING)
        assert await _readiness(m, h) == ready
        placement = m.router.parts.tierer.placement
        every = placement.colocated
        # Layer 1's experts leave (as if their only group scaled to 0): every token needs them.
        placement.set_colocated(
            ColocatedExperts({p: w for p, w in every.weights.items() if p[0] != 1})
        )
        assert {layer for layer, _ in m.router.missing_experts()} == {1}
        unready = (503, NOT_SERVING, NOT_SERVING, NOT_SERVING)

        async def now() -> bool:
            return await _readiness(m, h) == unready

        await eventually(now, 5, "not ready, on HTTP and gRPC alike")
        body = {"model": m.gateway.core.served_names[0], "prompt": "hello", "max_tokens": 8}
        body |= {"temperature": 0, "ignore_eos": True}
        request = asyncio.ensure_future(h.post("/v1/completions", json=body, timeout=60))
        replicas = m.router.core.engine.model.dispatcher.replicas
        await eventually(lambda: replicas.waiting_for_experts, 10, "the request waits")
        assert not request.done()  # waiting for the experts, not failed
        placement.set_colocated(every)  # the experts are back

        async def back() -> bool:
            return await _readiness(m, h) == ready

        await eventually(back, 5, "ready again")
        reply = await asyncio.wait_for(request, 60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
