"""Running an OpenAI request's generations and answering in OpenAI's shapes: one JSON response, or
Server-Sent Events of chunks as they come. A request runs each of its prompts n times; choice
p * n + i is prompt p's i-th (OpenAI's and vLLM's order), in the response's list and in every chunk.
The endpoints (gateway/http_api.py) say how a choice is spelled, through a `Shape`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common import errors
from gateway import http_edge
from gateway.choices import Choices, complete_all, requests_for
from gateway.core import GatewayCore, TextRequest
from gateway.openai_schema import Body
from gateway.stream import Delta

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Shape:
    """How one endpoint spells its responses."""

    id_prefix: str
    object: str
    chunk_object: str
    chunk: Callable[[Delta, int, bool], dict]  # (delta, index, its first) -> a streamed choice
    whole: Callable[[Delta, int], dict]  # (a whole generation as one delta, index) -> the choice


def usage(finals: dict[int, Delta], n: int) -> dict:
    """Every prompt once (the first choice of each), the completions of every choice."""
    prompt = sum(d.prompt_tokens for i, d in finals.items() if i % n == 0)
    completion = sum(d.completion_tokens for d in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# JSON leaves these unescaped, and SSE does not end a line at them, but Python clients that split a
# stream with str.splitlines (httpx's aiter_lines, requests' iter_lines) do: a token decoding to one
# would cut its event in two. Escaped, the event reads back the same.
_SPLITLINES_ONLY = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def sse(obj: dict) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_SPLITLINES_ONLY)
    return b"data: " + text.encode() + b"\n\n"


def token_ids(on: bool, ids: list[int]) -> dict:
    return {"token_ids": ids} if on else {}


async def answer(
    request: Request, body: Body, prompts: list[TextRequest], shape: Shape
) -> Response:
    """Run each of `prompts` n times and answer in `shape`."""
    core: GatewayCore = request.app.state.core
    n = 1 if body.n is None else body.n
    if not 1 <= n <= core.settings.max_choices:
        raise errors.InvalidArgumentError(
            "n", f"must be in [1, {core.settings.max_choices}], got {n}"
        )
    if len(prompts) > 1 and len(prompts) * n > core.settings.max_in_flight:
        # Streamed, they are admitted together; whole, more would queue behind each other.
        raise errors.InvalidArgumentError(
            "prompt",
            f"{len(prompts)} prompts with n={n} are {len(prompts) * n} generations, and this "
            f"gateway runs at most max_in_flight={core.settings.max_in_flight} at once",
        )
    # The key's priority cap and rate: each prompt counts as a request, n choices once.
    priority = request.state.caller.admit(body.priority, len(prompts))
    requests = requests_for([replace(r, priority=priority) for r in prompts], n)
    if body.stream:
        return await _streamed(request, body, requests, n, shape)
    return await _whole(request, body, requests, n, shape)


async def _streamed(
    request: Request, body: Body, requests: list[TextRequest], n: int, shape: Shape
) -> Response:
    """Validation, admission and a failure before the first token are answered with an HTTP status,
    before any SSE byte; a failure after it with an error event."""
    core: GatewayCore = request.app.state.core
    choices = await until_disconnect(request, Choices.open(core, requests))
    if choices is None:
        return Response(status_code=499)  # the client left while queued or prefilling
    head = {
        "id": shape.id_prefix + choices.request_id,
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": core.served_names[0],
    }
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return EventStream(choices, events(core, choices, head, include_usage, n, shape.chunk))


async def _whole(
    request: Request, body: Body, requests: list[TextRequest], n: int, shape: Shape
) -> Response:
    core: GatewayCore = request.app.state.core
    done = await until_disconnect(request, complete_all(core, requests))
    if done is None:
        return Response(status_code=499)
    wholes = [
        Delta(
            c.request_id,
            c.token_ids,
            c.text,
            c.finish_reason,
            c.prompt_tokens,
            c.completion_tokens,
            c.logprobs,
        )
        for c in done
    ]
    choices = [shape.whole(d, i) for i, d in enumerate(wholes)]
    extra = {}
    if body.return_token_ids and len(requests) == n:
        extra["prompt_token_ids"] = done[0].prompt_token_ids
    elif body.return_token_ids:  # several prompts: each choice says which it continued
        for choice, c in zip(choices, done):
            choice["prompt_token_ids"] = c.prompt_token_ids
    return JSONResponse(
        {
            "id": shape.id_prefix + done[0].request_id,
            "object": shape.object,
            "created": int(time.time()),
            "model": core.served_names[0],
            "choices": choices,
            "usage": usage(dict(enumerate(wholes)), n),
            **extra,
        }
    )


class EventStream(StreamingResponse):
    """Server-Sent Events over admitted choices, closed however the response ends."""

    def __init__(self, choices: Choices, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.choices, self.events = choices, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # On disconnect Starlette cancels the body task but closes neither the iterator nor the
            # streams, whose admission place would then stay taken until garbage collection.
            # Close both here, shielded: this runs inside the cancelled scope.
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]
                await self.choices.aclose()


async def events(
    core: GatewayCore,
    choices: Choices,
    head: dict,
    include_usage: bool,
    n: int,
    choice: Callable[[Delta, int, bool], dict],
) -> AsyncIterator[bytes]:
    """OpenAI chunk stream: one chunk per delta of any choice, an optional usage chunk, then [DONE]."""
    last: dict[int, Delta] = {}
    extra = {"usage": None} if include_usage else {}
    try:
        async for i, d in choices.deltas():
            yield sse({**head, "choices": [choice(d, i, i not in last)], **extra})
            last[i] = d
    except errors.MoeMeshError as e:  # the status line is long gone: report in-band, as OpenAI does
        log.info("stream %s failed: %s", choices.request_id, e)
        core.count_failure(e)
        yield sse(http_edge.error_body(e)[1])
    else:
        if include_usage and last:
            yield sse({**head, "choices": [], "usage": usage(last, n)})
    yield b"data: [DONE]\n\n"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (None) if the client goes away first.

    Starlette keeps running a handler whose client left; without this, an abandoned request would
    keep its admission place and router slot until it finished. `work` runs as a task of its own
    and is cancelled once, as asyncio cancels, so what it opened it closes to the end.
    """
    job = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((job, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not job.done():
            job.cancel()
            await asyncio.wait((job,))
    return None if job.cancelled() else job.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
