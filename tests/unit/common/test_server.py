"""GrpcServer.stop against a real server on loopback: its stages share one deadline."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.server import Deadline, GrpcServer, Service


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
    server = GrpcServer([endless_service()], grace_s=1.5)
    left: list[float] = []

    async def slow_deregistration(deadline: Deadline) -> None:
        await asyncio.sleep(1.0)
        left.append(deadline.remaining())

    server.on_stop.append(slow_deregistration)
    address = await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/test.Endless/Stream")(b"")
        await anext(aiter(call))
        t0 = time.monotonic()
        await server.stop()
        took = time.monotonic() - t0
        with pytest.raises(grpc.aio.AioRpcError) as cut:  # cancelled at the deadline
            await asyncio.wait_for(_drain(call), 2)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE  # gRPC's GOAWAY, on the client
    # The drain got what the hook left (0.5 s), not grace_s again: 1.5 s, not 2.5.
    assert 1.4 <= took < 2.3, took
    assert 0.3 <= left[0] <= 0.55


async def test_a_deadline_already_past_stops_at_once() -> None:
    server = GrpcServer([endless_service()], grace_s=10)
    address = await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/test.Endless/Stream")(b"")
        await anext(aiter(call))
        t0 = time.monotonic()
        await server.stop(Deadline.after(0))  # the caller's deadline, not grace_s
        assert time.monotonic() - t0 < 3  # not grace_s (10)
