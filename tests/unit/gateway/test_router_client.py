"""RouterClient against a real gRPC server: a stream cut off by its channel closing (the gateway
drops a router that left the registry) fails over like a lost router, not as a cancellation; the
check of an ejected router."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.errors import (
    DeadlineExceededError,
    ExpertUnavailableError,
    UnavailableError,
)
from common.sampling import SamplingParams
from common.status import abort_with
from gateway.balancer import RouterLostError
from gateway.router_client import RouterClient, RouterRequest
from protos.moe_mesh.v1 import router_pb2
from tests.support.fakes import router_serving


async def test_a_stream_whose_channel_closes_under_it_is_a_lost_router() -> None:
    async def generate(request: bytes, context):  # a router that streams slowly
        for _ in range(100):
            await asyncio.sleep(0.05)
            yield router_pb2.RouterGenerateResponse(token_ids=[5]).SerializeToString()

    async with router_serving(generate) as address:
        client = RouterClient(address, 1 << 20)
        request = RouterRequest("r1", [1, 2], SamplingParams(max_tokens=100))
        got = []
        with pytest.raises(RouterLostError, match="left mid-stream"):
            async for chunk in client.generate(request, timeout_s=30):
                got.append(chunk)
                if len(got) == 2:
                    asyncio.get_running_loop().call_soon(
                        lambda: asyncio.ensure_future(client.close())
                    )
        assert len(got) >= 2
        # Cancelling the reader itself (its client left) stays a cancellation.
        client = RouterClient(address, 1 << 20)
        reader = asyncio.create_task(anext(client.generate(request, timeout_s=30)))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await client.close()


async def test_a_router_whose_experts_are_unavailable_is_not_a_lost_router() -> None:
    async def generate(request: bytes, context):
        await abort_with(context, error)
        yield b""  # never reached: makes this an async generator, as a streaming handler is

    request = RouterRequest("r1", [1, 2], SamplingParams(max_tokens=4))
    async with router_serving(generate) as address:
        client = RouterClient(address, 1 << 20)
        error = ExpertUnavailableError(1, [2, 3])  # the gateway keeps this router
        with pytest.raises(UnavailableError, match="layer 1 expert") as info:
            await anext(client.generate(request, timeout_s=10))
        assert not isinstance(info.value, RouterLostError)
        error = UnavailableError("the router is going away")  # this one fails over
        with pytest.raises(RouterLostError):
            await anext(client.generate(request, timeout_s=10))
        await client.close()


async def test_a_check_needs_serving_health_and_gives_the_model_it_serves() -> None:
    """RouterClient.check, which re-admits an ejected router: a router whose engine loop gave up
    says NOT_SERVING while it still answers Status, and must stay out."""

    async def status(request: bytes, context) -> bytes:
        return router_pb2.RouterStatus(model_id="m").SerializeToString()

    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    handler = grpc.method_handlers_generic_handler(
        "moe_mesh.v1.RouterService", {"Status": grpc.unary_unary_rpc_method_handler(status)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RouterClient(f"127.0.0.1:{port}", 1 << 20)
    try:
        assert await client.check(5.0) == "m"
        await health_servicer.enter_graceful_shutdown()
        with pytest.raises(UnavailableError, match="NOT_SERVING"):
            await client.check(5.0)
        await server.stop(0)
        with pytest.raises(DeadlineExceededError):  # gone: waits for the channel till its timeout
            await client.check(0.2)
    finally:
        await server.stop(0)
        await client.close()
