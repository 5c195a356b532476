"""OpenAI's `n` and `logprobs` for the HTTP API: n admitted generations of one request streamed as one
response, and per-token logprobs in the completions (legacy) and chat shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from common.tokenizer import NoTokenizer, TextStream, Tokenizer
from gateway.core import Delta, GatewayCore, Generation, TextRequest
from gateway.router_client import Logprobs


def requests_for(r: TextRequest, n: int) -> list[TextRequest]:
    """The n requests behind n choices. With a seed, choice i draws from seed + i, so the same request
    gives the same n choices every time; request ids get a suffix, since each must be unique."""
    if n == 1:
        return [r]
    return [
        replace(
            r,
            seed=None if r.seed is None else (r.seed + i) % 2**64,
            request_id=f"{r.request_id}-{i}" if r.request_id and i else r.request_id,
        )
        for i in range(n)
    ]


class Choices:
    """n admitted generations; iterate `deltas()` for (choice index, Delta) as they come."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self.request_id = generations[0].request_id

    @classmethod
    async def start(cls, core: GatewayCore, requests: list[TextRequest]) -> Choices:
        """Admit every request together, or none (GatewayCore.start_all)."""
        return cls(await core.start_all(requests))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.generations) == 1:  # the common case, without a queue and tasks per token
            async for d in self.generations[0]:
                yield 0, d
            return
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for d in gen:
                    await queue.put((i, d))
                await queue.put((i, None))
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
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
        await asyncio.gather(*(g.aclose() for g in self.generations), return_exceptions=True)


def completion_logprobs(
    logprobs: list[Logprobs] | None,
    tokenizer: Tokenizer | NoTokenizer,
    token_ids: list[int],
    offset: int,
) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), and
    text_offset (each token's start in the choice's text, from `offset`).

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
        "top_logprobs": [{tokenizer.token_text(i): v for i, v in top} for _, top in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(
    logprobs: list[Logprobs] | None, token_text: Callable[[int], str], token_ids: list[int]
) -> dict | None:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
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
