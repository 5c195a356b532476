"""The gateway's core, free of gRPC and HTTP: validation, tokenization, admission and the request
streams (gateway/stream.py) of admitted requests. Both public APIs are thin adapters over it, and
each counts the failures it reports (count_failure), so every failed request is counted once.

    request = TextRequest(prompt="Hello", params=SamplingParams(max_tokens=8))
    stream = await core.start(request)  # validates + admits, or raises
    async with stream:
        async for delta in stream: ...  # Delta per router message
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from opentelemetry.metrics import Observation

from common.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelNotFoundError,
    MoeMeshError,
    PreconditionError,
    UnavailableError,
)
from common.limits import check_context_length
from common.resilience import EjectionPolicy, RetryBudget
from common.sampling import SamplingParams
from common.status import status_code
from common.telemetry import (
    GATEWAY_EJECTIONS,
    GATEWAY_FAILOVERS,
    GATEWAY_IN_FLIGHT,
    GATEWAY_QUEUE_DEPTH,
    GATEWAY_QUEUE_WAIT,
    OFF,
    Telemetry,
)
from common.tokenizer import NO_TOKENIZER, NoTokenizer, Tokenizer
from gateway.admission import Admission
from gateway.auth import ApiKeys, Caller
from gateway.balancer import Balancer
from gateway.router_client import (
    Logprobs,
    ModelInfo,
    RouterBackend,
    RouterRequest,
)
from gateway.settings import GatewaySettings
from gateway.stream import RequestStream, Streaming, StreamMeters


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
    # Checked by validate(); max_tokens None is the server's default.
    params: SamplingParams = SamplingParams(max_tokens=None)
    # A sequence, not a list: the gRPC API passes its repeated field as it is, so its length is
    # checked before anything copies up to a message's worth of entries.
    stop: Sequence[str] = field(default_factory=list)
    priority: int = 0
    request_id: str = ""
    # False for a rendered chat template, which writes the special tokens it wants.
    add_special_tokens: bool = True
    # Without max_tokens, run to the end of the context (chat, as OpenAI's and vLLM's do) rather
    # than --default-max-tokens. The router always has KV room for one max_model_len sequence.
    fills_context: bool = False
    # The API's name for each field it names otherwise (chat's messages and max_completion_tokens),
    # which validation errors use.
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, core_name: str) -> str:
        return self.names.get(core_name, core_name)


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
        self._streams: set[RequestStream] = set()  # the admitted ones, for cut_off()
        self._cut_reason: str | None = None  # set by cut_off(): later admissions are cut at once
        self.streaming = Streaming(
            tokenizer,
            self.balancer,
            lambda: self.routers,
            settings.router_attempts,
            StreamMeters(telemetry, model.id),
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
        """The caller an `Authorization` value names (keys.authenticate)."""
        return self.keys.authenticate(authorization)

    def count_failure(self, error: BaseException | str) -> None:
        """Count a failed request in moe_errors_total by status code: `error`, or a code name for
        what the HTTP server refuses itself. Called only where an API turns a failure into its
        answer (a status, an error event), which happens once per request; a refused API key is
        counted too, so a flood of bad keys shows on the dashboard."""
        if isinstance(error, str):
            code = error
        else:
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
        for name, values in (("stop", r.stop), ("stop_token_ids", r.params.stop_token_ids)):
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
            raise InvalidArgumentError(
                r.name("prompt"), "give exactly one of prompt and prompt_token_ids"
            )
        if r.prompt is not None:
            if not r.prompt:
                raise InvalidArgumentError(r.name("prompt"), "must not be empty")
            check_unicode(r.name("prompt"), r.prompt)
        else:  # cheap, and it bounds the id list before anything copies it
            check_context_length(len(r.prompt_token_ids or ()), 1, m.max_model_len, r.names)

    async def validate(self, r: TextRequest) -> tuple[list[int], SamplingParams]:
        """Prompt token ids and the router's sampling params, defaults resolved; InvalidArgumentError
        names the first bad field as the request's API names it (`r.names`)."""
        self.check_bounds(r)
        s, m = self.settings, self.model
        if r.prompt is None:
            ids = list(r.prompt_token_ids or [])
        elif not self.tokenizer.available:
            raise InvalidArgumentError(r.name("prompt"), NO_TOKENIZER)
        elif len(r.prompt) <= s.inline_tokenize_chars:
            ids = self.tokenizer.encode(r.prompt, r.add_special_tokens)
        else:  # about a microsecond per character: keep the event loop serving meanwhile
            ids = await asyncio.to_thread(self.tokenizer.encode, r.prompt, r.add_special_tokens)
        prompt_field = r.name("prompt_token_ids")
        if not ids:
            raise InvalidArgumentError(prompt_field, "must not be empty")
        bad = next((t for t in ids if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(
                prompt_field, f"token id {bad} is outside the vocabulary [0, {m.vocab_size})"
            )
        if not -(2**31) <= r.priority < 2**31:
            raise InvalidArgumentError(
                "priority", f"must fit a 32-bit signed integer, got {r.priority}"
            )
        p = r.params
        if p.max_tokens is None:  # the default: never what makes a prompt that fits too long
            default = s.max_tokens_limit if r.fills_context else s.default_max_tokens
            p = replace(p, max_tokens=max(1, min(default, m.max_model_len - len(ids))))
        if p.seed is None and p.temperature > 0:
            # A request that moves to another router mid-stream continues from its tokens so far with
            # the same seed; without one here, the rest would be drawn from a different sample path.
            p = replace(p, seed=secrets.randbits(63))
        p.validate(m.vocab_size, s.max_tokens_limit, r.names)
        check_context_length(len(ids), p.max_tokens, m.max_model_len, r.names)
        return ids, p

    def cut_off(self, reason: str) -> None:
        """End every admitted request now with UnavailableError(reason), which each API reports
        in-band (an SSE error event, gRPC UNAVAILABLE), and refuse those waiting for admission with
        it; so does every request admitted from now on. For requests that outlast a shutdown's grace
        period: their clients learn they may retry elsewhere instead of seeing a dropped stream."""
        self._cut_reason = reason
        self.admission.refuse_waiting(reason)
        for stream in list(self._streams):
            stream.cut(UnavailableError(reason))

    # -- generation ------------------------------------------------------------------------

    async def start(self, r: TextRequest, timeout_s: float | None = None) -> RequestStream:
        """Validate and admit `r` (raising at once when invalid or when the queue is full), then stream."""
        return (await self.start_all([r], timeout_s))[0]

    async def start_all(
        self, requests: Sequence[TextRequest], timeout_s: float | None = None
    ) -> list[RequestStream]:
        """start() for requests streamed together (one response's n choices): all are admitted at
        once, taking their places together, or none is (Admission says why that matters)."""
        clock = self.streaming.clock  # one clock for the deadline here and in the stream
        began = clock()
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
            async with asyncio.timeout(max(0.0, deadline - clock())):
                await self.admission.acquire(requests[0].priority, len(requests))
        except TimeoutError:
            self._active.difference_update(ids)
            raise DeadlineExceededError(
                f"request {ids[0]} waited past its deadline for admission"
            ) from None
        except BaseException:
            self._active.difference_update(ids)
            raise
        self._queue_wait.record(clock() - began)
        return [
            self._stream(RouterRequest(i, tokens, params, r.priority), r.stop, deadline, began)
            for i, r, (tokens, params) in zip(ids, requests, validated)
        ]

    def _stream(
        self, request: RouterRequest, stop: Sequence[str], deadline: float, began: float
    ) -> RequestStream:
        """An admitted request's stream; closing it gives its place back."""
        stream = RequestStream(self.streaming, request, stop, deadline, began, self._release)
        self._streams.add(stream)
        if self._cut_reason is not None:
            stream.cut(UnavailableError(self._cut_reason))
        return stream

    def _release(self, stream: RequestStream) -> None:
        self._active.discard(stream.request_id)
        self._streams.discard(stream)
        self.admission.release()

    async def complete(self, r: TextRequest, timeout_s: float | None = None) -> Completion:
        """Run a request to the end."""
        async with await self.start(r, timeout_s) as stream:
            ids, text, last, logprobs = [], [], None, []
            async for delta in stream:
                ids += delta.token_ids
                text.append(delta.text)
                logprobs += delta.logprobs or []
                last = delta
        assert last is not None and last.finish_reason is not None
        return Completion(
            stream.request_id,
            ids,
            "".join(text),
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            stream.prompt_token_ids,
            logprobs if r.params.logprobs is not None else None,
        )
