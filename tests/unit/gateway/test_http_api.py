"""The OpenAI-compatible HTTP app over a core with scripted routers, through httpx's ASGI transport:
status codes, error bodies naming the field, response and chunk shapes, and each failed request
counted once in moe_errors_total."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.telemetry import Telemetry
from gateway.core import GatewayCore
from gateway.http_api import CHAT_TEMPLATE_HEADER, create_app
from tests.support.fakes import FakeRouter, ScriptedRouter, core
from tests.support.net import asgi_post_scope
from tests.support.polling import eventually


@asynccontextmanager
async def serving(gw: GatewayCore, telemetry: Telemetry | None = None) -> AsyncIterator:
    app = create_app(gw, telemetry.registry if telemetry else None)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


@pytest.fixture
def telemetry() -> AsyncIterator[Telemetry]:
    t = Telemetry.create("gateway", collect_metrics=True)
    yield t
    t.shutdown()


def events(text: str) -> list:
    """The SSE payloads of a whole response, [DONE] as the string."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def errors_counted(client: httpx.AsyncClient) -> dict[str, float]:
    metrics = (await client.get("/metrics")).text
    return {
        s.labels["rpc_grpc_status_code"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "moe_errors_total"
    }


async def test_a_completion_has_openais_shape_with_token_ids_on_request(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    async with serving(gw) as client:
        r = await client.post(
            "/v1/completions",
            json={"prompt": [1, 2, 3], "max_tokens": 3, "return_token_ids": True},
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "m" and body["prompt_token_ids"] == [1, 2, 3]
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [8, 9, 10] and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_a_streamed_chat_sends_the_role_once_then_usage_then_done(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    async with serving(gw) as client:
        r = await client.post("/v1/chat/completions", json=request)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers[CHAT_TEMPLATE_HEADER] in ("checkpoint", "builtin")
    *chunks, usage, done = events(r.text)
    assert done == "[DONE]" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d.get("role") for d in deltas] == ["assistant", None, None]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert [c["usage"] for c in chunks] == [None] * 3
    assert len(sum((c["choices"][0]["token_ids"] for c in chunks), [])) == 3


async def test_n_streamed_choices_each_end_with_their_finish_reason(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    async with serving(gw) as client:
        r = await client.post(
            "/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 2, "n": 2, "stream": True, "seed": 3},
        )
    *chunks, done = events(r.text)
    assert done == "[DONE]"
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1] and len(chunks) == 4
    assert gw.admission.in_flight == 0


async def test_a_list_of_prompts_gives_choice_p_n_plus_i_and_usage_over_all(checkpoint) -> None:
    """Prompts of 2 and 4 ids (the scripted router's tokens depend on the length), n=2 each."""
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    sent = {"prompt": [[1, 2], [1, 2, 3, 4]], "max_tokens": 2, "n": 2, "return_token_ids": True}
    expected = {0: [7, 8], 1: [7, 8], 2: [9, 10], 3: [9, 10]}
    async with serving(gw) as client:
        whole = (await client.post("/v1/completions", json=sent)).json()
        streamed = await client.post(
            "/v1/completions",
            json={**sent, "stream": True, "stream_options": {"include_usage": True}},
        )
    got = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert list(got) == [0, 1, 2, 3] and got == expected
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [[1, 2]] * 2 + [[1, 2, 3, 4]] * 2
    assert "prompt_token_ids" not in whole  # which prompt: each choice says
    usage = {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    assert whole["usage"] == usage
    *chunks, last, done = events(streamed.text)
    tokens: dict[int, list[int]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        tokens.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert tokens == expected and last["usage"] == usage and done == "[DONE]"
    assert gw.admission.in_flight == 0


async def test_an_unknown_field_is_refused_naming_each_unless_allowed(checkpoint) -> None:
    sent = {"prompt": "x", "max_tokens": 1, "best_of": 1, "beam_width": 2, "guided_json": {}}
    async with serving(core(checkpoint("mixtral"), [ScriptedRouter("a:1")])) as client:
        refused = await client.post("/v1/completions", json=sent)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "beam_width" and error["message"].startswith(
        "unknown fields 'beam_width', 'guided_json': "
    )
    assert "--allow-unknown-fields" in error["message"]
    lenient = core(checkpoint("mixtral"), [ScriptedRouter("a:1")], allow_unknown_fields=True)
    async with serving(lenient) as client:
        assert (await client.post("/v1/completions", json=sent)).status_code == 200


async def test_the_openapi_document_and_its_pages_can_be_turned_off(checkpoint) -> None:
    routers = [ScriptedRouter("a:1")]
    async with serving(core(checkpoint("mixtral"), routers)) as client:
        assert (await client.get("/openapi.json")).status_code == 200
        assert (await client.get("/docs")).status_code == 200
    async with serving(core(checkpoint("mixtral"), routers, disable_fastapi_docs=True)) as client:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert (await client.get(path)).status_code == 404, path


@pytest.mark.parametrize(
    ("path", "sent", "status", "param", "code"),
    [
        ("/v1/completions", {"prompt": [1], "max_tokens": 10**6}, 400, "max_tokens", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
            400,
            "max_completion_tokens",
            None,
        ),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("/v1/completions", {"prompt": [10**6]}, 400, "prompt", None),
        ("/v1/completions", {"prompt": "x", "tools": [{"type": "x"}]}, 400, "tools", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
            400,
            "tools",
            None,
        ),
        ("/v1/completions", {"prompt": "x", "beam_width": 2}, 400, "beam_width", None),
        ("/v1/completions", {"prompt": [[1]] * 65}, 400, "prompt", None),  # max_prompts
        ("/v1/completions", {"prompt": [[1]] * 20, "n": 4}, 400, "prompt", None),  # > max_in_flight
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", None),
    ],
)
async def test_a_refused_request_is_an_openai_error_naming_the_field_counted_once(
    checkpoint, telemetry, path, sent, status, param, code
) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")], telemetry=telemetry)
    async with serving(gw, telemetry) as client:
        r = await client.post(path, json=sent)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == (code or "invalid_argument")
        assert error["message"]
        counted = await errors_counted(client)
    assert counted == {"NOT_FOUND" if status == 404 else "INVALID_ARGUMENT": 1.0}


async def test_a_stream_failing_before_its_first_token_is_a_503_counted_once(
    checkpoint, telemetry
) -> None:
    dead = ScriptedRouter("a:1", refuses=True)
    gw = core(checkpoint("mixtral"), [dead], telemetry=telemetry, router_attempts=1)
    async with serving(gw, telemetry) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True}
        )
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "unavailable"
        assert await errors_counted(client) == {"UNAVAILABLE": 1.0}
    assert gw.admission.in_flight == 0


async def test_a_stream_failing_after_its_first_token_reports_in_band_counted_once(
    checkpoint, telemetry
) -> None:
    dying = ScriptedRouter("a:1", dies_after=2)
    gw = core(checkpoint("mixtral"), [dying], telemetry=telemetry, router_attempts=1)
    async with serving(gw, telemetry) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 5, "stream": True}
        )
        assert r.status_code == 200
        *chunks, error, done = events(r.text)
        assert len(chunks) == 2 and done == "[DONE]"
        assert error["error"]["code"] == "unavailable" and error["error"]["param"] is None
        assert await errors_counted(client) == {"UNAVAILABLE": 1.0}
    assert gw.admission.in_flight == 0


async def test_health_models_and_metrics(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    async with serving(gw) as client:
        assert (await client.get("/health/live")).json() == {"status": "live"}
        assert (await client.get("/health")).status_code == 200
        [listed] = (await client.get("/v1/models")).json()["data"]
        assert listed["id"] == "m" and listed["max_model_len"] == 512
        assert (await client.get("/v1/models/m")).json() == listed
        missing = await client.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert (await client.get("/metrics")).status_code == 404  # no registry given
        gw.draining = True
        assert (await client.get("/health/ready")).status_code == 503
        refused = await client.post("/v1/completions", json={"prompt": [1]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_leaving_while_waiting_frees_its_place_and_router_call(
    checkpoint, stream
) -> None:
    router = FakeRouter("a:1", asyncio.Event())  # never answers
    gw = core(checkpoint("mixtral"), [router])
    body = json.dumps({"prompt": [1], "max_tokens": 2, "n": 2, "stream": stream}).encode()
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": body, "more_body": False}
        await eventually(lambda: router.outstanding == 2, 5, "both choices at the router")
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = asgi_post_scope("/v1/completions", body)
    await asyncio.wait_for(create_app(gw)(scope, receive, send), 5)
    assert sent[1]["status"] == 499
    assert gw.admission.in_flight == 0 and router.outstanding == 0
