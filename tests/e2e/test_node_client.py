"""Interoperability: an independent Node.js client (@grpc/grpc-js + @grpc/proto-loader, tests/node/client.mjs)
against a real gateway and router serving moe_mesh.v1.Inference."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.sampling import SamplingParams
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc, types_pb2
from router_service.build import build_local_engine
from router_service.settings import RouterSettings
from tests.support import REPO
from tests.support.meshes import local_mesh

NODE = shutil.which("node")
if NODE is None or shutil.which("npm") is None:
    pytest.skip(
        "`node` or `npm` is not on PATH: the Node.js interop client cannot be installed or run",
        allow_module_level=True,
    )

NODE_DIR = REPO / "tests" / "node"
CLIENT = NODE_DIR / "client.mjs"
PROMPT = [11, 3, 250, 9, 31]
MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def node_modules() -> None:
    """The pinned packages are installed (by `make setup`); a missing or stale install fails, it never skips."""
    pins = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]
    for name, version in pins.items():
        manifest = NODE_DIR / "node_modules" / name / "package.json"
        if not manifest.exists():
            pytest.fail(
                f"{name} is not installed in {NODE_DIR / 'node_modules'}: run `make setup` "
                f"(or `npm ci --prefix tests/node`)"
            )
        installed = json.loads(manifest.read_text())["version"]
        if installed != version:
            pytest.fail(
                f"{name} {installed} is installed but tests/node/package.json pins {version}: "
                f"run `make setup` (or `npm ci --prefix tests/node`)"
            )


async def node(
    method: str,
    request: dict | None = None,
    address: str | None = None,
    *,
    deadline_ms: int | None = None,
    encode_only: bool = False,
    ca: Path | None = None,
    api_key: str | None = None,
) -> dict:
    """Run client.mjs as a subprocess (never blocking the loop that serves the mesh) and return its JSON."""
    args = [str(CLIENT), "--method", method, "--request", json.dumps(request or {})]
    if address is not None:
        args += ["--address", address]
    if deadline_ms is not None:
        args += ["--deadline-ms", str(deadline_ms)]
    if encode_only:
        args.append("--encode-only")
    if ca is not None:
        args += ["--ca", str(ca)]
    if api_key is not None:
        args += ["--api-key", api_key]
    proc = await asyncio.create_subprocess_exec(
        NODE, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"client.mjs {method} exited {proc.returncode}:\n{err.decode()}"
    lines = out.decode().splitlines()
    assert len(lines) == 1, (
        f"client.mjs printed {len(lines)} lines, expected one JSON object:\n{out.decode()}"
    )
    return json.loads(lines[0])


def greedy_reference(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """The in-process engine's greedy tokens with the params the gateway sends (on a thread: the loop runs)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def run() -> list[int]:
        engine = build_local_engine(RouterSettings(checkpoint=path))
        engine.add_request("ref", prompt, params)
        out: list[int] = []
        while engine.has_unfinished():
            for o in await engine.step():
                if o.error is not None:
                    raise o.error
                out += o.new_token_ids
        return out

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(run())).result()


@pytest.fixture
def path(checkpoint) -> Path:
    return checkpoint("mixtral")


async def test_optional_fields_are_sent_when_given_even_at_their_default() -> None:
    """proto3 `optional`: zero and "" go on the wire as present, omitted or null keys as absent."""
    given = await node(
        "Generate",
        {
            "prompt": "",
            "max_tokens": 0,
            "temperature": 0,
            "top_p": 0,
            "top_k": 0,
            "min_p": 0,
            "seed": 0,
            "model": "",
            "priority": 0,
        },
        encode_only=True,
    )
    msg = inference_pb2.GenerateRequest.FromString(bytes.fromhex(given["request_hex"]))
    for field in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        assert msg.HasField(field), field
    assert msg.prompt == "" and msg.temperature == 0 and msg.max_tokens == 0

    omitted = await node(
        "Generate", {"prompt_token_ids": PROMPT, "temperature": None}, encode_only=True
    )
    msg = inference_pb2.GenerateRequest.FromString(bytes.fromhex(omitted["request_hex"]))
    assert list(msg.prompt_token_ids) == PROMPT
    for field in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        assert not msg.HasField(field), field


async def test_list_models(path) -> None:
    config = json.loads((path / "config.json").read_text())
    async with local_mesh(path) as mesh:
        got = await node("ListModels", {}, mesh.grpc_address)
        async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
            ref = await inference_pb2_grpc.InferenceStub(channel).ListModels(
                inference_pb2.ListModelsRequest()
            )
    [model] = got["models"]
    [ref_model] = ref.models
    assert model == {
        "id": ref_model.id,
        "architecture": ref_model.architecture,
        "max_model_len": ref_model.max_model_len,
        "vocab_size": ref_model.vocab_size,
    }
    assert model["id"] and model["architecture"] == "mixtral"
    assert model["vocab_size"] == config["vocab_size"]
    assert model["max_model_len"] > 0


async def test_generate_matches_greedy_engine_and_python_client(path) -> None:
    expected = greedy_reference(path, PROMPT, MAX_TOKENS)
    async with local_mesh(path) as mesh:
        got = await node(
            "Generate",
            {"prompt_token_ids": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS},
            mesh.grpc_address,
            deadline_ms=60_000,
        )
        text_request = {"prompt": "Hello wörld", "temperature": 0, "max_tokens": 8}
        text = await node("Generate", text_request, mesh.grpc_address)
        async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
            ref = await inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(**text_request)
            )

    assert "error" not in got, got
    assert [int(t) for t in got["token_ids"]] == expected
    assert got["request_id"]
    assert got["finish_reason"] == (
        "FINISH_REASON_LENGTH" if len(expected) == MAX_TOKENS else "FINISH_REASON_STOP"
    )
    assert got["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(expected),
        "total_tokens": len(PROMPT) + len(expected),
    }

    assert "error" not in text, text
    assert text["text"] == ref.text and text["token_ids"] == list(ref.token_ids)
    assert text["finish_reason"] == types_pb2.FinishReason.Name(ref.finish_reason)
    assert text["usage"] == {
        "prompt_tokens": ref.usage.prompt_tokens,
        "completion_tokens": ref.usage.completion_tokens,
        "total_tokens": ref.usage.total_tokens,
    }


async def test_generate_stream_matches_unary(path) -> None:
    request = {"prompt_token_ids": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    async with local_mesh(path) as mesh:
        unary = await node("Generate", request, mesh.grpc_address)
        stream = await node("GenerateStream", request, mesh.grpc_address, deadline_ms=60_000)
    assert "error" not in unary and "error" not in stream, (unary, stream)
    assert len(unary["token_ids"]) == MAX_TOKENS, "greedy output hit EOS early: pick another PROMPT"

    messages = stream["messages"]
    assert len(messages) > 1
    assert [t for m in messages for t in m["token_ids"]] == unary["token_ids"]
    assert "".join(m["text"] for m in messages) == unary["text"]
    assert messages[0]["request_id"] and {m["request_id"] for m in messages} == {
        messages[0]["request_id"]
    }
    *body, last = messages
    assert all(
        m["finish_reason"] == "FINISH_REASON_UNSPECIFIED" and m["usage"] is None for m in body
    )
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert (
        last["usage"]
        == unary["usage"]
        == {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": MAX_TOKENS,
            "total_tokens": len(PROMPT) + MAX_TOKENS,
        }
    )
    assert 0 <= stream["first_message_ms"] < stream["last_message_ms"]


@pytest.mark.parametrize(
    ("method", "request_", "field", "reason"),
    [
        ("Generate", {"prompt": "", "max_tokens": 4}, "prompt", "must not be empty"),
        ("Generate", {"prompt": "Hi", "prompt_token_ids": PROMPT}, "prompt", "exactly one"),
        ("Generate", {"prompt_token_ids": PROMPT, "max_tokens": 0}, "max_tokens", "got 0"),
        ("Generate", {"prompt_token_ids": PROMPT, "top_p": 1.5}, "top_p", "got 1.5"),
        ("GenerateStream", {"prompt": "", "max_tokens": 4}, "prompt", "must not be empty"),
        ("GenerateStream", {"prompt_token_ids": PROMPT, "max_tokens": 0}, "max_tokens", "got 0"),
    ],
)
async def test_invalid_requests_are_invalid_argument_naming_the_field(
    path, method, request_, field, reason
) -> None:
    async with local_mesh(path) as mesh:
        got = await node(method, request_, mesh.grpc_address)
    error = got.get("error")
    assert error is not None, got
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert error["code_name"] == "INVALID_ARGUMENT"
    assert error["details"].startswith(f"{field}: ") and reason in error["details"], error[
        "details"
    ]
    if method == "GenerateStream":
        assert got["messages"] == []


async def test_an_unknown_model_is_not_found(path) -> None:
    async with local_mesh(path) as mesh:
        request = {"model": "no-such-model", "prompt_token_ids": PROMPT}
        got = await node("Generate", request, mesh.grpc_address)
    assert got["error"]["code_name"] == "NOT_FOUND", got
    assert "no-such-model" in got["error"]["details"]


async def test_over_tls_with_an_api_key(path, tmp_path) -> None:
    """A gateway on TLS with API keys: the Node client checks the server against the CA and sends
    its key as `authorization` metadata; without the key it gets UNAUTHENTICATED."""
    from moe_mesh.local import certs
    from tests.support.certs import tls_flags

    certs.create(tmp_path, ["router", "gateway"])
    (tmp_path / "keys").write_text("sk-node-0123456789\n")
    expected = greedy_reference(path, PROMPT, MAX_TOKENS)
    request = {"prompt_token_ids": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    async with local_mesh(
        path,
        router=tls_flags(tmp_path, "router"),
        api_key_file=tmp_path / "keys",
        **tls_flags(tmp_path, "gateway"),
    ) as mesh:
        ca = tmp_path / certs.CA_FILE
        got = await node(
            "Generate", request, mesh.grpc_address, ca=ca, api_key="sk-node-0123456789"
        )
        refused = await node("Generate", request, mesh.grpc_address, ca=ca)
        wrong = await node("ListModels", {}, mesh.grpc_address, ca=ca, api_key="sk-wrong-12345678")
    assert [int(t) for t in got["token_ids"]] == expected
    assert refused["error"]["code_name"] == "UNAUTHENTICATED"
    assert wrong["error"]["code_name"] == "UNAUTHENTICATED"
