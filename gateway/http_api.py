"""OpenAI-compatible HTTP API: converts JSON to the core's types and back. The request bodies are
in gateway/openai_schema.py, running and answering in gateway/openai_answer.py, error bodies,
exception handlers and middlewares in gateway/http_edge.py.

    POST /v1/completions        prompt: a string, token ids, or a list of either (one choice each)
    POST /v1/chat/completions   messages rendered by the checkpoint's chat template (`render_chat`)
    GET  /v1/models             the served model, OpenAI list shape
    GET  /v1/models/{name}      one served name, or 404 model_not_found
    GET  /health/live           200 while the process serves HTTP
    GET  /health/ready, /health 200 while `app.state.ready`, else 503
    GET  /metrics               the gateway's Prometheus metrics (also on --metrics-port if set)
    GET  /openapi.json, /docs, /redoc   unless disable_fastapi_docs; behind the API key when keys are on

Both generation endpoints stream as Server-Sent Events with `"stream": true`. They take OpenAI's
sampling fields, penalties (`presence_penalty`, `frequency_penalty`) and logprobs (`logprobs`, chat's
`top_logprobs`), completions' `echo` (not with logprobs: prompt logprobs are not computed), and
vLLM-style extensions: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `priority`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (adds `token_ids` to every choice and, unless
streaming, `prompt_token_ids` to the response, or to each choice for a list of prompts),
`chat_template_kwargs`, `add_generation_prompt` and `request_id` (a duplicate of one in flight is
409). A field nobody defines is a 400 naming it, unless `allow_unknown_fields`; OpenAI's fields this
server does not implement are ignored when they cannot change the result and otherwise refused
unless set to their no-op value (openai_schema.IGNORED, REFUSED). Values are validated by the core;
every error uses OpenAI's `{"error": {message, type, param, code}}` shape, `param` naming the field.
"""

# No `from __future__ import annotations`: the generation routes' body types are built per app
# (limits come from the settings), and FastAPI resolves string annotations in module globals only.

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import errors
from gateway import http_edge
from gateway.choices import chat_logprobs, completion_logprobs
from gateway.core import GatewayCore, TextRequest, check_unicode
from gateway.openai_answer import Shape, answer, token_ids
from gateway.openai_sampling import sampling_params
from gateway.openai_schema import (
    Body,
    ChatBody,
    ChatMessage,
    CompletionBody,
    bounded_bodies,
    refuse_unsupported,
)
from gateway.router_client import ModelInfo
from gateway.stream import Delta

B = TypeVar("B", bound=Body)

# -- requests ------------------------------------------------------------------------------------


def _text_request(
    body: Body, prompt: str | None, ids: list[int] | None, prompt_names: dict[str, str]
) -> TextRequest:
    """The request `body` makes; its errors name this endpoint's fields (`prompt_names` for the
    core's prompt fields, the sampling mapping's for the rest)."""
    refuse_unsupported(body)
    params, names = sampling_params(body)
    return TextRequest(
        model=body.model,
        prompt=prompt,
        prompt_token_ids=ids,
        params=params,
        stop=body.stop,
        priority=body.priority or 0,  # answer() applies the API key's cap
        request_id=body.request_id,
        names={**prompt_names, **names},
    )


def _completion_prompts(
    p: str | list[int] | list[str] | list[list[int]],
) -> list[tuple[str | None, list[int] | None]]:
    """(text, None) or (None, token ids) for each prompt: OpenAI's list of prompts is several."""
    several = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
    prompts: list[Any] = list(p) if several else [p]
    return [(q, None) if isinstance(q, str) else (None, list(q)) for q in prompts]


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
    prompts = _completion_prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise errors.InvalidArgumentError(
            "echo",
            "echo with logprobs needs the prompt's logprobs, which this server does not compute",
        )
    requests = [_text_request(body, t, ids, {"prompt_token_ids": "prompt"}) for t, ids in prompts]
    n = body.n or 1  # answer() refuses a bad n before any choice is spelled
    offsets: dict[int, int] = {}  # choice -> characters of its text so far

    def echo(index: int) -> str:
        text, ids = prompts[index // n]
        return (text if text is not None else core.tokenizer.decode(ids or [])) if body.echo else ""

    def choice(d: Delta, index: int, first: bool = True) -> dict:
        prefix = echo(index) if first else ""
        start = offsets.get(index, 0)
        offsets[index] = start + len(prefix) + len(d.text)
        lp = completion_logprobs(d.logprobs, core.tokenizer, d.token_ids, start)
        return {
            "index": index,
            "text": prefix + d.text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            **token_ids(body.return_token_ids, d.token_ids),
        }

    shape = Shape("cmpl-", "text_completion", "text_completion", choice, choice)
    return await answer(request, body, requests, shape)


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
            **token_ids(body.return_token_ids, d.token_ids),
        }

    shape = Shape(
        "chatcmpl-",
        "chat.completion",
        "chat.completion.chunk",
        lambda d, index, first: message(d, index, first, "delta"),
        lambda d, index: message(d, index, True, "message"),
    )
    response = await answer(request, body, [r], shape)
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
    if core.settings.disable_fastapi_docs:
        app = FastAPI(title="moe-mesh gateway", openapi_url=None, docs_url=None, redoc_url=None)
    else:
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
