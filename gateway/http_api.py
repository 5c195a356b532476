"""OpenAI-compatible HTTP API: converts JSON to the core's types and back. The request bodies are
in gateway/openai_schema.py, error bodies, exception handlers and middlewares in gateway/http_edge.py.

    POST /v1/completions        prompt: a string, token ids, or a list holding exactly one of those
    POST /v1/chat/completions   messages rendered by the checkpoint's chat template (`render_chat`)
    GET  /v1/models             the served model, OpenAI list shape
    GET  /v1/models/{name}      one served name, or 404 model_not_found
    GET  /health/live           200 while the process serves HTTP
    GET  /health/ready, /health 200 while `app.state.ready`, else 503
    GET  /metrics               the gateway's Prometheus metrics (also on --metrics-port if set)

Both generation endpoints stream as Server-Sent Events with `"stream": true`. They take OpenAI's
sampling fields, penalties (`presence_penalty`, `frequency_penalty`) and logprobs (`logprobs`, chat's
`top_logprobs`), completions' `echo` (not with logprobs: prompt logprobs are not computed), and
vLLM-style extensions: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `priority`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (adds `token_ids` to every choice and, unless
streaming, `prompt_token_ids` to the response), `chat_template_kwargs`, `add_generation_prompt` and
`request_id` (a duplicate of one in flight is 409). Unknown fields are ignored, since OpenAI clients
send some; OpenAI features this server cannot honour (`best_of`, `suffix`, `logit_bias`, `tools`,
`functions`, `response_format`) are refused unless set to their no-op value. Values are validated by
the core; every error uses OpenAI's `{"error": {message, type, param, code}}` shape, `param` naming
the field.
"""

# No `from __future__ import annotations`: the generation routes' body types are built per app
# (limits come from the settings), and FastAPI resolves string annotations in module globals only.

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from common import errors
from gateway import http_edge
from gateway.choices import (
    Choices,
    chat_logprobs,
    complete_all,
    completion_logprobs,
    requests_for,
)
from gateway.core import GatewayCore, TextRequest, check_unicode
from gateway.openai_sampling import sampling_params
from gateway.openai_schema import Body, ChatBody, ChatMessage, CompletionBody, bounded_bodies
from gateway.router_client import ModelInfo
from gateway.stream import Delta

log = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", bound=Body)

# -- requests ------------------------------------------------------------------------------------

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
    body: Body, prompt: str | None, ids: list[int] | None, prompt_names: dict[str, str]
) -> TextRequest:
    """The request `body` makes; its errors name this endpoint's fields (`prompt_names` for the
    core's prompt fields, the sampling mapping's for the rest)."""
    for name in _UNSUPPORTED:
        value = (body.model_extra or {}).get(name)
        if value not in (None, False, "", [], {}) and value != _NO_OP.get(name, 0):
            raise errors.InvalidArgumentError(name, "is not supported by this server")
    params, names = sampling_params(body)
    return TextRequest(
        model=body.model,
        prompt=prompt,
        prompt_token_ids=ids,
        params=params,
        stop=body.stop,
        priority=body.priority or 0,  # _answer applies the API key's cap
        request_id=body.request_id,
        names={**prompt_names, **names},
    )


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


# -- responses ---------------------------------------------------------------------------------


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


async def _events(
    core: GatewayCore,
    choices: Choices,
    head: dict,
    include_usage: bool,
    choice: Callable[[Delta, int, bool], dict],
) -> AsyncIterator[bytes]:
    """OpenAI chunk stream: one chunk per delta of any choice, an optional usage chunk, then [DONE]."""
    last: dict[int, Delta] = {}
    usage = {"usage": None} if include_usage else {}
    try:
        async for i, d in choices.deltas():
            yield _sse({**head, "choices": [choice(d, i, i not in last)], **usage})
            last[i] = d
    except errors.MoeMeshError as e:  # the status line is long gone: report in-band, as OpenAI does
        log.info("stream %s failed: %s", choices.request_id, e)
        core.count_failure(e)
        yield _sse(http_edge.error_body(e)[1])
    else:
        if include_usage and last:
            yield _sse({**head, "choices": [], "usage": _usage(list(last.values()))})
    yield b"data: [DONE]\n\n"


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
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


async def _answer(request: Request, body: Body, r: TextRequest, shape: _Shape) -> Response:
    """Run `r` (n times for n choices) and answer in `shape`."""
    core: GatewayCore = request.app.state.core
    # The key's rate and priority cap; n counts once.
    r = replace(r, priority=request.state.caller.admit(body.priority))
    n = 1 if body.n is None else body.n
    if not 1 <= n <= core.settings.max_choices:
        raise errors.InvalidArgumentError(
            "n", f"must be in [1, {core.settings.max_choices}], got {n}"
        )
    requests = requests_for(r, n)
    if body.stream:
        return await _streamed(request, body, requests, shape)
    return await _whole(request, body, requests, shape)


async def _streamed(
    request: Request, body: Body, requests: list[TextRequest], shape: _Shape
) -> Response:
    """Validation, admission and a failure before the first token are answered with an HTTP status,
    before any SSE byte; a failure after it with an error event."""
    core: GatewayCore = request.app.state.core
    choices = await _until_disconnect(request, Choices.open(core, requests))
    if choices is None:
        return Response(status_code=499)  # the client left while queued or prefilling
    head = {
        "id": shape.id_prefix + choices.request_id,
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": core.served_names[0],
    }
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return _EventStream(choices, _events(core, choices, head, include_usage, shape.chunk))


async def _whole(
    request: Request, body: Body, requests: list[TextRequest], shape: _Shape
) -> Response:
    core: GatewayCore = request.app.state.core
    done = await _until_disconnect(request, complete_all(core, requests))
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


# -- routes --------------------------------------------------------------------------------------

routes = APIRouter()


@routes.get("/health/live")
async def live() -> dict:
    return {"status": "live"}


@routes.get("/health/ready")
@routes.get("/health")  # vLLM's name for it, which load balancers and probes are set up with
async def ready(request: Request) -> JSONResponse:
    ok = bool(request.app.state.ready) and not request.app.state.core.draining
    return JSONResponse({"status": "ready" if ok else "not ready"}, 200 if ok else 503)


@routes.get("/metrics")
async def prometheus(request: Request) -> Response:
    if request.app.state.metrics is None:
        raise StarletteHTTPException(404, "this gateway collects no metrics")
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


def _model_object(m: ModelInfo, created: int) -> dict:
    return {
        "id": m.id,
        "object": "model",
        "created": created,
        "owned_by": "moe-mesh",
        "architecture": m.architecture,
        "max_model_len": m.max_model_len,
        "vocab_size": m.vocab_size,
    }


@routes.get("/v1/models")
async def models(request: Request) -> dict:
    state = request.app.state
    return {
        "object": "list",
        "data": [_model_object(m, state.started) for m in state.core.list_models()],
    }


@routes.get("/v1/models/{model:path}")  # a served name may hold slashes (a Hub id)
async def model(model: str, request: Request) -> dict:
    state = request.app.state
    return _model_object(state.core.served_model(model), state.started)


async def completions(body: CompletionBody, request: Request) -> Response:
    core: GatewayCore = request.app.state.core
    text, ids = _completion_prompt(body.prompt)
    if body.echo and body.logprobs is not None:
        raise errors.InvalidArgumentError(
            "echo",
            "echo with logprobs needs the prompt's logprobs, which this server does not compute",
        )
    r = _text_request(body, text, ids, {"prompt_token_ids": "prompt"})
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
    return await _answer(request, body, r, shape)


async def chat_completions(body: ChatBody, request: Request) -> Response:
    core: GatewayCore = request.app.state.core
    prompt, template = render_chat(core, body)
    r = _text_request(body, prompt, None, {"prompt": "messages", "prompt_token_ids": "messages"})
    r.add_special_tokens = False  # the template wrote the special tokens it wants
    r.fills_context = True

    def message(d: Delta, index: int, first: bool, key: str) -> dict:
        content = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        return {
            "index": index,
            key: content,
            "logprobs": chat_logprobs(d.logprobs, core.tokenizer.token_text, d.token_ids),
            "finish_reason": d.finish_reason,
            **_token_ids(body.return_token_ids, d.token_ids),
        }

    shape = _Shape(
        "chatcmpl-",
        "chat.completion",
        "chat.completion.chunk",
        lambda d, index, first: message(d, index, first, "delta"),
        lambda d, index: message(d, index, True, "message"),
    )
    response = await _answer(request, body, r, shape)
    response.headers[CHAT_TEMPLATE_HEADER] = template
    return response


def _taking(
    body_type: type[B], handler: Callable[[B, Request], Awaitable[Response]]
) -> Callable[..., Awaitable[Response]]:
    """`handler` as a route whose body FastAPI validates as `body_type` (with the app's limits)."""

    async def route(body: body_type, request: Request) -> Response:  # type: ignore[valid-type]
        return await handler(body, request)

    return route


def create_app(core: GatewayCore, metrics: Any = None) -> FastAPI:
    """The HTTP app over `core`. `app.state.ready` (True at creation) and `core.draining` drive
    /health/ready and /health; `metrics` (a prometheus_client registry) is served at /metrics."""
    app = FastAPI(title="moe-mesh gateway")
    http_edge.install(app, core)
    app.state.ready, app.state.core, app.state.metrics = True, core, metrics
    app.state.started = int(time.time())
    app.include_router(routes)
    completion, chat = bounded_bodies(core.settings, core.model.max_model_len)
    for path, body_type, handler in (
        ("/v1/completions", completion, completions),
        ("/v1/chat/completions", chat, chat_completions),
    ):
        app.add_api_route(
            path, _taking(body_type, handler), methods=["POST"], name=handler.__name__
        )
    return app
