"""The gateway's core, free of gRPC and HTTP: validation, tokenization, admission, router choice,
streaming detokenization and stop strings. Both public APIs are thin adapters over it.

    generation = await core.start(TextRequest(prompt="Hello", max_tokens=8))  # validates + admits, or raises
    async with generation:
        async for delta in generation: ...                                    # Delta per router message
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import Span, StatusCode

from common.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelNotFoundError,
    MoeMeshError,
    PreconditionError,
    UnauthenticatedError,
    UnavailableError,
)
from common.limits import check_context_length
from common.resilience import EjectionPolicy, RetryBudget
from common.status import status_code
from common.telemetry import (
    GATEWAY_EJECTIONS,
    GATEWAY_FAILOVERS,
    GATEWAY_IN_FLIGHT,
    GATEWAY_QUEUE_DEPTH,
    GATEWAY_QUEUE_WAIT,
    OFF,
    REQUEST_DURATION,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    Telemetry,
)
from common.tokenizer import NoTokenizer, TextStream, Tokenizer
from gateway.admission import Admission
from gateway.auth import ApiKeys, Caller
from gateway.balancer import Balancer, RouterLostError
from gateway.cutoff import Cutoff
from gateway.router_client import (
    GenerateParams,
    Logprobs,
    ModelInfo,
    RouterBackend,
    RouterRequest,
)
from gateway.settings import GatewaySettings

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs

log = logging.getLogger(__name__)


def check_unicode(field: str, text: str, where: str = "") -> None:
    """JSON can carry lone surrogates ("\\ud800"); they are not text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            field,
            f"{where}invalid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}",
        ) from None


@dataclass
class TextRequest:
    """A generation request as either public API received it; None means the client did not send it."""

    model: str = ""
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    # Sequences, not lists: the gRPC API passes its repeated fields as they are, so their length is
    # checked before anything copies up to a message's worth of entries.
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    priority: int = 0
    request_id: str = ""
    ignore_eos: bool = False
    # False for a rendered chat template, which writes the special tokens it wants.
    add_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token (0-20); None: no logprobs
    # Without max_tokens, run to the end of the context (chat, as OpenAI's and vLLM's do) rather
    # than --default-max-tokens. The router always has KV room for one max_model_len sequence.
    fills_context: bool = False


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


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None


class Generation:
    """An admitted request. Iterate it (from one task) for Deltas; leaving `async with` (or `aclose`)
    early cancels it."""

    def __init__(self, request_id: str, deltas: AsyncIterator[Delta], release) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
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
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer | NoTokenizer,
        routers: Sequence[RouterBackend],
        model: ModelInfo,
        telemetry: Telemetry = OFF,
        keys: ApiKeys | None = None,
    ) -> None:
        self.settings, self.tokenizer, self.routers, self.model = (
            settings,
            tokenizer,
            list(routers),
            model,
        )
        self.keys = keys or ApiKeys()  # none: the API is open
        self.admission = Admission(
            settings.max_in_flight, settings.max_queued, settings.retry_after_s
        )
        self.balancer = Balancer(
            EjectionPolicy(consecutive_failures=1, base_ejection_s=settings.router_ejection_s),
            RetryBudget(ratio=settings.retry_budget_ratio),
            check=self._check_router,
            check_interval_s=settings.router_probe_interval_s,
        )
        self.draining = False  # set on shutdown: new requests are refused, admitted ones finish
        self._active: set[str] = set()  # request ids in flight, so a duplicate is refused
        self._cutoffs: set[Cutoff] = set()  # of the admitted generations
        self._cut_reason: str | None = None  # set by cut_off(): later admissions are cut at once
        self.tracer = telemetry.tracer
        self._duration = telemetry.latency(
            REQUEST_DURATION, "request from admission to its last token"
        )
        self._ttft = telemetry.latency(TIME_TO_FIRST_TOKEN, "request start to its first token")
        self._tpot = telemetry.latency(
            TIME_PER_OUTPUT_TOKEN, "mean time between a request's output tokens"
        )
        self._queue_wait = telemetry.latency(
            GATEWAY_QUEUE_WAIT, "time an admitted request waited for a place"
        )
        self._errors = telemetry.errors()
        telemetry.meter.create_observable_gauge(
            GATEWAY_QUEUE_DEPTH,
            [lambda _: [Observation(self.admission.queued)]],
            description="admitted requests waiting for an in-flight place",
        )
        telemetry.meter.create_observable_gauge(
            GATEWAY_IN_FLIGHT,
            [lambda _: [Observation(self.admission.in_flight)]],
            description="requests streaming from routers",
        )
        telemetry.meter.create_observable_counter(
            GATEWAY_FAILOVERS,
            [lambda _: [Observation(self.balancer.failovers)]],
            description="router calls continued on another router",
        )
        telemetry.meter.create_observable_counter(
            GATEWAY_EJECTIONS,
            [lambda _: [Observation(self.balancer.ejections)]],
            description="routers ejected for a while after a failed call",
        )

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an `Authorization` value names (keys.authenticate); a refusal counts as a
        failed request (UNAUTHENTICATED), so a flood of bad keys shows on the dashboard."""
        try:
            return self.keys.authenticate(authorization)
        except UnauthenticatedError as e:
            self.count_failure(e)
            raise

    def count_failure(self, error: BaseException | str) -> None:
        """Count a failed request in moe_errors_total by status code: `error` once, however many
        layers it passes on its way out, or a code name for what the HTTP server refuses itself."""
        if isinstance(error, str):
            code = error
        elif _counted(error):
            return
        else:
            error._moe_counted = True  # type: ignore[attr-defined]
            code = status_code(error).name if isinstance(error, MoeMeshError) else "INTERNAL"
        self._errors.add(1, {"rpc.grpc.status_code": code})

    @property
    def served_names(self) -> list[str]:
        """The names clients may use for the model: --served-model-name, else the router's id."""
        return self.settings.served_model_name or [self.model.id]

    def served_model(self, name: str) -> ModelInfo:
        """The model served under `name`, or ModelNotFoundError naming those that are."""
        for m in self.list_models():
            if m.id == name:
                return m
        raise ModelNotFoundError(
            f"model {name!r} does not exist; this gateway serves "
            + ", ".join(repr(n) for n in self.served_names)
        )

    def list_models(self) -> list[ModelInfo]:
        return [replace(self.model, id=name) for name in self.served_names]

    def set_routers(self, routers: Sequence[RouterBackend]) -> None:
        """The router replicas to balance over from now on (registry membership changed)."""
        self.routers = list(routers)
        self.balancer.retain(self.routers)

    async def _check_router(self, router: RouterBackend, timeout_s: float) -> None:
        """The check of an ejected router: it serves, and serves this gateway's model (one restarted
        on another checkpoint at the same address must stay out)."""
        served = await router.check(timeout_s)
        if served != self.model.id:
            raise PreconditionError(
                f"router {router.address} serves {served!r}, this gateway {self.model.id!r}"
            )

    # -- validation ------------------------------------------------------------------------

    def check_bounds(self, r: TextRequest) -> None:
        """The checks that cost O(1) per field (plus one UTF-8 pass), made before any heavy work."""
        s, m = self.settings, self.model
        for name, value in (("request_id", r.request_id), ("model", r.model)):
            if len(value) > s.max_id_chars:
                raise InvalidArgumentError(
                    name, f"must be at most {s.max_id_chars} characters, got {len(value)}"
                )
            check_unicode(name, value)
        if r.stop and not self.tokenizer.available:
            raise InvalidArgumentError(
                "stop", "stop strings need a tokenizer (this server has --skip-tokenizer-init)"
            )
        if r.model:
            self.served_model(r.model)
        for name, values in (("stop", r.stop), ("stop_token_ids", r.stop_token_ids)):
            if len(values) > s.max_stop_strings:
                raise InvalidArgumentError(
                    name, f"at most {s.max_stop_strings} entries, got {len(values)}"
                )
        for x in r.stop:
            if not isinstance(x, str):
                raise InvalidArgumentError("stop", "must be strings")
            if len(x) > s.max_stop_chars:
                raise InvalidArgumentError(
                    "stop", f"each must be at most {s.max_stop_chars} characters, got {len(x)}"
                )
            check_unicode("stop", x)
        if (r.prompt is None) == (r.prompt_token_ids is None):
            raise InvalidArgumentError("prompt", "give exactly one of prompt and prompt_token_ids")
        if r.prompt is not None:
            if not r.prompt:
                raise InvalidArgumentError("prompt", "must not be empty")
            check_unicode("prompt", r.prompt)
        else:  # cheap, and it bounds the id list before anything copies it
            check_context_length(len(r.prompt_token_ids or ()), 1, m.max_model_len)

    async def validate(self, r: TextRequest) -> tuple[list[int], GenerateParams]:
        """Prompt token ids and router sampling params; InvalidArgumentError names the first bad field."""
        self.check_bounds(r)
        s, m = self.settings, self.model
        if r.prompt is None:
            ids = list(r.prompt_token_ids or [])
        elif len(r.prompt) <= s.inline_tokenize_chars:
            ids = self.tokenizer.encode(r.prompt, r.add_special_tokens)
        else:  # about a microsecond per character: keep the event loop serving meanwhile
            ids = await asyncio.to_thread(self.tokenizer.encode, r.prompt, r.add_special_tokens)
        if not ids:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        bad = next((t for t in ids if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {m.vocab_size})"
            )
        bad = next((t for t in r.stop_token_ids if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(
                "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {m.vocab_size})"
            )
        max_tokens = r.max_tokens
        if max_tokens is None:  # the default: never what makes a prompt that fits too long
            default = s.max_tokens_limit if r.fills_context else s.default_max_tokens
            max_tokens = max(1, min(default, m.max_model_len - len(ids)))
        if not 1 <= max_tokens <= s.max_tokens_limit:
            raise InvalidArgumentError(
                "max_tokens", f"must be in [1, {s.max_tokens_limit}], got {max_tokens}"
            )
        check_context_length(len(ids), max_tokens, m.max_model_len)
        temperature = 1.0 if r.temperature is None else r.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidArgumentError("temperature", f"must be >= 0, got {temperature}")
        top_p = 1.0 if r.top_p is None else r.top_p
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {top_p}")
        top_k = 0 if r.top_k is None else r.top_k
        if not 0 <= top_k < 2**31:
            raise InvalidArgumentError("top_k", f"must be in [0, 2^31), got {top_k}")
        min_p = 0.0 if r.min_p is None else r.min_p
        if not (math.isfinite(min_p) and 0 <= min_p <= 1):
            raise InvalidArgumentError("min_p", f"must be in [0, 1], got {min_p}")
        if r.seed is not None and not 0 <= r.seed < 2**64:
            raise InvalidArgumentError("seed", f"must be in [0, 2^64), got {r.seed}")
        if not -(2**31) <= r.priority < 2**31:
            raise InvalidArgumentError(
                "priority", f"must fit a 32-bit signed integer, got {r.priority}"
            )
        penalties = []
        for name, default, low, high in (
            ("presence_penalty", 0.0, -2.0, 2.0),
            ("frequency_penalty", 0.0, -2.0, 2.0),
            ("repetition_penalty", 1.0, 0.0, math.inf),
        ):
            value = getattr(r, name)
            value = default if value is None else value
            if not (math.isfinite(value) and low <= value <= high) or (low == 0 and value == 0):
                bound = f"[{low:g}, {high:g}]" if math.isfinite(high) else "> 0"
                raise InvalidArgumentError(name, f"must be {bound}, got {value}")
            penalties.append(value)
        if not 0 <= r.min_tokens <= max_tokens:
            raise InvalidArgumentError(
                "min_tokens", f"must be in [0, max_tokens={max_tokens}], got {r.min_tokens}"
            )
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise InvalidArgumentError(
                "top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {r.logprobs}"
            )
        seed = r.seed
        if seed is None and temperature > 0:
            # A request that moves to another router mid-stream continues from its tokens so far with
            # the same seed; without one here, the rest would be drawn from a different sample path.
            seed = secrets.randbits(63)
        return ids, GenerateParams(
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            tuple(r.stop_token_ids),
            r.ignore_eos,
            *penalties,
            r.min_tokens,
            r.logprobs,
        )

    def cut_off(self, reason: str) -> None:
        """End every admitted request now with UnavailableError(reason), which each API reports
        in-band (an SSE error event, gRPC UNAVAILABLE), and refuse those waiting for admission with
        it; so does every request admitted from now on. For requests that outlast a shutdown's grace
        period: their clients learn they may retry elsewhere instead of seeing a dropped stream."""
        self._cut_reason = reason
        self.admission.refuse_waiting(reason)
        for cutoff in list(self._cutoffs):
            cutoff.cut(UnavailableError(reason))  # one each: count_failure marks the instance

    # -- generation ------------------------------------------------------------------------

    async def start(self, r: TextRequest, timeout_s: float | None = None) -> Generation:
        """Validate and admit `r` (raising at once when invalid or when the queue is full), then stream."""
        return (await self.start_all([r], timeout_s))[0]

    async def start_all(
        self, requests: Sequence[TextRequest], timeout_s: float | None = None
    ) -> list[Generation]:
        """start() for requests streamed together (one response's n choices): all are admitted at
        once, taking their places together, or none is (Admission says why that matters)."""
        try:
            return await self._start(requests, timeout_s)
        except MoeMeshError as e:
            self.count_failure(e)
            raise

    async def _start(
        self, requests: Sequence[TextRequest], timeout_s: float | None
    ) -> list[Generation]:
        began = time.monotonic()
        deadline = began + (timeout_s if timeout_s is not None else self.settings.request_timeout_s)
        if self.draining:
            raise UnavailableError("the gateway is shutting down; retry on another replica")
        if len(requests) > self.admission.max_in_flight:
            raise InvalidArgumentError(
                "n",
                f"{len(requests)} streamed choices run at once, and this gateway runs at most "
                f"max_in_flight={self.admission.max_in_flight} requests",
            )
        validated = [await self.validate(r) for r in requests]
        ids = [r.request_id or uuid.uuid4().hex for r in requests]
        for request_id in ids:
            if request_id in self._active:
                raise AlreadyExistsError("request_id", f"{request_id!r} is already in flight")
        self._active.update(ids)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self.admission.acquire(requests[0].priority, len(requests))
        except TimeoutError:
            self._active.difference_update(ids)
            raise DeadlineExceededError(
                f"request {ids[0]} waited past its deadline for admission"
            ) from None
        except BaseException:
            self._active.difference_update(ids)
            raise
        self._queue_wait.record(time.monotonic() - began)
        return [
            self._generation(RouterRequest(i, tokens, params, r.priority), r.stop, deadline, began)
            for i, r, (tokens, params) in zip(ids, requests, validated)
        ]

    def _generation(
        self, request: RouterRequest, stop: Sequence[str], deadline: float, began: float
    ) -> Generation:
        """An admitted request's stream; closing it gives its place back, once."""
        released = False
        cutoff = Cutoff()
        self._cutoffs.add(cutoff)
        if self._cut_reason is not None:
            cutoff.cut(UnavailableError(self._cut_reason))

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._active.discard(request.request_id)
                self._cutoffs.discard(cutoff)
                self.admission.release()

        stream = self._stream(request, stop, deadline, began, cutoff)
        gen = Generation(request.request_id, stream, release)
        gen.prompt_token_ids = request.prompt_token_ids
        return gen

    async def complete(self, r: TextRequest, timeout_s: float | None = None) -> Completion:
        """Run a request to the end."""
        async with await self.start(r, timeout_s) as gen:
            ids, text, last, logprobs = [], [], None, []
            async for delta in gen:
                ids += delta.token_ids
                text.append(delta.text)
                logprobs += delta.logprobs or []
                last = delta
        assert last is not None and last.finish_reason is not None
        return Completion(
            gen.request_id,
            ids,
            "".join(text),
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            gen.prompt_token_ids,
            logprobs if r.logprobs is not None else None,
        )

    def _request_span(self, request: RouterRequest) -> Span | None:
        """The request's span, under the RPC's server span if there is one; None when not sampled."""
        if self.tracer is None:
            return None
        p = request.params
        span = self.tracer.start_span(
            "moe.gateway.request",
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": self.model.id,
                "gen_ai.request.id": request.request_id,
                "gen_ai.request.max_tokens": p.max_tokens,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            },
        )
        return span if span.is_recording() else None

    async def _stream(
        self,
        request: RouterRequest,
        stop: Sequence[str],
        deadline: float,
        began: float,
        cutoff: Cutoff,
    ) -> AsyncIterator[Delta]:
        span = self._request_span(request)
        first: float | None = None
        status = "OK"
        deltas = self._deltas(request, stop, deadline, span)
        try:
            while True:
                # cut_off() ends this with its UnavailableError, counted and traced as any other.
                if cutoff.error is not None:
                    raise cutoff.error
                # Each wait's own task: an HTTP stream's first delta may be awaited by its handler
                # and the rest by its response's task (ASGI servers before spec 2.4).
                cutoff.task = asyncio.current_task()
                cutoff.waiting = True
                try:
                    delta = await deltas.__anext__()
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if cutoff.caused_it():
                        raise cutoff.error from None
                    raise
                finally:
                    cutoff.waiting = False
                if first is None and delta.token_ids:
                    first = time.monotonic()
                    self._ttft.record(first - began)
                if delta.finish_reason is not None and span is not None:
                    span.set_attributes(
                        {
                            "gen_ai.usage.output_tokens": delta.completion_tokens,
                            "gen_ai.response.finish_reasons": [delta.finish_reason],
                        }
                    )
                if (
                    delta.finish_reason is not None
                    and first is not None
                    and delta.completion_tokens > 1
                ):
                    self._tpot.record((time.monotonic() - first) / (delta.completion_tokens - 1))
                yield delta
        except MoeMeshError as e:
            status = status_code(e).name
            self.count_failure(e)
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

    async def _deltas(
        self, request: RouterRequest, stop: Sequence[str], deadline: float, span: Span | None
    ) -> AsyncIterator[Delta]:
        """The request's deltas, from one router or, when routers fail under it, from several in turn.

        A call that fails with UNAVAILABLE (router dead, unreachable, shutting down) moves to another
        router, within the deadline, `router_attempts` and the retry budget. It continues from the
        prompt plus the tokens already streamed, with the same seed and the remaining max_tokens, so
        the client sees one uninterrupted stream: each token once, the right finish reason and usage.
        """
        text = TextStream(self.tokenizer, stop)
        rid, prompt_tokens = request.request_id, len(request.prompt_token_ids)
        sent: list[int] = []  # token ids already given to the client
        tried: list[str] = []
        self.balancer.budget.request()
        for attempt in range(self.settings.router_attempts):
            router = self.balancer.pick(self.routers, tried)
            tried.append(router.address)
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceededError(
                    f"request {rid} passed its deadline before reaching a router"
                )
            base = len(sent)
            if base >= request.params.max_tokens:  # the router died right after the last token
                yield Delta(rid, [], text.finish(), "length", prompt_tokens, base)
                return
            chunks = router.generate(
                self._continuation(request, sent, attempt),
                timeout,
                trace.set_span_in_context(span) if span is not None else None,
            )
            health, started = self.balancer.health(router), False
            try:
                async for chunk in chunks:
                    if not started:
                        started = True
                        health.success()
                    sent += chunk.token_ids
                    completion = base + chunk.completion_tokens
                    delta = text.push(chunk.token_ids)
                    # A stop string: end here; closing `chunks` cancels the router stream.
                    lp = chunk.logprobs
                    if text.stopped:
                        yield Delta(
                            rid, chunk.token_ids, delta, "stop", prompt_tokens, completion, lp
                        )
                        return
                    if chunk.finish_reason is not None:
                        yield Delta(
                            rid,
                            chunk.token_ids,
                            delta + text.finish(),
                            chunk.finish_reason,
                            prompt_tokens,
                            completion,
                            lp,
                        )
                        return
                    yield Delta(rid, chunk.token_ids, delta, None, prompt_tokens, completion, lp)
                log.warning(
                    "router %s ended the stream of %s without a finish reason", router.address, rid
                )
                raise UnavailableError(
                    f"request {rid}: the router ended the stream without a finish reason"
                )
            except RouterLostError as e:
                self.balancer.failed(router, e)
                if not self._may_retry(rid, attempt, deadline):
                    raise UnavailableError(
                        f"request {rid}: no router replica could serve it "
                        f"({attempt + 1} tried; last: {e})"
                    ) from e
                self.balancer.failovers += 1
                log.info(
                    "request %s: router %s failed after %d tokens (%s); continuing on another router",
                    rid,
                    router.address,
                    len(sent),
                    e,
                )
                if span is not None:
                    span.add_event(
                        "moe.gateway.failover",
                        {"moe.router.attempt": attempt + 1, "moe.tokens_sent": len(sent)},
                    )
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _may_retry(self, rid: str, attempt: int, deadline: float) -> bool:
        if attempt + 1 >= self.settings.router_attempts or time.monotonic() >= deadline:
            return False
        if not self.balancer.budget.try_retry():
            log.warning("request %s: retry budget spent, not retrying", rid)
            return False
        return True

    @staticmethod
    def _continuation(request: RouterRequest, sent: list[int], attempt: int) -> RouterRequest:
        """The router request that continues `request` after the tokens `sent` so far.

        The token ids go as they are, never re-tokenized text, so the context is exactly the one the
        first router had; sampling depends on the seed and the position, so the continuation draws
        what the first router would have drawn. The id gets a suffix: a router that failed the first
        call may not have forgotten it yet.
        """
        if attempt == 0:
            return request
        # Penalties over the output then count the tokens sent as prompt: presence and frequency
        # penalties are exact only without failover.
        params = replace(
            request.params,
            max_tokens=request.params.max_tokens - len(sent),
            min_tokens=max(0, request.params.min_tokens - len(sent)),
        )
        return RouterRequest(
            f"{request.request_id}~{attempt}",
            [*request.prompt_token_ids, *sent],
            params,
            request.priority,
        )


def _counted(error: BaseException) -> bool:
    """Counted already, or raised from one that was (a field renamed for the API, http_api.py)."""
    cause: BaseException | None = error
    while cause is not None:
        if getattr(cause, "_moe_counted", False):
            return True
        cause = cause.__cause__
    return False
