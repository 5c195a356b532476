"""The gateway's edge under API keys and TLS, with the real `openai` client, raw httpx and a gRPC
client: no key or a wrong one is 401 / UNAUTHENTICATED in OpenAI's error shape (the OpenAPI
document and its pages too), a good one is served, a key file change takes effect without a restart, per-key limits apply, and the router
behind it is reached over mutual TLS."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.tls import MeshTls, open_channel
from moe_mesh.local import certs
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc
from tests.support.certs import tls_flags
from tests.support.meshes import LocalMesh, local_mesh

KEY, LIMITED, NEW_KEY = "sk-test-0123456789", "sk-limited-0123456789", "sk-rotated-0123456789"
BATCH = "sk-batch-0123456789"  # the example key for batch work in docs/operating/security.md


@pytest.fixture
async def mesh(checkpoint, tmp_path) -> AsyncIterator[LocalMesh]:
    certs.create(tmp_path / "certs", ["router", "gateway"])
    keys = tmp_path / "keys"
    keys.write_text(
        f"{KEY} name=main\n{LIMITED} name=limited rpm=1 max_priority=0\n"
        f"{BATCH} name=batch max_priority=-10\n"
    )
    async with local_mesh(
        checkpoint("mixtral"),
        router=tls_flags(tmp_path / "certs", "router"),
        api_key_file=keys,
        **tls_flags(tmp_path / "certs", "gateway"),
    ) as m:
        yield m


def ca_file(mesh: LocalMesh) -> Path:
    return mesh.gateway.settings.tls_ca


def http(mesh: LocalMesh, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    context = ssl.create_default_context(cafile=str(ca_file(mesh)))
    return httpx.AsyncClient(base_url=mesh.http_base_url, verify=context, headers=headers)


def client(mesh: LocalMesh, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=mesh.http_base_url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=http(mesh),
    )


async def test_no_key_or_a_wrong_key_is_401_and_a_good_key_is_served_over_https(mesh) -> None:
    assert mesh.http_base_url.startswith("https://")
    async with client(mesh, "sk-wrong-0123456789") as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.completions.create(model="", prompt=[5, 6], max_tokens=2)
    assert info.value.status_code == 401
    async with http(mesh) as raw:  # no key at all (the openai client refuses to send none)
        r = await raw.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "invalid_api_key",
            None,
        )
        assert (await raw.get("/v1/models")).status_code == 401
        # Probes and scrapers need no key; the refusals above are counted.
        assert (await raw.get("/health")).status_code == 200
        metrics = await raw.get("/metrics")
        assert metrics.status_code == 200
        refused = [
            s.value
            for family in text_string_to_metric_families(metrics.text)
            for s in family.samples
            if s.name == "moe_errors_total"
            and s.labels.get("rpc_grpc_status_code") == "UNAUTHENTICATED"
        ]
        assert refused == [3.0]  # the wrong key, and the two requests without one
    async with client(mesh, KEY) as good:
        done = await good.completions.create(model="", prompt=[5, 6], max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3
        chat = await good.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content is not None
    # The API's description is behind the key too; probes are not.
    async with http(mesh) as raw:
        for path in ("/openapi.json", "/docs", "/redoc"):
            r = await raw.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    async with http(mesh, KEY) as raw:
        assert "/v1/completions" in (await raw.get("/openapi.json")).json()["paths"]
        assert (await raw.get("/docs")).status_code == 200
    # Plain HTTP to the TLS port is not served.
    async with httpx.AsyncClient(base_url=f"http://{mesh.gateway.http_address}") as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get("/health", timeout=3)


async def test_a_key_file_change_takes_effect_without_a_restart(mesh, tmp_path) -> None:
    async with client(mesh, KEY) as old, client(mesh, NEW_KEY) as new:
        await old.models.list()
        (tmp_path / "keys.new").write_text(f"{NEW_KEY} name=rotated\n")
        (tmp_path / "keys.new").replace(tmp_path / "keys")  # as an operator rotates: atomically
        with pytest.raises(openai.AuthenticationError):
            await old.models.list()
        assert [m.id for m in (await new.models.list()).data]


def errors_by_code(metrics: str) -> dict[str, float]:
    return {
        s.labels["rpc_grpc_status_code"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "moe_errors_total"
    }


async def test_per_key_priority_cap_and_rate_limit_are_applied_and_counted(mesh) -> None:
    async with http(mesh) as raw:
        before = errors_by_code((await raw.get("/metrics")).text)
    async with http(mesh, LIMITED) as raw:
        body = {"prompt": [5], "max_tokens": 1}
        r = await raw.post("/v1/completions", json={**body, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert (await raw.post("/v1/completions", json=body)).status_code == 200
        r = await raw.post("/v1/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "'limited'" in r.json()["error"]["message"]
        assert LIMITED not in r.text
    async with http(mesh, KEY) as raw:  # other keys are not limited by it
        r = await raw.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "priority": 9})
        assert r.status_code == 200
        # Refused by the HTTP server itself: a body that is not the schema's, one over the limit.
        r = await raw.post("/v1/completions", json={"prompt": [5], "max_tokens": "many"})
        assert r.status_code == 400
        big = b"x" * (mesh.gateway.settings.max_body_bytes + 1)
        r = await raw.post("/v1/completions", content=big)
        assert r.status_code == 413
        after = errors_by_code((await raw.get("/metrics")).text)
    # Every refusal above counts once, by the status a gRPC caller would get.
    grew = {code: n - before.get(code, 0.0) for code, n in after.items()}
    assert {code: n for code, n in grew.items() if n} == {
        "INVALID_ARGUMENT": 2.0,
        "RESOURCE_EXHAUSTED": 2.0,
    }
    # A key capped below 0 serves requests that ask for no priority (at its cap), over gRPC too.
    async with client(mesh, BATCH) as batch:
        done = await batch.completions.create(
            model="", prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True}
        )  # sampled: the tiny random model ends at EOS about once in 512 tokens, as a clone's did
        assert done.usage.completion_tokens == 2
    tls = MeshTls.ca_only(ca_file(mesh))
    async with open_channel(mesh.grpc_address, [], tls=tls) as channel:
        reply = await inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=2, ignore_eos=True),
            metadata=(("authorization", f"Bearer {BATCH}"),),
            timeout=10,
        )
        assert len(reply.token_ids) == 2


async def test_grpc_callers_need_the_key_too(mesh) -> None:
    tls = MeshTls.ca_only(ca_file(mesh))
    # ignore_eos: a sampled end of sequence would end a reply at one token (a fresh clone saw it)
    request = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=2, ignore_eos=True)
    async with open_channel(mesh.grpc_address, [], tls=tls) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata in [(), (("authorization", "Bearer sk-wrong-0123456789"),)]:
            for call in (
                stub.Generate(request, metadata=metadata, timeout=10),
                stub.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata, timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "sk-wrong" not in info.value.details()
        good = (("authorization", f"Bearer {KEY}"),)
        reply = await stub.Generate(request, metadata=good, timeout=10)
        assert len(reply.token_ids) == 2
        streamed = [m async for m in stub.GenerateStream(request, metadata=good, timeout=10)]
        assert sum(len(m.token_ids) for m in streamed) == 2
    async with open_channel(mesh.grpc_address, []) as plain:  # plaintext to the TLS port
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await inference_pb2_grpc.InferenceStub(plain).ListModels(
                inference_pb2.ListModelsRequest(), timeout=3
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
