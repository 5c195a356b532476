"""The gateway's core, free of gRPC and HTTP: validation, tokenization, admission, router choice,
streaming detokenization and stop strings. Both public APIs are thin adapters over it.

    generation = await core.start(TextRequest(prompt="Hello", max_tokens=8))  # validates + admits, or raises
    async with generation:
        async for delta in generation: ...                                    # Delta per router message
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import Span, StatusCode

from common.errors import DeadlineExceededError, InvalidArgumentError, MoeMeshError, UnavailableError
from common.status import status_code
from common.telemetry import (GATEWAY_QUEUE_DEPTH, GATEWAY_QUEUE_WAIT, OFF, REQUEST_DURATION, TIME_PER_OUTPUT_TOKEN,
                              TIME_TO_FIRST_TOKEN, Telemetry)
from common.tokenizer import TextStream, Tokenizer
from gateway.admission import Admission
from gateway.router_client import RouterBackend
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import router_pb2


@dataclass
class ModelInfo:
    id: str
    architecture: str
    max_model_len: int
    vocab_size: int


@dataclass
class TextRequest:
    """A generation request as either public API received it; None means the client did not send it."""

    model: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    request_id: str = ""
    ignore_eos: bool = False


@dataclass
class Delta:
    """What a request produced since the previous delta; the last one has finish_reason set."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Generation:
    """An admitted request. Iterate it for Deltas; leaving `async with` (or `aclose`) early cancels it."""

    def __init__(self, request_id: str, deltas: AsyncIterator[Delta], release) -> None:
        self.request_id = request_id
        self._deltas = deltas
        self._release = release

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()  # type: ignore[attr-defined]
        finally:
            await self._release()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class GatewayCore:
    def __init__(self, settings: GatewaySettings, tokenizer: Tokenizer, routers: Sequence[RouterBackend],
                 model: ModelInfo, telemetry: Telemetry = OFF) -> None:
        self.settings, self.tokenizer, self.routers, self.model = settings, tokenizer, list(routers), model
        self.admission = Admission(settings.max_in_flight, settings.max_queued, settings.retry_after_s)
        self._turn = 0
        self.tracer = telemetry.tracer
        self._duration = telemetry.latency(REQUEST_DURATION, "request from admission to its last token")
        self._ttft = telemetry.latency(TIME_TO_FIRST_TOKEN, "request start to its first token")
        self._tpot = telemetry.latency(TIME_PER_OUTPUT_TOKEN, "mean time between a request's output tokens")
        self._queue_wait = telemetry.latency(GATEWAY_QUEUE_WAIT, "time an admitted request waited for a place")
        self._errors = telemetry.errors()
        telemetry.meter.create_observable_gauge(
            GATEWAY_QUEUE_DEPTH, [lambda _: [Observation(self.admission.queued)]],
            description="admitted requests waiting for an in-flight place")

    def list_models(self) -> list[ModelInfo]:
        return [self.model]

    # -- validation ------------------------------------------------------------------------

    def validate(self, r: TextRequest) -> tuple[list[int], router_pb2.SamplingParams]:
        """Prompt token ids and router sampling params; InvalidArgumentError names the first bad field."""
        s, m = self.settings, self.model
        if r.model and r.model != m.id:
            raise InvalidArgumentError("model", f"unknown model {r.model!r}; this gateway serves {m.id!r}")
        if (r.prompt is None) == (r.prompt_token_ids is None):
            raise InvalidArgumentError("prompt", "give exactly one of prompt and prompt_token_ids")
        if r.prompt is not None and not r.prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        ids = self.tokenizer.encode(r.prompt) if r.prompt is not None else list(r.prompt_token_ids or [])
        if not ids:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        bad = next((t for t in ids if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {m.vocab_size})")
        bad = next((t for t in r.stop_token_ids if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {m.vocab_size})")
        max_tokens = s.default_max_tokens if r.max_tokens is None else r.max_tokens
        if not 1 <= max_tokens <= s.max_tokens_limit:
            raise InvalidArgumentError("max_tokens", f"must be in [1, {s.max_tokens_limit}], got {max_tokens}")
        if len(ids) >= m.max_model_len:
            raise InvalidArgumentError("prompt", f"{len(ids)} tokens do not fit the context length {m.max_model_len}")
        if len(ids) + max_tokens > m.max_model_len:
            raise InvalidArgumentError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                       f"the context length {m.max_model_len}")
        temperature = 1.0 if r.temperature is None else r.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidArgumentError("temperature", f"must be >= 0, got {temperature}")
        top_p = 1.0 if r.top_p is None else r.top_p
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {top_p}")
        top_k = 0 if r.top_k is None else r.top_k
        if not 0 <= top_k < 2**31:
            raise InvalidArgumentError("top_k", f"must be in [0, 2^31), got {top_k}")
        if r.seed is not None and not 0 <= r.seed < 2**64:
            raise InvalidArgumentError("seed", f"must be in [0, 2^64), got {r.seed}")
        if not -(2**31) <= r.priority < 2**31:
            raise InvalidArgumentError("priority", f"must fit a 32-bit signed integer, got {r.priority}")
        if any(not isinstance(x, str) for x in r.stop):
            raise InvalidArgumentError("stop", "must be strings")
        params = router_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                           stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos)
        if r.seed is not None:
            params.seed = r.seed
        return ids, params

    # -- generation ------------------------------------------------------------------------

    async def start(self, r: TextRequest, timeout_s: float | None = None) -> Generation:
        """Validate and admit `r` (raising at once when invalid or when the queue is full), then stream."""
        try:
            return await self._start(r, timeout_s)
        except MoeMeshError as e:
            self._errors.add(1, {"rpc.grpc.status_code": status_code(e).name})
            raise

    async def _start(self, r: TextRequest, timeout_s: float | None) -> Generation:
        ids, params = self.validate(r)
        request_id = r.request_id or uuid.uuid4().hex
        began = time.monotonic()
        deadline = began + (timeout_s if timeout_s is not None else self.settings.request_timeout_s)
        slot = self.admission.slot(r.priority)
        await slot.__aenter__()
        self._queue_wait.record(time.monotonic() - began)
        request = router_pb2.RouterGenerateRequest(request_id=request_id, prompt_token_ids=ids, params=params,
                                                   priority=r.priority)
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await slot.__aexit__(None, None, None)

        return Generation(request_id, self._stream(request, r.stop, deadline, began), release)

    async def complete(self, r: TextRequest, timeout_s: float | None = None) -> Completion:
        """Run a request to the end."""
        async with await self.start(r, timeout_s) as gen:
            ids, text, last = [], [], None
            async for delta in gen:
                ids += delta.token_ids
                text.append(delta.text)
                last = delta
        assert last is not None and last.finish_reason is not None
        return Completion(gen.request_id, ids, "".join(text), last.finish_reason, last.prompt_tokens,
                          last.completion_tokens)

    def _pick_router(self) -> RouterBackend:
        """Least outstanding streams; ties rotate so idle replicas share the load."""
        self._turn += 1
        n = len(self.routers)
        if not n:
            raise UnavailableError("no router replica is available")
        return min((self.routers[(self._turn + i) % n] for i in range(n)), key=lambda b: b.outstanding)

    def _request_span(self, request: router_pb2.RouterGenerateRequest) -> Span | None:
        """The request's span, under the RPC's server span if there is one; None when not sampled."""
        if self.tracer is None:
            return None
        p = request.params
        span = self.tracer.start_span("moe.gateway.request", attributes={
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.model.id,
            "gen_ai.request.id": request.request_id, "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})
        return span if span.is_recording() else None

    async def _stream(self, request: router_pb2.RouterGenerateRequest, stop: list[str],
                      deadline: float, began: float) -> AsyncIterator[Delta]:
        span = self._request_span(request)
        first: float | None = None
        status = "OK"
        try:
            async for delta in self._deltas(request, stop, deadline, span):
                if first is None and delta.token_ids:
                    first = time.monotonic()
                    self._ttft.record(first - began)
                if delta.finish_reason is not None and span is not None:
                    span.set_attributes({"gen_ai.usage.output_tokens": delta.completion_tokens,
                                         "gen_ai.response.finish_reasons": [delta.finish_reason]})
                if delta.finish_reason is not None and first is not None and delta.completion_tokens > 1:
                    self._tpot.record((time.monotonic() - first) / (delta.completion_tokens - 1))
                yield delta
        except MoeMeshError as e:
            status = status_code(e).name
            self._errors.add(1, {"rpc.grpc.status_code": status})
            if span is not None:
                span.record_exception(e)
                span.set_status(StatusCode.ERROR, str(e))
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            self._duration.record(time.monotonic() - began, {"rpc.grpc.status_code": status})
            if span is not None:
                span.end()

    async def _deltas(self, request: router_pb2.RouterGenerateRequest, stop: list[str], deadline: float,
                      span: Span | None) -> AsyncIterator[Delta]:
        text = TextStream(self.tokenizer, stop)
        rid, prompt_tokens, completion = request.request_id, len(request.prompt_token_ids), 0
        router = self._pick_router()
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise DeadlineExceededError(f"request {rid} waited past its deadline for admission")
        chunks = router.generate(request, timeout, trace.set_span_in_context(span) if span is not None else None)
        try:
            async for chunk in chunks:
                completion = chunk.completion_tokens
                delta = text.push(chunk.token_ids)
                if text.stopped:  # a stop string: end here; closing `chunks` cancels the router stream
                    yield Delta(rid, chunk.token_ids, delta, "stop", prompt_tokens, completion)
                    return
                if chunk.finish_reason is not None:
                    yield Delta(rid, chunk.token_ids, delta + text.finish(), chunk.finish_reason, prompt_tokens,
                                completion)
                    return
                yield Delta(rid, chunk.token_ids, delta, None, prompt_tokens, completion)
            raise UnavailableError(f"router {router.address} ended the stream of {rid} without a finish reason")
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
