"""The public gRPC API through a real gateway and router: streaming, cancellation, overload, bad input,
a wrong checkpoint at start-up."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import CheckpointError
from common.status import RETRY_AFTER_KEY
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc, types_pb2
from tests.support.meshes import local_mesh
from tests.support.net import free_port
from tests.support.polling import eventually
from tests.support.reference import PROMPTS, monolithic


def greedy(i: int, max_tokens: int = 32, **kw) -> inference_pb2.GenerateRequest:
    """Greedy past EOS, like monolithic(): its whole output is monolithic()[i][:max_tokens]."""
    return inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPTS[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
    )


async def generate_command(*args: str) -> tuple[int, str, str]:
    """`moe-mesh generate ARGS` as a user runs it: exit code, stdout, stderr."""
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "moe_mesh", "generate", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(cli.communicate(), 60)
    return cli.returncode, out.decode(), err.decode()


async def serving(channel: grpc.aio.Channel) -> bool:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_unary_and_stream_match_the_local_engine_and_stream_early(checkpoint) -> None:
    path = checkpoint("qwen3_moe")
    async with local_mesh(path) as mesh, grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for i in range(len(PROMPTS)):
            reply = await stub.Generate(greedy(i))
            assert tuple(reply.token_ids) == monolithic(path)[i]  # all 32 tokens
            assert reply.finish_reason == types_pb2.FINISH_REASON_LENGTH
            assert reply.usage.prompt_tokens == len(PROMPTS[i])
            assert reply.usage.total_tokens == len(PROMPTS[i]) + len(reply.token_ids)

        start, arrivals, ids, texts, sizes = time.monotonic(), [], [], [], []
        async for msg in stub.GenerateStream(greedy(3, max_tokens=64)):
            arrivals.append(time.monotonic() - start)
            ids += msg.token_ids
            texts.append(msg.text)
            sizes.append(len(msg.token_ids))
        # Tokens come as they are made: the prefill's token alone, then bursts (of as many of
        # tiny's steps as fit in --decode-burst-ms: all the rest here).
        assert len(arrivals) >= 2 and sizes[0] == 1 and arrivals[0] < arrivals[-1]
        unary = await stub.Generate(greedy(3, max_tokens=64))
        assert ids == list(unary.token_ids) and "".join(texts) == unary.text


async def test_cancelling_a_stream_aborts_it_and_frees_the_router_slot(checkpoint) -> None:
    async with (
        local_mesh(checkpoint("mixtral")) as mesh,
        grpc.aio.insecure_channel(mesh.grpc_address) as channel,
    ):
        since = mesh.router.core.status().steps
        call = inference_pb2_grpc.InferenceStub(channel).GenerateStream(greedy(2, max_tokens=400))
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 3:
                break
        assert mesh.router.core.status().running == 1
        call.cancel()
        await eventually(lambda: not mesh.router.core.status().running, 30, "the abort")
        # Aborted, not run to its end: each step was one token of this request alone.
        assert mesh.router.core.status().steps - since < 400
        await eventually(lambda: not mesh.gateway.core.admission.in_flight, 30, "the release")
        assert await serving(channel)


async def test_burst_beyond_the_queue_is_refused_at_once_and_accepted_requests_complete(
    checkpoint,
) -> None:
    path = checkpoint("olmoe")
    capacity = 2  # max_in_flight + max_queued
    async with (
        local_mesh(path, max_in_flight=1, max_queued=1) as mesh,
        grpc.aio.insecure_channel(mesh.grpc_address) as channel,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int):
            start = time.monotonic()
            try:
                reply = await stub.Generate(greedy(i % len(PROMPTS), max_tokens=8))
            except grpc.aio.AioRpcError as e:
                reply = e
            return reply, time.monotonic() - start

        results = await asyncio.gather(*(one(i) for i in range(10 * capacity)))
        accepted = [
            (i, r)
            for i, (r, _) in enumerate(results)
            if isinstance(r, inference_pb2.GenerateResponse)
        ]
        refused = [(r, t) for r, t in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(accepted) >= capacity and len(refused) >= 10 * capacity - capacity - 2
        assert len(accepted) + len(refused) == 10 * capacity
        # Refused at once, not after waiting for a place: sooner than any accepted request took. (A
        # comparison, not a time: a loaded CI host took 0.8 s to refuse, and longer to answer.)
        quickest = min(t for r, t in results if isinstance(r, inference_pb2.GenerateResponse))
        for e, took in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in e.details()
            assert dict(e.trailing_metadata())[RETRY_AFTER_KEY] == "1"
            assert took < quickest
        for i, reply in accepted:
            assert tuple(reply.token_ids) == monolithic(path)[i % len(PROMPTS)][:8]
        assert mesh.gateway.core.admission.in_flight == 0


BAD = [
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),  # neither prompt nor ids
    ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt"),
    ({"prompt_token_ids": [1] * 600}, "prompt"),  # longer than the context (512)
    ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -1}, "top_k"),
    ({"prompt": "hi", "min_p": -0.5}, "min_p"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "min_p": float("nan")}, "min_p"),
    ({"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids"),
    # Limits: once a 100 KB request_id was UNAVAILABLE and a 20,000-character model RESOURCE_EXHAUSTED
    # (both echoed into metadata past its size limit).
    ({"prompt": "hi", "request_id": "r" * 100_000}, "request_id"),
    ({"prompt": "hi", "model": "m" * 20_000}, "model"),
    ({"prompt": "hi", "stop": ["x"] * 33}, "stop"),
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [1] * 33}, "stop_token_ids"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": -1.0}, "repetition_penalty"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


async def test_bad_input_is_invalid_argument_naming_the_field_and_the_gateway_stays_healthy(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    async with local_mesh(path) as mesh, grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for fields, field in BAD:
            for method in (stub.Generate, stub.GenerateStream):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    result = method(inference_pb2.GenerateRequest(**fields))
                    if method is stub.GenerateStream:
                        async for _ in result:
                            pass
                    else:
                        await result
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                    fields,
                    e.value.details(),
                )
                assert e.value.details().startswith(f"{field}:"), (fields, e.value.details())
            assert await serving(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(inference_pb2.GenerateRequest(prompt="hi", model="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
        reply = await stub.Generate(greedy(1, max_tokens=4))
        assert tuple(reply.token_ids) == monolithic(path)[1][:4]
        models = await stub.ListModels(inference_pb2.ListModelsRequest())
        assert [m.id for m in models.models] == [path.name] and models.models[0].vocab_size == 512


async def test_a_request_id_in_flight_is_already_exists_and_a_huge_message_is_refused(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    async with local_mesh(path) as mesh, grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        first = stub.GenerateStream(greedy(2, max_tokens=400, request_id="same"))
        await anext(aiter(first))
        for method in (stub.Generate, stub.GenerateStream):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                call = method(greedy(1, max_tokens=2, request_id="same"))
                if method is stub.GenerateStream:
                    async for _ in call:
                        pass
                else:
                    await call
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
            assert e.value.details().startswith("request_id:") and "'same'" in e.value.details()
        first.cancel()
        # The public API takes messages up to max_body_bytes (4 MiB), not the router links' 64 MiB.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(inference_pb2.GenerateRequest(prompt="hi", stop=[""] * 3_000_000))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await serving(channel)
        # The cancellation of the first reaches the gateway.
        await eventually(lambda: not mesh.gateway.core.admission.in_flight, 30, "the release")
        reply = await stub.Generate(
            greedy(1, max_tokens=4, request_id="same")
        )  # free once the first ended
        assert tuple(reply.token_ids) == monolithic(path)[1][:4] and reply.request_id == "same"


async def test_logprobs_and_ignore_eos_over_grpc_and_the_generate_command(checkpoint) -> None:
    path = checkpoint("mixtral")
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    )
    async with local_mesh(path) as mesh, grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        reply = await stub.Generate(request)
        assert len(reply.token_ids) == len(reply.logprobs) == 6
        for token, lp in zip(reply.token_ids, reply.logprobs):  # greedy: the top alternative
            assert (
                len(lp.top) == 2 and lp.top[0].token_id == token and lp.top[0].logprob == lp.logprob
            )
        streamed = [m async for m in stub.GenerateStream(request)]
        assert [t for m in streamed for t in m.token_ids] == list(reply.token_ids)
        assert [lp for m in streamed for lp in m.logprobs] == list(reply.logprobs)
        code, out, err = await generate_command(
            "--gateway", mesh.grpc_address, "--prompt-token-ids", "1,2,3", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--logprobs", "2", "--json",
        )  # fmt: skip
        assert code == 0, err
        result = json.loads(out)
        assert result["token_ids"] == list(reply.token_ids)
        assert [x["logprob"] for x in result["logprobs"]] == [lp.logprob for lp in reply.logprobs]


async def test_the_generate_command_exits_2_for_input_the_gateway_refuses_and_for_a_router(
    checkpoint,
) -> None:
    async with local_mesh(checkpoint("mixtral")) as mesh:
        code, _, err = await generate_command(
            "--gateway", mesh.grpc_address, "--prompt-token-ids", "1,2", "--temperature", "-1"
        )
        assert code == 2 and "temperature: must be >= 0" in err and "Traceback" not in err, err
        # A router answers gRPC too, but not the Inference API.
        code, _, err = await generate_command(
            "--gateway", mesh.router.server.address, "--prompt-token-ids", "1,2"
        )
        assert code == 2 and "does not serve moe-mesh's Inference API" in err, err


async def test_a_checkpoint_without_a_tokenizer_fails_start_up_before_any_router_wait(
    tmp_path,
) -> None:
    # The router address answers nothing: a start-up that dialed it first would wait an hour,
    # past the guard.
    settings = GatewaySettings(
        checkpoint=tmp_path, routers=[f"127.0.0.1:{free_port()}"], connect_timeout_s=3600.0
    )
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        await asyncio.wait_for(GatewayApp.create(settings), 60)
