"""OpenAI-compatible HTTP API: a thin adapter that converts JSON to the core's types and back.

    POST /v1/completions        prompt: a string, token ids, or a list holding exactly one of those
    POST /v1/chat/completions   messages rendered by the checkpoint's chat template (`render_chat`)
    GET  /v1/models             the served model, OpenAI list shape
    GET  /v1/models/{name}      one served name, or 404 model_not_found
    GET  /health/live           200 while the process serves HTTP
    GET  /health/ready, /health 200 while `app.state.ready`, else 503
    GET  /metrics               the gateway's Prometheus metrics (also on --metrics-port if set)

Both generation endpoints stream as Server-Sent Events with `"stream": true`. Besides OpenAI's
fields they take vLLM-style extensions: `top_k`, `min_p`, `priority`, `stop_token_ids`,
`ignore_eos`, `return_token_ids` (adds `token_ids` to every choice and, unless streaming,
`prompt_token_ids` to the response), `chat_template_kwargs`, `add_generation_prompt` and `request_id` (a
duplicate of one in flight is 409). Unknown fields are ignored, since OpenAI clients send some;
known OpenAI features this server cannot honour (`logprobs`, `echo`, penalties, `tools`, ...) are
refused rather than silently dropped. Values are validated by the core; every
error uses OpenAI's `{"error": {message, type, param, code}}` shape, `param` naming the field.
Under API keys (gateway/auth.py) a /v1/ request without `Authorization: Bearer <key>` of a known
key is 401 before its body is read. Bodies over `max_body_bytes` are refused with 413 before they are read; list and string limits
are part of the body schema, so an oversized list is refused before its items are validated.
"""

# No `from __future__ import annotations`: the routes' body types are built per app (limits come
# from the settings), and FastAPI resolves string annotations in module globals only.

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import errors
from gateway.auth import Caller
from gateway.choices import Choices, chat_logprobs, completion_logprobs, requests_for
from gateway.core import (
    MAX_LOGPROBS,
    Completion,
    Delta,
    GatewayCore,
    TextRequest,
    check_unicode,
)
from gateway.router_client import ModelInfo
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
T = TypeVar("T")

# -- request bodies ------------------------------------------------------------------------------

_StrList = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]


class _Json(BaseModel):
    """Strict: JSON types must match exactly ("10" is not an int, true is not 1); unknown fields pass."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # OpenAI's API reads `"field": null` as an omitted field, and some clients send it.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Json):
    include_usage: bool = False


class _Body(_Json):
    """Fields both endpoints share."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # The bounds below are the ranges of the wire types behind the core (the gRPC API gets them from
    # its proto types); values inside them are validated by the core.
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: _StrList = []
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: Annotated[int, Field(lt=2**31)] | None = None
    min_p: float | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None  # None: the key's (auth)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    return_token_ids: bool = False
    request_id: str = ""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0, lt=2**31)] = 0


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ContentPart(_Json):
    type: str
    text: str | None = None


class ChatMessage(_Json):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # vLLM's extensions: variables for the template (e.g. enable_thinking), and whether to end the
    # prompt with the assistant's header.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


# OpenAI fields that would change the result; refused unless absent or set to their no-op value.
_UNSUPPORTED = (
    "best_of",
    "suffix",
    "logit_bias",
    "tools",
    "functions",
    "response_format",
)
_NO_OP = {"best_of": 1, "response_format": {"type": "text"}}


def _text_request(
    body: _Body,
    prompt: str | None,
    ids: list[int] | None,
    max_tokens: int | None,
    logprobs: int | None,
) -> TextRequest:
    for name in _UNSUPPORTED:
        value = (body.model_extra or {}).get(name)
        if value not in (None, False, "", [], {}) and value != _NO_OP.get(name, 0):
            raise errors.InvalidArgumentError(name, "is not supported by this server")
    return TextRequest(
        model=body.model,
        prompt=prompt,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        priority=body.priority or 0,  # _answer applies the API key's cap
        ignore_eos=body.ignore_eos,
        request_id=body.request_id,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
    )


def _bounded_bodies(
    s: GatewaySettings, max_model_len: int
) -> tuple[type[CompletionBody], type[ChatBody]]:
    """The request bodies with this gateway's limits in their schema (and so in its OpenAPI document)."""
    ident = Annotated[str, Field(max_length=s.max_id_chars)]
    stop = Annotated[
        list[Annotated[str, Field(max_length=s.max_stop_chars)]],
        BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
        Field(max_length=s.max_stop_strings),
    ]
    shared = {
        "model": (ident, ""),
        "request_id": (ident, ""),
        "stop": (stop, []),
        "stop_token_ids": (Annotated[list[int], Field(max_length=s.max_stop_strings)], []),
    }
    ids = Annotated[list[int], Field(max_length=max_model_len)]
    # Picked by the value's shape, so a refusal names the one form that was sent (a plain union
    # would list why the value is none of the four).
    prompt = Annotated[
        Annotated[str, Tag("str")]
        | Annotated[ids, Tag("list[int]")]
        | Annotated[list[str], Field(max_length=64), Tag("list[str]")]
        | Annotated[list[ids], Field(max_length=64), Tag("list[list[int]]")],
        Discriminator(
            _prompt_form,
            custom_error_type="prompt_form",
            custom_error_message="must be a string, a list of token ids, or a list holding one "
            "of those",
        ),
    ]
    completion = create_model(
        "CompletionBody", __base__=CompletionBody, prompt=(prompt, ...), **shared
    )
    chat = create_model(
        "ChatBody",
        __base__=ChatBody,
        **shared,
        messages=(Annotated[list[ChatMessage], Field(max_length=s.max_messages)], ...),
    )
    return completion, chat


def _prompt_form(value: Any) -> str | None:
    """Which form of `prompt` a value is meant as (its first element decides for a list)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return {str: "list[str]", list: "list[list[int]]"}.get(type(first), "list[int]")


def _completion_prompt(
    p: str | list[int] | list[str] | list[list[int]],
) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids); OpenAI's batch form is accepted only with one prompt."""
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise errors.InvalidArgumentError(
                "prompt", f"got {len(p)} prompts; send one prompt per request"
            )
        p = p[0]
    return (p, None) if isinstance(p, str) else (None, list(p))


# Says which template rendered a chat: "checkpoint", or "builtin" when the checkpoint has none.
CHAT_TEMPLATE_HEADER = "X-Moe-Mesh-Chat-Template"


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as plain dicts; content given as parts keeps the text parts."""
    if not messages:
        raise errors.InvalidArgumentError("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise errors.InvalidArgumentError(
                    "messages", f"messages[{i}]: only text content parts are supported"
                )
            content = "".join(part.text or "" for part in m.content)
        else:
            content = m.content or ""
        check_unicode("messages", content, f"messages[{i}].content: ")
        # Extra fields (name, tool_call_id, ...) reach the template as clients sent them.
        out.append({**(m.model_extra or {}), "role": m.role, "content": content})
    return out


def builtin_chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """For checkpoints without a template: "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n".

    Plain text that any tokenizer can encode.
    """
    out = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return out + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(core: GatewayCore, body: ChatBody) -> tuple[str, str]:
    """(prompt text, which template rendered it)."""
    messages = _messages(body.messages)
    template = core.tokenizer.chat_template
    if template is None:
        if body.chat_template_kwargs:
            raise errors.InvalidArgumentError(
                "chat_template_kwargs", "the model has no chat template to pass them to"
            )
        return builtin_chat_prompt(messages, body.add_generation_prompt), "builtin"
    text = template.render(messages, body.add_generation_prompt, body.chat_template_kwargs)
    return text, "checkpoint"


@contextmanager
def _fields_named(**names: str) -> Iterator[None]:
    """Report the core's field names (e.g. prompt_token_ids) as this API's (prompt)."""
    try:
        yield
    except errors.InvalidArgumentError as e:
        if e.field not in names:
            raise
        raise errors.InvalidArgumentError(
            names[e.field], str(e).removeprefix(f"{e.field}: ")
        ) from e


# -- responses -----------------------------------------------------------------------------------

_ERRORS: list[tuple[type[errors.MoeMeshError], int, str, str]] = [
    (errors.InvalidArgumentError, 400, "invalid_request_error", "invalid_argument"),
    (errors.AlreadyExistsError, 409, "invalid_request_error", "already_exists"),
    (errors.PreconditionError, 400, "invalid_request_error", "failed_precondition"),
    (errors.ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (errors.NotFoundError, 404, "not_found_error", "not_found"),
    (errors.UnauthenticatedError, 401, "invalid_request_error", "invalid_api_key"),
    (errors.ResourceExhaustedError, 429, "rate_limit_error", "resource_exhausted"),
    (errors.UnavailableError, 503, "service_unavailable_error", "unavailable"),
    (errors.DeadlineExceededError, 504, "timeout_error", "deadline_exceeded"),
]


def _error_body(e: Exception) -> tuple[int, dict]:
    status, type_, code = next(
        ((s, t, c) for cls, s, t, c in _ERRORS if isinstance(e, cls)),
        (500, "server_error", "internal"),
    )
    param = (
        e.field
        if isinstance(
            e,
            (errors.InvalidArgumentError, errors.AlreadyExistsError, errors.ModelNotFoundError),
        )
        else None
    )
    # A bug's message says nothing a client can act on and may describe internals: it goes to the log.
    message = str(e) if isinstance(e, errors.MoeMeshError) else "internal server error"
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: Exception) -> JSONResponse:
    status, body = _error_body(e)
    headers = {}
    if isinstance(e, errors.UnauthenticatedError):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(e, errors.ResourceExhaustedError):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))  # HTTP wants whole seconds
    return JSONResponse(body, status, headers)


def _invalid_request(message: str, param: str | None) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_argument",
            }
        },
        400,
    )


def _usage(ds: list[Delta]) -> dict:
    """The prompt once, the completions of every choice."""
    prompt, completion = ds[0].prompt_tokens, sum(d.completion_tokens for d in ds)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-Sent Events over an admitted generation, closed however the response ends."""

    def __init__(self, generation: Choices, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.generation, self.events = generation, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # On disconnect Starlette cancels the body task but closes neither the iterator nor the
            # generation, whose admission place would then stay taken until garbage collection.
            # Close both here, shielded: this runs inside the cancelled scope.
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]
                await self.generation.aclose()


async def _events(
    deltas: AsyncIterator[tuple[int, Delta]],
    request_id: str,
    head: dict,
    include_usage: bool,
    choice: Callable[[Delta, int, bool], dict],
) -> AsyncIterator[bytes]:
    """OpenAI chunk stream: one chunk per delta of any choice, an optional usage chunk, then [DONE]."""
    last: dict[int, Delta] = {}
    usage = {"usage": None} if include_usage else {}
    try:
        async for i, d in deltas:
            yield _sse({**head, "choices": [choice(d, i, i not in last)], **usage})
            last[i] = d
    except errors.MoeMeshError as e:  # the status line is long gone: report in-band, as OpenAI does
        log.info("stream %s failed: %s", request_id, e)
        yield _sse(_error_body(e)[1])
    else:
        if include_usage and last:
            yield _sse({**head, "choices": [], "usage": _usage(list(last.values()))})
    yield b"data: [DONE]\n\n"


async def _first_delta(request: Request, choices: Choices) -> AsyncIterator | None:
    """`choices`' deltas once the first has come (None if the client left first). A generation that
    fails before its first token raises here, so the client gets an HTTP status it can act on
    (the openai client retries a 503) instead of a 200 carrying an error event."""
    deltas = choices.deltas()
    try:
        first = await _unless_disconnected(request, anext(deltas, _END))
    except BaseException:
        await choices.aclose()
        raise
    if first is None:
        await choices.aclose()
        return None

    async def chained() -> AsyncIterator[tuple[int, Delta]]:
        if first is not _END:
            yield first
            async for item in deltas:
                yield item

    return chained()


_END = object()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (None) if the client goes away first.

    Starlette keeps running a handler whose client left; without this, an abandoned request would
    keep its admission place and router slot until it finished.
    """
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scope.cancel()

        watcher = asyncio.create_task(watch())
        try:
            return await work
        finally:
            watcher.cancel()
    return None


@dataclass
class _Shape:
    """How one endpoint spells its responses."""

    id_prefix: str
    object: str
    chunk_object: str
    chunk: Callable[[Delta, int, bool], dict]  # (delta, index, its first) -> a streamed choice
    whole: Callable[[Delta, int], dict]  # (a whole generation as one delta, index) -> the choice


def _token_ids(on: bool, ids: list[int]) -> dict:
    return {"token_ids": ids} if on else {}


class _Authenticate:
    """ASGI middleware: under API keys, a /v1/ request without a good key gets 401 before its body
    is read; an accepted one carries its caller in `request.state.caller`. Health and metrics
    stay open, for probes and scrapers (vLLM's choice too)."""

    def __init__(self, app: ASGIApp, core: GatewayCore) -> None:
        self.app, self.core = app, core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        try:
            caller = (
                self.core.authenticate(authorization)
                if scope["path"].startswith("/v1/")
                else Caller(None)
            )
        except errors.UnauthenticatedError as e:
            log.info("%s %s refused: %s", scope["method"], scope["path"], e)
            await _error_response(e)(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before it is read (by its Content-Length),
    or, sent chunked, as soon as the bytes read pass the limit. Either way nothing parses it."""

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[str], None]) -> None:
        self.app, self.limit, self.refused = app, limit, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            # No "Connection: close": uvicorn then discards the rest of the body as it arrives, unparsed,
            # so the client finishes sending and reads this answer instead of a reset connection.
            self.refused("RESOURCE_EXHAUSTED")
            response = JSONResponse(self._error(int(length)), 413)
            await response(scope, receive, send)
            return
        read = 0

        async def bounded() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            # Raised inside the route's body read: FastAPI passes HTTP errors through.
            if read > self.limit:
                raise StarletteHTTPException(413, self._error(read)["error"]["message"])
            return message

        await self.app(scope, bounded, send)

    def _error(self, size: int) -> dict:
        return {
            "error": {
                "message": f"the request body ({size} bytes or more) exceeds the limit of {self.limit} "
                "bytes (max_body_bytes)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }


# -- the app -------------------------------------------------------------------------------------


async def _on_mesh_error(request: Request, e: errors.MoeMeshError) -> JSONResponse:
    log.info("%s %s failed: %s", request.method, request.url.path, e)
    request.app.state.core.count_failure(e)
    return _error_response(e)


async def _on_invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
    request.app.state.core.count_failure("INVALID_ARGUMENT")
    problems = e.errors()
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":
        return _invalid_request(
            f"malformed JSON body: {first.get('ctx', {}).get('error', '')}", None
        )
    loc = tuple(first.get("loc", ()))
    if loc[:1] != ("body",) or len(loc) < 2:
        got = "an empty body" if first.get("type") == "missing" else first.get("msg", "").lower()
        sent = request.headers.get("content-type") or "none"
        return _invalid_request(
            "the body must be a JSON object, sent as application/json "
            f"(this request: {got}; content type {sent})",
            None,
        )
    param = str(loc[1])
    # Name every alternative of a union field (e.g. prompt.str, prompt.list[int]) in the message.
    details = dict.fromkeys(
        f"{'.'.join(map(str, p['loc'][1:]))}: {p['msg']}"
        for p in problems
        if len(p["loc"]) > 1 and str(p["loc"][1]) == param
    )
    return _invalid_request("; ".join(details), param)


# HTTP statuses the server answers itself, as the gRPC codes moe_errors_total counts by
_HTTP_CODES = {404: "NOT_FOUND", 405: "UNIMPLEMENTED", 413: "RESOURCE_EXHAUSTED"}


async def _on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    request.app.state.core.count_failure(_HTTP_CODES.get(e.status_code, "INVALID_ARGUMENT"))
    code = {413: "request_too_large"}.get(e.status_code)
    error = {"message": str(e.detail), "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": error}, e.status_code, e.headers)


async def _on_bug(request: Request, e: Exception) -> JSONResponse:
    # Starlette re-raises it afterwards, so the server logs the traceback.
    request.app.state.core.count_failure(e)
    return _error_response(e)


async def _answer(
    core: GatewayCore,
    request: Request,
    body: _Body,
    r: TextRequest,
    shape: _Shape,
    names: dict[str, str],
) -> Response:
    """Run `r` (n times for n choices) and answer in `shape`; the core's field names are reported as
    this endpoint's `names`."""
    # The key's rate and priority cap; n counts once.
    r = replace(r, priority=request.state.caller.admit(body.priority))
    n = 1 if body.n is None else body.n
    if not 1 <= n <= core.settings.max_choices:
        raise errors.InvalidArgumentError(
            "n", f"must be in [1, {core.settings.max_choices}], got {n}"
        )
    requests = requests_for(r, n)
    with _fields_named(**names):
        if body.stream:
            # Validation, admission and a failure before the first token leave here, as an HTTP
            # status, before any SSE byte.
            choices = await _unless_disconnected(request, Choices.start(core, requests))
            deltas = choices and await _first_delta(request, choices)
            if deltas is None:
                return Response(status_code=499)  # the client left while queued or prefilling
            head = {
                "id": shape.id_prefix + choices.request_id,
                "object": shape.chunk_object,
                "created": int(time.time()),
                "model": core.served_names[0],
            }
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _events(deltas, choices.request_id, head, include_usage, shape.chunk)
            return _EventStream(choices, events)
        done = await _unless_disconnected(request, _complete_all(core, requests))
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
    return JSONResponse(
        {
            "id": shape.id_prefix + done[0].request_id,
            "object": shape.object,
            "created": int(time.time()),
            "model": core.served_names[0],
            "choices": [shape.whole(d, i) for i, d in enumerate(wholes)],
            "usage": _usage(wholes),
            **({"prompt_token_ids": done[0].prompt_token_ids} if body.return_token_ids else {}),
        }
    )


async def _complete_all(core: GatewayCore, requests: list[TextRequest]) -> list[Completion]:
    """Every request to its end; one failing cancels the others, and its error is the answer."""
    if len(requests) == 1:
        return [await core.complete(requests[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(core.complete(r)) for r in requests]
    except ExceptionGroup as e:
        raise e.exceptions[0] from None
    return [t.result() for t in tasks]


def create_app(core: GatewayCore, metrics: Any = None) -> FastAPI:
    """The HTTP app over `core`. `app.state.ready` (True at creation) and `core.draining` drive
    /health/ready and /health; `metrics` (a prometheus_client registry) is served at /metrics."""
    app = FastAPI(title="moe-mesh gateway")
    app.add_middleware(_BodyLimit, limit=core.settings.max_body_bytes, refused=core.count_failure)
    app.add_middleware(_Authenticate, core=core)  # added last: runs first
    app.add_exception_handler(errors.MoeMeshError, _on_mesh_error)
    app.add_exception_handler(RequestValidationError, _on_invalid_body)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_bug)
    app.state.ready = True
    app.state.core = core  # for the exception handlers
    started = int(time.time())
    Completion, Chat = _bounded_bodies(core.settings, core.model.max_model_len)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready")
    @app.get("/health")  # vLLM's name for it, which load balancers and probes are set up with
    async def ready() -> JSONResponse:
        ok = bool(app.state.ready) and not core.draining
        return JSONResponse({"status": "ready" if ok else "not ready"}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise StarletteHTTPException(404, "this gateway collects no metrics")
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    def model_object(m: ModelInfo) -> dict:
        return {
            "id": m.id,
            "object": "model",
            "created": started,
            "owned_by": "moe-mesh",
            "architecture": m.architecture,
            "max_model_len": m.max_model_len,
            "vocab_size": m.vocab_size,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object(m) for m in core.list_models()]}

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes (a Hub id)
    async def model(model: str) -> dict:
        return model_object(core.served_model(model))

    @app.post("/v1/completions")
    async def completions(body: Completion, request: Request) -> Response:
        text, ids = _completion_prompt(body.prompt)
        if body.echo and body.logprobs is not None:
            raise errors.InvalidArgumentError(
                "echo",
                "echo with logprobs needs the prompt's logprobs, which this server does not compute",
            )
        r = _text_request(body, text, ids, body.max_tokens, body.logprobs)
        echo = (text if text is not None else core.tokenizer.decode(ids or [])) if body.echo else ""
        offsets: dict[int, int] = {}  # choice -> characters of its text so far

        def choice(d: Delta, index: int, first: bool = True) -> dict:
            prefix = echo if first else ""
            start = offsets.get(index, 0)
            offsets[index] = start + len(prefix) + len(d.text)
            lp = completion_logprobs(d.logprobs, core.tokenizer, d.token_ids, start)
            return {
                "index": index,
                "text": prefix + d.text,
                "logprobs": lp,
                "finish_reason": d.finish_reason,
                **_token_ids(body.return_token_ids, d.token_ids),
            }

        shape = _Shape("cmpl-", "text_completion", "text_completion", choice, choice)
        return await _answer(core, request, body, r, shape, {"prompt_token_ids": "prompt"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, request: Request) -> Response:
        max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        prompt, template = render_chat(core, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.InvalidArgumentError("top_logprobs", "needs logprobs: true")
        r = _text_request(body, prompt, None, getattr(body, max_field), top)
        r.add_special_tokens = False  # the template wrote the special tokens it wants
        r.fills_context = True

        def logprobs(d: Delta) -> dict | None:
            return chat_logprobs(d.logprobs, core.tokenizer.token_text, d.token_ids)

        def chunk(d: Delta, index: int, first: bool) -> dict:
            delta = {"role": "assistant", "content": d.text} if first else {"content": d.text}
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs(d),
                "finish_reason": d.finish_reason,
                **_token_ids(body.return_token_ids, d.token_ids),
            }

        def whole(d: Delta, index: int) -> dict:
            return {
                "index": index,
                "message": {"role": "assistant", "content": d.text},
                "logprobs": logprobs(d),
                "finish_reason": d.finish_reason,
                **_token_ids(body.return_token_ids, d.token_ids),
            }

        shape = _Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chunk, whole)
        response = await _answer(
            core,
            request,
            body,
            r,
            shape,
            {"prompt": "messages", "prompt_token_ids": "messages", "max_tokens": max_field},
        )
        response.headers[CHAT_TEMPLATE_HEADER] = template
        return response

    return app
