"""Router stand-ins for gateway tests: for the core (the RouterBackend protocol) and a core wired to
them, and a gRPC server with a scripted RouterService for a gateway's RouterClient."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.status import EXPERTS_HEALTH
from common.telemetry import OFF, Telemetry
from common.tokenizer import Tokenizer
from gateway.balancer import RouterLostError
from gateway.core import GatewayCore, ModelInfo
from gateway.router_client import Chunk
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import router_pb2


class FakeRouter:
    """Answers every request with `n` tokens, one per message, after an optional gate opens."""

    def __init__(self, address: str, gate: asyncio.Event | None = None) -> None:
        self.address, self.gate, self.outstanding, self.served = address, gate, 0, []

    async def generate(self, request, timeout_s, trace_context=None):
        self.outstanding += 1
        try:
            self.served.append(request.request_id)
            if self.gate is not None:
                await self.gate.wait()
            n = request.params.max_tokens
            for i in range(n):
                yield Chunk(
                    [5 + i], "length" if i == n - 1 else None, len(request.prompt_token_ids), i + 1
                )
        finally:
            self.outstanding -= 1


def core(path, routers, telemetry: Telemetry = OFF, **settings) -> GatewayCore:
    s = GatewaySettings(checkpoint=path, routers=[r.address for r in routers], **settings)
    return GatewayCore(s, Tokenizer(path), routers, ModelInfo("m", "mixtral", 512, 512), telemetry)


class ScriptedRouter:
    """Token at absolute position p is 5 + p % 400, so a continuation elsewhere gives the same tokens.

    `dies_after`: raise RouterLostError (what a killed router looks like) after that many tokens;
    `refuses`: every call fails before its first token; `no_finish`: the stream just ends."""

    def __init__(
        self,
        address: str,
        dies_after: int | None = None,
        refuses: bool = False,
        no_finish: bool = False,
    ) -> None:
        self.address, self.outstanding, self.calls = address, 0, []
        self.dies_after, self.refuses, self.no_finish = dies_after, refuses, no_finish
        self.model, self.checks = "m", 0

    async def generate(self, request, timeout_s, trace_context=None):
        self.calls.append(request)
        self.outstanding += 1
        try:
            if self.refuses:
                raise RouterLostError("UNAVAILABLE: failed to connect to all addresses")
            start, n = len(request.prompt_token_ids), request.params.max_tokens
            for i in range(n):
                if self.dies_after is not None and i == self.dies_after:
                    raise RouterLostError("UNAVAILABLE: Stream removed")
                last = i == n - 1 and not self.no_finish
                yield Chunk([5 + (start + i) % 400], "length" if last else None, start, i + 1)
                await asyncio.sleep(0)
        finally:
            self.outstanding -= 1

    async def check(self, timeout_s):
        """The model it serves; a refusing router fails its checks too."""
        self.checks += 1
        if self.refuses:
            raise RouterLostError("UNAVAILABLE: failed to connect to all addresses")
        return self.model


@asynccontextmanager
async def router_serving(
    generate, status: router_pb2.RouterStatus | None = None
) -> AsyncIterator[str]:
    """A gRPC server on loopback whose RouterService.Generate is `generate` (bytes in, bytes out)
    and whose Status answers `status` (what a gateway asks a router at start-up), with a health
    service saying it serves every expert (what a gateway's readiness watches); its address."""

    async def answer_status(request: bytes, context) -> bytes:
        assert status is not None, "this fake router answers no Status"
        return status.SerializeToString()

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "moe_mesh.v1.RouterService",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(generate),
            "Status": grpc.unary_unary_rpc_method_handler(answer_status),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set(EXPERTS_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
