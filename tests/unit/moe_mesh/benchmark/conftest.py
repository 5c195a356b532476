"""A fake OpenAI-compatible gateway on port 0 (real HTTP, real SSE) for the benchmark's client and load tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

TOKEN_S = 0.005


@dataclass
class FakeGateway:
    url: str
    in_flight: int = 0
    most_in_flight: int = 0
    bodies: list | None = None
    token_s: float = TOKEN_S


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    """Streams `max_tokens` one-token chunks, `token_s` apart, then usage and [DONE]; counts what is in flight."""
    g = FakeGateway("", bodies=[])

    async def models(request: web.Request) -> web.Response:
        data = [{"id": "fake", "max_model_len": 64, "vocab_size": 100}]
        return web.json_response({"object": "list", "data": data})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        g.bodies.append(body)
        if body["max_tokens"] > 50:
            error = {"message": "max_tokens: too many", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        g.in_flight += 1
        g.most_in_flight = max(g.most_in_flight, g.in_flight)
        try:
            r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await r.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(g.token_s)
                chunk = {"choices": [{"text": "x", "token_ids": [i]}], "usage": None}
                if (
                    body["max_tokens"] == 7 and i == 3
                ):  # a stream that fails half-way, as OpenAI reports it
                    chunk = {"error": {"message": "UNAVAILABLE: router gone"}}
                await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await r.write(
                b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            )
            await r.write(b"data: [DONE]\n\n")
            return r
        finally:
            g.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    g.url = f"http://{host}:{port}"
    yield g
    await runner.cleanup()
