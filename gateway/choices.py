"""OpenAI's `n` and `logprobs` for the HTTP API: n admitted generations of one request streamed as one
response, and per-token logprobs in the completions (legacy) and chat shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from common.tokenizer import NoTokenizer, TextStream, Tokenizer
from gateway.core import Completion, GatewayCore, TextRequest
from gateway.router_client import Logprobs
from gateway.stream import Delta, RequestStream


def requests_for(prompts: list[TextRequest], n: int) -> list[TextRequest]:
    """The requests behind the choices of `prompts`, n each, in OpenAI's order: choice p * n + i is
    prompt p's i-th. With a seed, choice i of every prompt draws from seed + i, so a prompt gives
    the same choices in a list as alone, and every time; request ids get the choice's index as a
    suffix (but the first), since each must be unique."""
    if n == 1 and len(prompts) == 1:
        return prompts
    return [
        replace(
            r,
            params=replace(
                r.params, seed=None if r.params.seed is None else (r.params.seed + i) % 2**64
            ),
            request_id=f"{r.request_id}-{p * n + i}"
            if r.request_id and p * n + i
            else r.request_id,
        )
        for p, r in enumerate(prompts)
        for i in range(n)
    ]


class Choices:
    """The n admitted streams of one response. `open()` them, iterate `deltas()` for (choice index,
    Delta) as they come, and `aclose()` them however the response ends."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self.request_id = streams[0].request_id
        self._merged = self._merge()
        self._first: tuple[int, Delta] | None = None

    @classmethod
    async def open(cls, core: GatewayCore, requests: list[TextRequest]) -> Choices:
        """Admit every request together, or none (GatewayCore.start_all), and wait for the first
        delta: a failure before it raises here, so the client gets a status it can act on (the
        openai client retries a 503) instead of a 200 carrying an error event."""
        choices = cls(await core.start_all(requests))
        try:
            choices._first = await anext(choices._merged, None)
        except BaseException:
            await choices.aclose()
            raise
        return choices

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        if self._first is not None:
            yield self._first
            async for item in self._merged:
                yield item

    async def _merge(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.streams) == 1:  # the common case, without a queue and tasks per token
            async for d in self.streams[0]:
                yield 0, d
            return
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d))
                await queue.put((i, None))
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    running -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        try:
            await self._merged.aclose()
        finally:
            await asyncio.gather(*(s.aclose() for s in self.streams), return_exceptions=True)


async def complete_all(core: GatewayCore, requests: list[TextRequest]) -> list[Completion]:
    """Every request to its end; one failing cancels the others, and its error is the answer."""
    if len(requests) == 1:
        return [await core.complete(requests[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(core.complete(r)) for r in requests]
    except ExceptionGroup as e:
        raise e.exceptions[0] from None
    return [t.result() for t in tasks]


def completion_logprobs(
    logprobs: list[Logprobs] | None,
    tokenizer: Tokenizer | NoTokenizer,
    token_ids: list[int],
    offset: int,
) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), and
    text_offset (each token's start in the choice's text, from `offset`). As OpenAI's, each
    top_logprobs holds the sampled token too, so up to logprobs + 1 entries.

    Offsets come from decoding as the text was decoded, not from adding up the tokens' own texts:
    a special token is not in the text, and the bytes of one character split over tokens are one
    character there (each of its tokens alone decodes to U+FFFD)."""
    if logprobs is None:
        return None
    decoded = TextStream(tokenizer)  # type: ignore[arg-type]  # NoTokenizer decodes to ""
    offsets = []
    for t in token_ids:
        offsets.append(offset + len(decoded.text))
        decoded.push([t])
    return {
        "tokens": [tokenizer.token_text(t) for t in token_ids],
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [
            {tokenizer.token_text(i): v for i, v in with_sampled(t, lp, top)}
            for t, (lp, top) in zip(token_ids, logprobs)
        ],
        "text_offset": offsets,
    }


def with_sampled(
    token_id: int, logprob: float, top: Sequence[tuple[int, float]]
) -> list[tuple[int, float]]:
    """`top` (the most likely tokens, best first), with the sampled token last unless among them."""
    sampled = [] if any(i == token_id for i, _ in top) else [(token_id, logprob)]
    return [*top, *sampled]


def chat_logprobs(
    logprobs: list[Logprobs] | None, token_text: Callable[[int], str], token_ids: list[int]
) -> dict | None:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}. Unlike the
    legacy shape, top_logprobs holds exactly the top_logprobs most likely tokens, as OpenAI's chat
    does: the sampled token's logprob is the entry's own."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(token_ids, logprobs)
        ]
    }
