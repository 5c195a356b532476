"""common/fastpath/client.py: a FrameClient against an in-process FrameServer on loopback keeps a
connection for its calls, leaves the other calls on it alone when one is given up on or times out,
says which failure sent a call back to gRPC (FastPathError.cause), and refuses calls once closed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from common.fastpath import frame as f
from common.fastpath import parse_worker_url, ucx
from common.fastpath.client import FastPathError, FrameClient
from common.fastpath.server import FrameServer
from common.fastpath.ucx import load_ucxx
from tests.support.fastpath import speak_previous_frame_version
from tests.support.polling import eventually

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None, reason=f"UCX fast path unavailable: {ucx.unavailable}"
)
MESSAGE_BYTES = 16 * 1024 * 1024
HIDDEN = 64


async def test_a_call_given_up_on_leaves_the_calls_sharing_its_connection_alone() -> None:
    """A hedge race's loser is cancelled, a slow call times out: the other calls in flight on the
    connection still finish over UCX (they fell back to gRPC, computed twice, and backed off)."""
    gates = {layer: asyncio.Event() for layer in range(1, 6)}

    async def handler(header, payload):
        if header.layer in (3, 4, 2):  # held until the test lets them go
            await gates[header.layer].wait()
        return payload * header.layer

    server = FrameServer(handler, MESSAGE_BYTES)
    client = FrameClient(parse_worker_url(await server.start()), MESSAGE_BYTES)
    x = torch.randn(1000, HIDDEN)  # a reply past UCX's eager size: rendezvous, held if unread
    call = f.RequestHeader("m", "c", 1, [0], [1000], "float32", [1000, HIDDEN], x.nbytes)

    async def answer(layer: int, timeout_s: float = 30.0) -> torch.Tensor:
        return (await client.call(replace(call, layer=layer), x, timeout_s))[0]

    try:
        await answer(1)
        conn = client._conn
        # Cancelled: the connection stays, and the reply is read when it comes.
        loser, other = asyncio.ensure_future(answer(3)), asyncio.ensure_future(answer(4))
        await eventually(lambda: len(conn.pending) == 2, 5, "both calls sent")
        loser.cancel()
        gates[3].set()
        gates[4].set()
        assert torch.equal(await other, x * 4) and loser.cancelled()
        await eventually(lambda: not conn.abandoned, 5, "the reply given up on, read")
        assert client._conn is conn and not conn.pending
        assert torch.equal(await answer(1), x)  # its tag does not hold a stale reply
        # Timed out: the calls in flight finish on it, new ones take a new connection.
        gates[4].clear()
        other = asyncio.ensure_future(answer(4))
        with pytest.raises(FastPathError, match="no reply within 0.1s") as late:
            await answer(2, 0.1)  # held: its reply never comes in time
        assert late.value.cause == "timeout" and client._conn is None
        assert torch.equal(await answer(5), x * 5) and client._conn not in (None, conn)
        gates[4].set()
        gates[2].set()
        assert torch.equal(await other, x * 4)
        await eventually(lambda: conn.closed, 5, "the retired connection closed")
    finally:
        client.close()
        await server.stop()


async def test_an_old_frame_version_peer_is_a_version_failure(monkeypatch) -> None:
    """A service speaking the previous frame version: it refuses our frame, in its own version."""
    old_version = speak_previous_frame_version(monkeypatch)
    old = FrameServer(lambda header, payload: None, MESSAGE_BYTES)
    client = FrameClient(parse_worker_url(await old.start()), MESSAGE_BYTES)
    try:
        header = f.RequestHeader("m", "c", 0, [0], [2], "float32", [2, 4], 32)
        with pytest.raises(FastPathError) as info:
            await client.call(header, torch.randn(2, 4), 2.0)
        assert info.value.cause == "version"
        assert f"version {old_version} is not supported" in str(info.value)
    finally:
        client.close()
        await old.stop()


async def test_calls_share_one_connection_and_a_closed_client_refuses_them() -> None:
    async def handler(header, payload):
        return payload + header.layer

    server = FrameServer(handler, MESSAGE_BYTES)
    client = FrameClient(parse_worker_url(await server.start()), MESSAGE_BYTES)
    try:
        x = torch.randn(3, 4)
        call = f.RequestHeader("m", "c", 0, [0], [3], "float32", [3, 4], x.nbytes)
        outs = await asyncio.gather(
            *(client.call(replace(call, layer=i), x, 30.0) for i in range(4))
        )
        assert all(torch.equal(out, x + i) for i, (out, _) in enumerate(outs))
        assert client._conn is not None and client._conn.calls == 4 and len(server.clients) == 1
        client.close()
        with pytest.raises(FastPathError) as info:
            await client.call(call, x, 30.0)
        assert info.value.cause == "closed" and server.frames == 4
    finally:
        client.close()
        await server.stop()
