"""Routers dying under a gateway: two router processes, one SIGKILLed before or while requests run on it.

A dead router must not swallow new requests (it has no open streams, so least-outstanding alone
would send it every one), and a stream it was serving must continue on the other router: the
client sees the same tokens, finish reason and usage as in an undisturbed run, and no error.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from moe_mesh.local.processes import ServiceProcess, stop_all
from protos.moe_mesh.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.support.reference import PROMPTS

ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+|localhost:\d+|\[[0-9a-f:]+\]:\d+")


@contextmanager
def routers(path: Path, workdir: Path, n: int = 2) -> Iterator[list[ServiceProcess]]:
    """`n` router processes (every expert colocated), started together; each is stopped at the end.
    Bursts of 8 steps: a stream that starts alone would otherwise run bursts of 64 of tiny's fast
    steps (--decode-burst-ms) and be near its end before the others arrive, and the kill is to
    come mid-stream for every one."""
    procs = [
        ServiceProcess(
            "router_service",
            ["--checkpoint", str(path), "--compute-threads", "1", "--decode-burst-ms", "0"],
            workdir,
            f"router{i}",
        )
        for i in range(n)
    ]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        stop_all(procs)


@asynccontextmanager
async def gateway(path: Path, addresses: list[str], **settings) -> AsyncIterator[GatewayApp]:
    app = await GatewayApp.create(GatewaySettings(checkpoint=path, routers=addresses, **settings))
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


def kill(router: ServiceProcess) -> None:
    router.signal(signal.SIGKILL)
    router.proc.wait(5)


async def stream(h: httpx.AsyncClient, body: dict, progress: list[int] | None = None) -> dict:
    """One streamed completion: its token ids, text, finish reason, usage and any in-band error."""
    out: dict = {"token_ids": [], "text": "", "finish_reason": None, "usage": None, "errors": []}
    body = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    async with h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                out["errors"].append(event["error"])
            elif event["choices"]:
                choice = event["choices"][0]
                out["token_ids"] += choice["token_ids"]
                out["text"] += choice["text"]
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
                if progress is not None:
                    progress.append(len(choice["token_ids"]))
            else:
                out["usage"] = event["usage"]
    return out


# Long enough that the kill lands mid-stream; ignore_eos so that a random model runs them to the end.
REQUESTS = [
    {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 160, "ignore_eos": True, **sampling}
    for i, sampling in enumerate(
        [
            {"temperature": 0},
            {"temperature": 0},
            {"temperature": 1.0, "seed": 7},
            {"temperature": 0.8, "top_p": 0.9, "seed": 2**63 + 5},
        ]
    )
]
SAMPLED = [i for i, r in enumerate(REQUESTS) if r["temperature"] > 0]


async def _kill_mid_stream(
    checkpoint, tmp_path, which: list[int]
) -> tuple[list[dict], list[dict], int]:
    """Undisturbed results of REQUESTS[which], then the same with router 0 SIGKILLed once every stream
    has a few tokens; returns (undisturbed, disturbed, failovers)."""
    path = checkpoint("mixtral")
    with routers(path, tmp_path) as procs:
        async with (
            gateway(path, [p.address for p in procs]) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=60) as h,
        ):
            undisturbed = await asyncio.gather(*(stream(h, REQUESTS[i]) for i in which))
            progress: list[list[int]] = [[] for _ in which]
            tasks = [
                asyncio.create_task(stream(h, REQUESTS[i], p)) for i, p in zip(which, progress)
            ]
            t0 = time.monotonic()
            while not all(sum(p) >= 4 for p in progress):
                assert time.monotonic() - t0 < 20 and not any(t.done() for t in tasks), progress
                await asyncio.sleep(0.005)
            assert all(sum(p) < 100 for p in progress), progress  # the kill comes mid-stream
            kill(procs[0])
            disturbed = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return undisturbed, disturbed, gw.core.balancer.failovers


async def test_greedy_streams_continue_exactly_on_another_router_when_theirs_is_killed(
    checkpoint, tmp_path
) -> None:
    which = [i for i in range(len(REQUESTS)) if i not in SAMPLED]
    undisturbed, disturbed, failovers = await _kill_mid_stream(checkpoint, tmp_path, which * 2)
    for before, after in zip(undisturbed, disturbed):
        assert after["errors"] == []
        assert len(before["token_ids"]) == 160 and before["finish_reason"] == "length"
        assert after == before  # whole token sequence, text, finish reason and usage
    assert failovers >= 1  # some stream did run on the killed router


async def test_seeded_sampling_streams_continue_exactly_on_another_router(
    checkpoint, tmp_path
) -> None:
    undisturbed, disturbed, failovers = await _kill_mid_stream(checkpoint, tmp_path, SAMPLED * 2)
    assert failovers >= 1
    for before, after in zip(undisturbed, disturbed):
        assert after["errors"] == [] and before["finish_reason"] == "length"
        assert after == before


async def test_a_dead_router_gets_no_requests_and_none_fail(checkpoint, tmp_path) -> None:
    path = checkpoint("mixtral")

    def request(i: int) -> inference_pb2.GenerateRequest:
        return inference_pb2.GenerateRequest(
            prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=6, temperature=0.0
        )

    with routers(path, tmp_path) as procs:
        async with (
            gateway(path, [p.address for p in procs]) as gw,
            grpc.aio.insecure_channel(gw.grpc.address) as channel,
        ):
            stub = inference_pb2_grpc.InferenceStub(channel)
            ref = [await stub.Generate(request(i)) for i in range(len(PROMPTS))]
            kill(procs[0])

            async def one(i: int):
                try:
                    return await stub.Generate(request(i), timeout=30)
                except grpc.aio.AioRpcError as e:
                    return e

            results = list(await asyncio.gather(*(one(i) for i in range(16))))  # at once
            results += [await one(i) for i in range(16)]  # one after the other
            failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert not failed, [(e.code(), e.details()) for e in failed]
            for i, r in enumerate(results):
                want = ref[i % len(PROMPTS)]
                assert (list(r.token_ids), r.finish_reason, r.usage) == (
                    list(want.token_ids),
                    want.finish_reason,
                    want.usage,
                )
            assert gw.core.balancer.health(gw.core.routers[0]).ejections >= 1

            # With no router left: a clear UNAVAILABLE (HTTP 503) that does not name internal addresses.
            kill(procs[1])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(request(0), timeout=30)
            assert (
                e.value.code() == grpc.StatusCode.UNAVAILABLE and "no router" in e.value.details()
            )
            assert not ADDRESS.search(e.value.details()), e.value.details()
            async with httpx.AsyncClient(base_url=f"http://{gw.http_address}") as h:
                r = await h.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
            assert not ADDRESS.search(r.text), r.text


async def test_a_killed_router_restarted_on_its_port_gets_requests_again_within_seconds(
    checkpoint, tmp_path
) -> None:
    """Static --routers: a killed router is ejected; restarted on its port, checks of it pass and
    requests reach it within seconds rather than when its ejection (30 s here) ends."""
    path = checkpoint("mixtral")
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPTS[1], max_tokens=4, temperature=0.0
    )
    with routers(path, tmp_path) as procs:
        async with (
            gateway(path, [p.address for p in procs], router_ejection_s=30.0) as gw,
            grpc.aio.insecure_channel(gw.grpc.address) as channel,
        ):
            stub = inference_pb2_grpc.InferenceStub(channel)
            want = await stub.Generate(request, timeout=30)
            victim = procs[0]
            kill(victim)
            start = time.monotonic()
            while gw.core.balancer.ejected() != [victim.address]:
                assert time.monotonic() - start < 30, "the killed router was not ejected"
                assert (await stub.Generate(request, timeout=30)).token_ids == want.token_ids
            port = victim.address.rsplit(":", 1)[1]
            restarted = ServiceProcess(
                "router_service",
                ["--checkpoint", str(path), "--compute-threads", "1", "--port", port],
                tmp_path,
                "router0-restarted",
            )
            try:
                assert restarted.wait_ready().address == victim.address
                ready = time.monotonic()
                async with grpc.aio.insecure_channel(restarted.address) as own:
                    status = router_pb2_grpc.RouterServiceStub(own).Status
                    while not (await status(router_pb2.RouterStatusRequest(), timeout=5)).steps:
                        assert time.monotonic() - ready < 5, "the restarted router gets no request"
                        reply = await stub.Generate(request, timeout=30)
                        assert reply.token_ids == want.token_ids
                assert gw.core.balancer.ejected() == [] and gw.core.balancer.prober.readmitted
            finally:
                restarted.stop()
