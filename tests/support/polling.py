"""Bounded polling instead of sleeps: wait for a condition or an expert service's call counter."""

from __future__ import annotations

import asyncio
import inspect
import time

import grpc

from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc


async def calls(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await expert_pb2_grpc.ExpertServiceStub(channel).Describe(
            expert_pb2.DescribeRequest(), timeout=5
        )
        return reply.stats.forward_calls


async def eventually(predicate, timeout_s: float = 15.0, what: str = "") -> None:
    """Poll `predicate` (plain or async) until it is true, for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def wait_until(predicate, timeout_s: float = 15.0, what: str = "") -> None:
    """`eventually` for synchronous tests (a subprocess's log, a file): poll for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def takes_calls(address: str) -> bool:
    try:
        return await calls(address) > 0
    except grpc.aio.AioRpcError:
        return False
