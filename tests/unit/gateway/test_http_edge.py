"""Around the HTTP routes: OpenAI's error body per error class, the exception handlers and
middlewares answering (and counting, once) a bad key, an oversized body, a bad body and a bug."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request

from common import errors
from gateway.auth import ApiKeys
from gateway.http_edge import error_body, error_response, install


class Core:
    """What the edge needs of a core: the body limit, the keys, and a failure counter."""

    def __init__(self, keys: str = "") -> None:
        self.settings = SimpleNamespace(max_body_bytes=64)
        self.keys = ApiKeys(env_keys=keys)
        self.counted: list[str] = []

    def authenticate(self, authorization: str | None):
        return self.keys.authenticate(authorization)

    def count_failure(self, error) -> None:
        self.counted.append(error if isinstance(error, str) else type(error).__name__)


def app_over(core: Core) -> FastAPI:
    app = FastAPI()
    install(app, core)  # type: ignore[arg-type]
    app.state.core = core

    @app.post("/v1/echo")
    async def echo(request: Request, body: dict) -> dict:
        return {"caller": request.state.caller.key is not None, **body}

    @app.get("/v1/fail")
    async def fail(kind: str) -> dict:
        if kind == "busy":
            raise errors.ResourceExhaustedError("queue full", retry_after_s=2.5)
        raise RuntimeError("a bug")

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


def client(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


@pytest.mark.parametrize(
    ("error", "status", "type_", "code", "param"),
    [
        (
            errors.InvalidArgumentError("top_p", "bad"),
            400,
            "invalid_request_error",
            "invalid_argument",
            "top_p",
        ),
        (
            errors.AlreadyExistsError("request_id", "dup"),
            409,
            "invalid_request_error",
            "already_exists",
            "request_id",
        ),
        (
            errors.ModelNotFoundError("no such model"),
            404,
            "invalid_request_error",
            "model_not_found",
            "model",
        ),
        (
            errors.UnauthenticatedError("no key"),
            401,
            "invalid_request_error",
            "invalid_api_key",
            None,
        ),
        (errors.UnavailableError("gone"), 503, "service_unavailable_error", "unavailable", None),
        (errors.DeadlineExceededError("late"), 504, "timeout_error", "deadline_exceeded", None),
        (RuntimeError("secret internals"), 500, "server_error", "internal", None),
    ],
)
def test_each_error_class_has_its_status_and_openai_body(error, status, type_, code, param) -> None:
    got, body = error_body(error)
    assert got == status
    message = "internal server error" if status == 500 else str(error)
    assert body == {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_headers_a_client_acts_on() -> None:
    busy = error_response(errors.ResourceExhaustedError("full", retry_after_s=0.2))
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"  # whole seconds
    assert error_response(errors.UnauthenticatedError("x")).headers["WWW-Authenticate"] == "Bearer"


async def test_a_bad_key_is_refused_before_the_body_and_counted_once() -> None:
    core = Core(keys="sk-good-key")
    async with client(app_over(core)) as h:
        refused = await h.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer x"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert (await h.get("/health")).status_code == 200  # probes need no key
        good = await h.post(
            "/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer sk-good-key"}
        )
        assert good.json() == {"caller": True, "a": 1}
    assert core.counted == ["UnauthenticatedError"]


async def test_the_openapi_document_and_its_pages_need_the_key_when_keys_are_on() -> None:
    async with client(app_over(Core(keys="sk-good-key"))) as c:
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        good = {"Authorization": "Bearer sk-good-key"}
        assert (await c.get("/openapi.json", headers=good)).status_code == 200
        assert (await c.get("/docs", headers=good)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # probes stay open
    async with client(app_over(Core())) as c:  # keys off: open
        assert (await c.get("/openapi.json")).status_code == 200


async def test_an_oversized_body_is_413_by_length_or_as_it_arrives() -> None:
    core = Core()
    async with client(app_over(core)) as h:
        declared = await h.post("/v1/echo", content=b"{}" + b" " * 100)
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "request_too_large"

        async def chunks():
            for _ in range(10):
                yield b" " * 10

        streamed = await h.post("/v1/echo", content=chunks())
        assert streamed.status_code == 413
    assert core.counted == ["RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]


async def test_bad_bodies_errors_and_bugs_are_answered_and_counted_once() -> None:
    core = Core()
    async with client(app_over(core)) as h:
        malformed = await h.post(
            "/v1/echo", content=b"{", headers={"content-type": "application/json"}
        )
        assert (
            malformed.status_code == 400
            and "malformed JSON" in malformed.json()["error"]["message"]
        )
        not_object = await h.post("/v1/echo", json=[1])
        assert not_object.status_code == 400 and not_object.json()["error"]["param"] is None
        busy = await h.get("/v1/fail", params={"kind": "busy"})
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "3"
        bug = await h.get("/v1/fail", params={"kind": "bug"})
        assert bug.status_code == 500 and "a bug" not in bug.text
        assert (await h.get("/nowhere")).status_code == 404
    assert core.counted == [
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "ResourceExhaustedError",
        "RuntimeError",
        "NOT_FOUND",
    ]
