"""Stopping a real gateway (gRPC + HTTP) whose requests never end: one grace period in all, not one per
stage, and every request cut off at its end hears why from its own API instead of a dropped stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest

from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2
from tests.support.fakes import router_serving
from tests.support.polling import eventually

# On the fake clock the stop's deadline is measured on: a stage that waited the grace period in
# real time (or again, after the one before it) would outlast GUARD_S, which only catches that.
GRACE_S = 3600.0
GUARD_S = 30.0
STATUS = router_pb2.RouterStatus(
    model_id="m", architecture="mixtral", vocab_size=512, max_model_len=512
)


async def endless(request: bytes, context) -> AsyncIterator[bytes]:
    """A router stream that never finishes: a token every 20 ms."""
    for i in range(10**6):
        await asyncio.sleep(0.02)
        yield router_pb2.RouterGenerateResponse(
            token_ids=[5], completion_tokens=i + 1
        ).SerializeToString()


def draining(h: httpx.AsyncClient):
    """Whether the gateway says it is not ready (it drains): a predicate for `eventually`."""

    async def check() -> bool:
        return (await h.get("/health/ready")).status_code == 503

    return check


async def test_stop_takes_one_grace_period_and_cut_requests_get_unavailable(checkpoint) -> None:
    async with router_serving(endless, STATUS) as router:
        settings = GatewaySettings(
            checkpoint=checkpoint("mixtral"),
            routers=[router],
            grace_s=GRACE_S,
            max_in_flight=2,
            max_queued=4,
        )
        gateway = await GatewayApp.create(settings)
        await gateway.start()
        try:
            await _stop_with_requests_in_flight(gateway)
        finally:
            await gateway.stop()  # a no-op once stopped


async def _stop_with_requests_in_flight(gateway: GatewayApp) -> None:
    base = f"http://{gateway.http_address}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    channel = grpc.aio.insecure_channel(gateway.grpc.address)
    async with client, channel, httpx.AsyncClient(base_url=base, timeout=30) as h:
        sse = await client.completions.create(  # ignore_eos: the streams must outlast the drain
            model="m",
            prompt=[1, 2, 3],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = aiter(sse)
        await anext(chunks)
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.GenerateStream(
            inference_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3], max_tokens=400, ignore_eos=True
            )
        )
        await anext(aiter(call))
        # Both places are taken: this one waits in line through the whole grace period.
        queued = asyncio.create_task(
            h.post("/v1/completions", json={"prompt": [1], "max_tokens": 4})
        )
        await eventually(lambda: gateway.core.admission.queued == 1, 5, "a queued request")

        now = [0.0]
        gateway.grpc.clock = lambda: now[0]
        stopping = asyncio.create_task(gateway.stop())
        await eventually(draining(h), 5, "the drain")
        for _ in range(3):  # still streaming while the gateway drains, until grace ends
            await anext(chunks)
        assert not queued.done() and not stopping.done()
        now[0] += GRACE_S
        with pytest.raises(openai.APIError) as cut:
            async for _ in chunks:
                pass
        assert cut.value.body["code"] == "unavailable", cut.value.body
        assert cut.value.body["type"] == "service_unavailable_error"
        assert "shutting down" in cut.value.message and "retry" in cut.value.message
        with pytest.raises(grpc.aio.AioRpcError) as rpc:
            async for _ in call:
                pass
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in rpc.value.details()
        refused = await queued
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        # Each stage used to wait the whole grace period again (HTTP drain, uvicorn, gRPC).
        await asyncio.wait_for(stopping, GUARD_S)
    assert gateway.core.admission.in_flight == gateway.core.admission.queued == 0


async def one_then_silence(request: bytes, context) -> AsyncIterator[bytes]:
    """A router that sends a token, then nothing (a long prefill elsewhere, a hung replica)."""
    yield router_pb2.RouterGenerateResponse(token_ids=[5], completion_tokens=1).SerializeToString()
    await asyncio.Event().wait()


async def test_a_stream_waiting_on_a_silent_router_is_cut_at_the_end_of_grace(checkpoint) -> None:
    """The wait for the router's next token is interrupted, not only the step after it: an HTTP
    stream's first token is awaited by the request's handler, the rest by its response's task."""
    async with router_serving(one_then_silence, STATUS) as router:
        settings = GatewaySettings(
            checkpoint=checkpoint("mixtral"), routers=[router], grace_s=GRACE_S
        )
        gateway = await GatewayApp.create(settings)
        await gateway.start()
        base = f"http://{gateway.http_address}/v1"
        try:
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as c:
                chunks = aiter(
                    await c.completions.create(
                        model="m", prompt=[1, 2, 3], max_tokens=400, stream=True
                    )
                )
                await anext(chunks)

                async def rest() -> None:
                    async for _ in chunks:
                        pass

                reading = asyncio.create_task(rest())
                now = [0.0]
                gateway.grpc.clock = lambda: now[0]
                stopping = asyncio.create_task(gateway.stop())
                async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}") as h:
                    await eventually(draining(h), 5, "the drain")
                assert not reading.done()  # grace has not ended
                now[0] += GRACE_S
                with pytest.raises(openai.APIError) as cut:
                    await asyncio.wait_for(reading, GUARD_S)
                assert cut.value.body["code"] == "unavailable", cut.value.body
                await asyncio.wait_for(stopping, GUARD_S)
        finally:
            await gateway.stop()
