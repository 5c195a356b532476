"""common/fastpath/server.py: an in-process FrameServer answering a FrameClient on loopback handles
each request in its own task, answers a handler's error or a call past its budget with an error
frame and serves the next call, and lets the calls in flight answer while it stops."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from common.errors import DeadlineExceededError, UnavailableError
from common.fastpath import frame as f
from common.fastpath import parse_worker_url, ucx
from common.fastpath.client import FrameClient
from common.fastpath.server import FrameServer
from common.fastpath.ucx import load_ucxx

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None, reason=f"UCX fast path unavailable: {ucx.unavailable}"
)
MESSAGE_BYTES = 1 << 20
CALL = f.RequestHeader("m", "c", 1, [0], [2], "float32", [2, 4], 32)
GUARD_S = 30  # only a hang reaches it


async def serving(handler) -> tuple[FrameServer, FrameClient]:
    server = FrameServer(handler, MESSAGE_BYTES)
    return server, FrameClient(parse_worker_url(await server.start()), MESSAGE_BYTES)


async def test_a_handler_bug_is_answered_internal_and_the_next_call_served() -> None:
    async def handler(header, payload):
        if header.layer == 1:
            return payload.double()  # no frame carries float64: the caller must still hear back
        if header.layer == 2:
            raise RuntimeError("a bug in the core")
        return payload

    server, client = await serving(handler)
    try:
        x = torch.randn(2, 4)
        # INTERNAL from a peer is raised as over gRPC: unavailable, so the router fails over.
        with pytest.raises(UnavailableError, match="INTERNAL: .*float64"):
            await client.call(CALL, x, 5.0)
        with pytest.raises(UnavailableError, match="INTERNAL: .*a bug in the core"):
            await client.call(replace(CALL, layer=2), x, 5.0)
        out, _ = await client.call(replace(CALL, layer=3), x, 5.0)
        assert torch.equal(out, x) and (server.errors, server.frames) == (2, 1)
    finally:
        client.close()
        await server.stop()


async def test_a_call_past_its_budget_is_answered_deadline_exceeded_and_the_next_one_served() -> (
    None
):
    calls = []

    async def handler(header, payload):
        calls.append(header.layer)
        if header.layer == 1:
            await asyncio.Event().wait()  # only the call's budget ends it
        return payload

    server, client = await serving(handler)
    try:
        x = torch.randn(2, 4)
        slow = replace(CALL, timeout_ms=50.0)
        # The server's answer, not the client's own timeout (an hour) running out.
        with pytest.raises(DeadlineExceededError, match="50 ms budget"):
            await asyncio.wait_for(client.call(slow, x, 3600.0), GUARD_S)
        out, _ = await client.call(replace(slow, layer=2), x, 5.0)
        assert torch.equal(out, x) and calls == [1, 2]
    finally:
        client.close()
        await server.stop()


async def test_a_clients_concurrent_calls_are_handled_at_once() -> None:
    """Each call waits until all three have reached the handler: one at a time, none would end."""
    arrived: list[int] = []
    everyone = asyncio.Event()

    async def handler(header, payload):
        arrived.append(header.layer)
        if len(arrived) == 3:
            everyone.set()
        await everyone.wait()
        return payload * header.layer

    server, client = await serving(handler)
    try:
        x = torch.randn(2, 4)
        outs = await asyncio.wait_for(
            asyncio.gather(*(client.call(replace(CALL, layer=i), x, 60.0) for i in (1, 2, 3))),
            GUARD_S,
        )
        assert all(torch.equal(o, x * i) for (o, _), i in zip(outs, (1, 2, 3)))
        assert sorted(arrived) == [1, 2, 3]
    finally:
        client.close()
        await server.stop()


async def test_stopping_lets_the_calls_in_flight_answer() -> None:
    started, finish = asyncio.Event(), asyncio.Event()

    async def handler(header, payload):
        started.set()
        await finish.wait()
        return payload + 1

    server, client = await serving(handler)
    try:
        x = torch.randn(2, 4)
        call = asyncio.create_task(client.call(CALL, x, 60.0))
        await asyncio.wait_for(started.wait(), GUARD_S)
        stopping = asyncio.create_task(server.stop(drain_s=3600.0))
        await asyncio.sleep(0)
        assert not stopping.done() and not call.done()  # waiting for the call, not cutting it
        finish.set()
        out, _ = await asyncio.wait_for(call, GUARD_S)
        assert torch.equal(out, x + 1)
        await asyncio.wait_for(stopping, GUARD_S)
        assert not server.running
    finally:
        client.close()
        await server.stop()
