"""Router-service helpers: a greedy request for a reference prompt, a whole stream, polling Status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from protos.moe_mesh.v1 import router_pb2, types_pb2
from tests.support.reference import PROMPTS

LENGTH = types_pb2.FINISH_REASON_LENGTH


def request(
    i: int, max_tokens: int = 32, request_id: str | None = None, **params
) -> router_pb2.RouterGenerateRequest:
    sampling = router_pb2.SamplingParams(
        **{"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True, **params}
    )
    return router_pb2.RouterGenerateRequest(
        request_id=request_id or f"r{i}", prompt_token_ids=PROMPTS[i], params=sampling
    )


async def generate(
    stub, req: router_pb2.RouterGenerateRequest, timeout: float = 20.0
) -> tuple[tuple[int, ...], int]:
    """The whole stream: every token and the finish reason of the last message."""
    tokens, reason = [], None
    async for msg in stub.Generate(req, timeout=timeout):
        tokens += msg.token_ids
        reason = msg.finish_reason
    return tuple(tokens), reason


async def wait_status(
    stub, ok: Callable[[router_pb2.RouterStatus], bool], timeout_s: float
) -> router_pb2.RouterStatus:
    """Poll Status until `ok` holds; fail with the last status after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = await stub.Status(router_pb2.RouterStatusRequest(), timeout=5)
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"router status did not settle in {timeout_s}s: {st}"
        await asyncio.sleep(0.05)
