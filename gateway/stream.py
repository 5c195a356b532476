"""One admitted generation as one object: `RequestStream` owns the tokens sent to its client, their
detokenization and stop strings, failover from a failing router to another, the cut-off that ends
it from outside, its metrics and span, and its admission place. The core creates it; both APIs
iterate it and close it.

    async with await core.start(TextRequest(prompt="Hello")) as stream:
        async for delta in stream: ...  # a Delta per router message; the last has finish_reason
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode, Tracer

from common.errors import DeadlineExceededError, MoeMeshError, UnavailableError
from common.status import status_code
from common.telemetry import (
    REQUEST_DURATION,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    Telemetry,
)
from common.tokenizer import NoTokenizer, TextStream, Tokenizer
from gateway.balancer import Balancer, RouterLostError
from gateway.router_client import Chunk, Logprobs, RouterBackend, RouterRequest

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """What a request produced since the previous delta; the last one has finish_reason set."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[Logprobs] | None = None  # one per token of token_ids, when asked for


class StreamMeters:
    """The per-request instruments every stream of a gateway records into, and its tracer."""

    def __init__(self, telemetry: Telemetry, model_id: str) -> None:
        self.tracer: Tracer | None = telemetry.tracer
        self.model_id = model_id
        self.duration = telemetry.latency(
            REQUEST_DURATION, "request from admission to its last token"
        )
        self.ttft = telemetry.latency(TIME_TO_FIRST_TOKEN, "request start to its first token")
        self.tpot = telemetry.latency(
            TIME_PER_OUTPUT_TOKEN, "mean time between a request's output tokens"
        )

    def span(self, request: RouterRequest) -> Span | None:
        """The request's span, under the RPC's server span if there is one; None when not sampled."""
        if self.tracer is None:
            return None
        p = request.params
        span = self.tracer.start_span(
            "moe.gateway.request",
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": self.model_id,
                "gen_ai.request.id": request.request_id,
                "gen_ai.request.max_tokens": p.max_tokens,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            },
        )
        return span if span.is_recording() else None


@dataclass(frozen=True)
class Streaming:
    """What the streams of one gateway share; `routers` gives the replicas of the moment."""

    tokenizer: Tokenizer | NoTokenizer
    balancer: Balancer
    routers: Callable[[], Sequence[RouterBackend]]
    router_attempts: int
    meters: StreamMeters
    clock: Callable[[], float] = time.monotonic


class RequestStream:
    """An admitted request. Iterate it (from one task at a time) for Deltas; `aclose()`, or leaving
    `async with`, cancels what is left of it and gives its admission place back, once."""

    def __init__(
        self,
        shared: Streaming,
        request: RouterRequest,
        stop: Sequence[str],
        deadline: float,
        began: float,
        release: Callable[[RequestStream], None],
    ) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.sent: list[int] = []  # token ids already given to the client
        self._shared, self._request, self._deadline, self._began = shared, request, deadline, began
        self._text = TextStream(shared.tokenizer, stop)  # type: ignore[arg-type]
        self._release: Callable[[RequestStream], None] | None = release
        self._span: Span | None = None  # from the first step on: a stream never read has none
        self._first: float | None = None  # when the first token came
        # The cut-off: cut() sets `_error`; a task suspended in the wait for the router's next
        # message (`_waiting`) is cancelled, and that cancellation becomes `_error`.
        self._error: Exception | None = None
        self._task: asyncio.Task | None = None
        self._waiting = self._cancelled = False
        self._inner = self._from_routers()
        self._outer = self._observed()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._outer

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            await self._outer.aclose()
            await self._inner.aclose()  # closes the router call in flight, if any
        finally:
            if self._release is not None:
                release, self._release = self._release, None
                release(self)

    # -- the cut-off ---------------------------------------------------------------------------

    def cut(self, error: Exception) -> None:
        """End the stream with `error` (the first cut's), which its API reports like any other
        (an SSE error event, a gRPC status). Its reader gets it at once if it is waiting for the
        router, else at its next step. Shutdown past its grace period cuts what still streams."""
        if self._error is not None:
            return
        self._error = error
        if self._waiting and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    async def _next(self) -> Delta | None:
        """The next delta, None at the end; a cut during the wait raises its error instead."""
        if self._error is not None:
            raise self._error
        # Each wait's own task: an HTTP stream's first delta is awaited by its handler and the rest
        # by its response's task. A flag, not a wrapping context manager: it costs nothing per token.
        self._task, self._waiting = asyncio.current_task(), True
        try:
            return await self._inner.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if self._cut_caused_it():
                raise self._error from None  # type: ignore[misc]
            raise
        finally:
            self._waiting = False

    def _cut_caused_it(self) -> bool:
        """Whether cut() alone cancelled the wait. Takes back cut()'s cancellation request; one from
        elsewhere as well (the client left just then) keeps it a cancellation."""
        if not self._cancelled or self._task is None:
            return False
        self._cancelled = False
        return self._task.uncancel() == 0

    # -- metrics -------------------------------------------------------------------------------

    async def _observed(self) -> AsyncIterator[Delta]:
        """The deltas, recording time to first token, time per token, duration and the span."""
        status, self._span = "OK", self._shared.meters.span(self._request)
        try:
            while (delta := await self._next()) is not None:
                self._observe(delta)
                yield delta
        except MoeMeshError as e:
            status = status_code(e).name
            if self._span is not None:
                self._span.record_exception(e)
                self._span.set_status(StatusCode.ERROR, str(e))
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            elapsed = self._shared.clock() - self._began
            self._shared.meters.duration.record(elapsed, {"rpc.grpc.status_code": status})
            if self._span is not None:
                self._span.end()

    def _observe(self, delta: Delta) -> None:
        meters, now = self._shared.meters, self._shared.clock()
        if self._first is None and delta.token_ids:
            self._first = now
            meters.ttft.record(now - self._began)
        if delta.finish_reason is None:
            return
        if self._span is not None:
            self._span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": delta.completion_tokens,
                    "gen_ai.response.finish_reasons": [delta.finish_reason],
                }
            )
        if self._first is not None and delta.completion_tokens > 1:
            meters.tpot.record((now - self._first) / (delta.completion_tokens - 1))

    # -- failover ------------------------------------------------------------------------------

    async def _from_routers(self) -> AsyncIterator[Delta]:
        """The deltas from one router or, when routers fail under the request, from several in turn.

        A call that fails with UNAVAILABLE (router dead, unreachable, shutting down) moves to another
        router, within the deadline, `router_attempts` and the retry budget. It continues from the
        prompt plus the tokens already sent, with the same seed and the remaining max_tokens, so the
        client sees one uninterrupted stream: each token once, the right finish reason and usage.
        """
        shared, rid = self._shared, self.request_id
        shared.balancer.budget.request()
        tried: list[str] = []
        for attempt in range(shared.router_attempts):
            router = shared.balancer.pick(shared.routers(), tried)
            tried.append(router.address)
            if self._deadline - shared.clock() <= 0:
                raise DeadlineExceededError(
                    f"request {rid} passed its deadline before reaching a router"
                )
            if len(self.sent) >= self._request.params.max_tokens:  # died right after the last
                yield self._delta(Chunk([], "length", 0, 0), len(self.sent))
                return
            deltas = self._from_router(router, attempt)
            try:
                async for delta in deltas:
                    yield delta
                return
            except RouterLostError as e:
                self._fail_over(router, attempt, e)
            finally:
                await deltas.aclose()  # when this one is closed early: ends the router call now
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _from_router(self, router: RouterBackend, attempt: int) -> AsyncIterator[Delta]:
        """One router call's deltas, up to the finish reason (or a stop string)."""
        base = len(self.sent)
        chunks = router.generate(
            self._continuation(attempt),
            self._deadline - self._shared.clock(),
            trace.set_span_in_context(self._span) if self._span is not None else None,
        )
        health, answered = self._shared.balancer.health(router), False
        try:
            async for chunk in chunks:
                if not answered:
                    answered = True
                    health.success()
                self.sent += chunk.token_ids
                delta = self._delta(chunk, base + chunk.completion_tokens)
                yield delta
                if delta.finish_reason is not None:
                    return  # closing `chunks` cancels the router's stream after a stop string
            log.warning(
                "router %s ended the stream of %s without a finish reason",
                router.address,
                self.request_id,
            )
            raise UnavailableError(
                f"request {self.request_id}: the router ended the stream without a finish reason"
            )
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def _delta(self, chunk: Chunk, completion_tokens: int) -> Delta:
        """The client's view of a router message: its text, ended early by a stop string. A
        message may carry several tokens (a router's decode bursts): a stop string ends it at
        the token that completed it, and the tokens after that one are not the client's."""
        text, taken = self._text.take(chunk.token_ids)
        ids, logprobs = list(chunk.token_ids[:taken]), chunk.logprobs
        completion_tokens -= len(chunk.token_ids) - taken
        if logprobs is not None:
            logprobs = logprobs[:taken]
        finish = chunk.finish_reason
        if self._text.stopped:
            finish = "stop"
        elif finish is not None:
            text += self._text.finish()
        prompt_tokens = len(self._request.prompt_token_ids)
        return Delta(self.request_id, ids, text, finish, prompt_tokens, completion_tokens, logprobs)

    def _fail_over(self, router: RouterBackend, attempt: int, error: RouterLostError) -> None:
        """Eject `router`; return to try another, or raise UnavailableError when no retry is left."""
        shared, rid = self._shared, self.request_id
        shared.balancer.failed(router, error)
        if not self._may_retry(attempt):
            raise UnavailableError(
                f"request {rid}: no router replica could serve it "
                f"({attempt + 1} tried; last: {error})"
            ) from error
        shared.balancer.failovers += 1
        log.info(
            "request %s: router %s failed after %d tokens (%s); continuing on another router",
            rid,
            router.address,
            len(self.sent),
            error,
        )
        if self._span is not None:
            self._span.add_event(
                "moe.gateway.failover",
                {"moe.router.attempt": attempt + 1, "moe.tokens_sent": len(self.sent)},
            )

    def _may_retry(self, attempt: int) -> bool:
        shared = self._shared
        if attempt + 1 >= shared.router_attempts or shared.clock() >= self._deadline:
            return False
        if not shared.balancer.budget.try_retry():
            log.warning("request %s: retry budget spent, not retrying", self.request_id)
            return False
        return True

    def _continuation(self, attempt: int) -> RouterRequest:
        """The router request that continues this one after the tokens sent so far.

        The token ids go as they are, never re-tokenized text, so the context is exactly the one the
        first router had; sampling depends on the seed and the position, so the continuation draws
        what the first router would have drawn. The id gets a suffix: a router that failed the first
        call may not have forgotten it yet.
        """
        request, sent = self._request, len(self.sent)
        if attempt == 0:
            return request
        # Penalties over the output then count the tokens sent as prompt: presence and frequency
        # penalties are exact only without failover.
        params = replace(
            request.params,
            max_tokens=request.params.max_tokens - sent,
            min_tokens=max(0, request.params.min_tokens - sent),
        )
        return RouterRequest(
            f"{request.request_id}~{attempt}",
            [*request.prompt_token_ids, *self.sent],
            params,
            request.priority,
        )
