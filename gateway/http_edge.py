"""What the HTTP app does around its routes: OpenAI's error body for every failure, the exception
handlers that answer and count failures (each request's once: it gets one answer), and the
middlewares that refuse a bad API key or an oversized body before the body is read."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import errors
from gateway.auth import Caller
from gateway.core import GatewayCore

log = logging.getLogger(__name__)

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


def error_body(e: Exception) -> tuple[int, dict]:
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


def error_response(e: Exception) -> JSONResponse:
    status, body = error_body(e)
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


class Authenticate:
    """ASGI middleware: under API keys, a /v1/ request, or one for a path of `guarded` (the OpenAPI
    document and its pages, which describe the API), without a good key gets 401 before its body is
    read; an accepted one carries its caller in `request.state.caller`. Health and metrics stay
    open, for probes and scrapers (vLLM's choice too)."""

    def __init__(
        self, app: ASGIApp, core: GatewayCore, guarded: frozenset[str] = frozenset()
    ) -> None:
        self.app, self.core, self.guarded = app, core, guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        try:
            caller = (
                self.core.authenticate(authorization)
                if scope["path"].startswith("/v1/") or scope["path"] in self.guarded
                else Caller(None)
            )
        except errors.UnauthenticatedError as e:
            log.info("%s %s refused: %s", scope["method"], scope["path"], e)
            self.core.count_failure(e)
            await error_response(e)(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)


class BodyLimit:
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


async def _on_mesh_error(request: Request, e: errors.MoeMeshError) -> JSONResponse:
    log.info("%s %s failed: %s", request.method, request.url.path, e)
    request.app.state.core.count_failure(e)
    return error_response(e)


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
    unknown = [
        str(p["loc"][1]) for p in problems if p["type"] == "extra_forbidden" and len(p["loc"]) == 2
    ]
    if first.get("type") == "extra_forbidden" and unknown:
        return _invalid_request(_unknown_fields(unknown), unknown[0])
    param = str(loc[1])
    # Name every alternative of a union field (e.g. prompt.str, prompt.list[int]) in the message.
    details = dict.fromkeys(
        f"{'.'.join(map(str, p['loc'][1:]))}: {p['msg']}"
        for p in problems
        if len(p["loc"]) > 1 and str(p["loc"][1]) == param
    )
    return _invalid_request("; ".join(details), param)


def _unknown_fields(names: list[str]) -> str:
    listed = ", ".join(repr(n) for n in names)
    return (
        f"unknown field{'s' if len(names) > 1 else ''} {listed}: neither OpenAI's API nor this "
        "server defines it (the gateway's --allow-unknown-fields would accept and ignore it)"
    )


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
    return error_response(e)


def install(app: FastAPI, core: GatewayCore) -> None:
    """The middlewares and exception handlers of an app over `core`."""
    app.add_middleware(BodyLimit, limit=core.settings.max_body_bytes, refused=core.count_failure)
    # The OpenAPI document and its pages: FastAPI's paths, None when turned off.
    docs = (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    guarded = frozenset(path for path in docs if path)
    app.add_middleware(Authenticate, core=core, guarded=guarded)  # added last: runs first
    app.add_exception_handler(errors.MoeMeshError, _on_mesh_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_invalid_body)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_bug)
