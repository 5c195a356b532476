"""GrpcServer against a real server on loopback: a stop's stages share one deadline, on the
server's clock (a fake one here); the plaintext health port."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server import LIVENESS, Deadline, GrpcServer, Service
from moe_mesh.local import certs


def endless_service() -> Service:
    """test.Endless/Stream: a message every 20 ms, never the last."""

    async def stream(request: bytes, context):
        while True:
            await asyncio.sleep(0.02)
            yield b"x"

    handler = grpc.method_handlers_generic_handler(
        "test.Endless", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    return Service(
        "test.Endless", lambda _, server: server.add_generic_rpc_handlers((handler,)), None
    )


async def _drain(call) -> None:
    async for _ in call:
        pass


async def test_stop_hooks_and_the_drain_share_one_grace_period() -> None:
    """The hook spends 99.8 of the 100 s grace period (on a fake clock): the drain gets the 0.2 s
    left, not grace_s again (which would outlast the 30 s guard)."""
    now = [1000.0]
    server = GrpcServer([endless_service()], grace_s=100, clock=lambda: now[0])
    left: list[float] = []

    async def slow_deregistration(deadline: Deadline) -> None:
        now[0] += 99.8
        left.append(deadline.remaining())

    server.on_stop.append(slow_deregistration)
    address = await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/test.Endless/Stream")(b"")
        await anext(aiter(call))
        await asyncio.wait_for(server.stop(), 30)
        with pytest.raises(grpc.aio.AioRpcError) as cut:  # cancelled at the deadline
            await asyncio.wait_for(_drain(call), 30)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE  # gRPC's GOAWAY, on the client
    assert left == [pytest.approx(0.2)]


async def test_a_deadline_already_past_stops_at_once() -> None:
    server = GrpcServer([endless_service()], grace_s=3600)
    address = await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/test.Endless/Stream")(b"")
        await anext(aiter(call))
        # The caller's deadline, not grace_s (an hour, far past the guard).
        await asyncio.wait_for(server.stop(Deadline.after(0)), 30)
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await asyncio.wait_for(_drain(call), 30)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_deadline_counts_down_on_its_clock() -> None:
    now = [5.0]
    deadline = Deadline.after(2.0, clock=lambda: now[0])
    assert (deadline.at, deadline.remaining()) == (7.0, 2.0)
    now[0] = 6.5
    assert deadline.remaining() == 0.5
    now[0] = 9.0
    assert deadline.remaining() == 0.0  # never negative


async def test_the_health_port_serves_the_same_statuses_in_plaintext_and_nothing_else(
    tmp_path,
) -> None:
    """Under mutual TLS a plaintext client reaches only the health port, which tells it what the
    main port's health service says (Kubernetes' gRPC probe has no TLS)."""
    certs.create(tmp_path, ["expert"])
    tls = certs.mesh_tls(tmp_path, "expert")
    server = GrpcServer(
        [endless_service()], grace_s=0.1, credentials=tls.server_credentials(), health_port=0
    )
    await server.start()
    try:
        assert server.bound_health_port not in (0, server.bound_port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_health_port}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            for name in ("", "test.Endless", LIVENESS):
                reply = await check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:  # the service itself is not there
                await ch.unary_stream("/test.Endless/Stream")(b"").read()
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with grpc.aio.insecure_channel(server.address) as ch:  # the main port wants TLS
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
    finally:
        await server.stop()
    assert server._health_server is None
