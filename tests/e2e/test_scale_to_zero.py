"""An expert group scaled to 0 under a running stream (issue 44): `moe-mesh scale` refuses while the
group is the only copy of its experts, and with --force the stream pauses instead of failing, the
gateway's HTTP /health/ready and gRPC health service say not-ready exactly while the experts have
no replica, and both are back to ready, and the stream completes with the right tokens, once a
replica returns.

`moe-mesh up` with two groups of one replica each; one greedy gRPC stream of many tokens (expert
services hold each call 10 ms for batch-mates, so it outlasts the scale-down), while readiness is
sampled over HTTP and gRPC all along.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import SERVICE_NAME
from moe_mesh.local.processes import running_up
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc
from tests.support.cli import moe_mesh
from tests.support.metrics import scrape, total
from tests.support.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
FAILOVERS = "moe_router_failovers_total"
PROMPT = [11, 3, 250, 9, 31]
NEW_TOKENS = 300
# The stream waits for the returning replica as long as it takes to start on a shared host.
ROUTER = "--missing-expert-wait-s 120 --hedge-min-delay-s 30 --expert-call-timeout-min-s 10"


async def _stream(stub, tokens: list[int]) -> str:
    """One greedy stream, its tokens appended to `tokens` as they come; its finish reason."""
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True
    )
    finish = ""
    async for m in stub.GenerateStream(request, timeout=180):
        tokens += m.token_ids
        finish = str(m.finish_reason) if m.finish_reason else finish
    return finish


class Sampler:
    """(monotonic time, HTTP ready, gRPC "" SERVING, gRPC Inference SERVING), every 50 ms."""

    def __init__(self, info: dict) -> None:
        self.info, self.samples = info, []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        url = f"http://{self.info['gateway_http']}/health/ready"
        async with (
            grpc.aio.insecure_channel(self.info["gateway_grpc"]) as channel,
            httpx.AsyncClient(timeout=10) as h,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.stop.is_set():
                http = (await h.get(url)).status_code == 200
                overall, inference = [
                    (await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=10)).status
                    == SERVING
                    for s in ("", SERVICE_NAME)
                ]
                self.samples.append((time.monotonic(), http, overall, inference))
                await asyncio.sleep(0.05)

    def ready_now(self) -> bool | None:
        """True or False when the latest sample's three answers agree, else None."""
        if not self.samples:
            return None
        states = set(self.samples[-1][1:])
        return states.pop() if len(states) == 1 else None


async def _scale(ready, group: str, replicas: int, *flags: str):
    return await asyncio.to_thread(
        moe_mesh, "scale", "--ready-file", ready, "--experts", group,
        "--replicas", str(replicas), *flags,
    )  # fmt: skip


def test_a_group_scaled_to_zero_under_a_stream_pauses_it_and_readiness_tells(
    checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("MOE_EXPERT_MAX_QUEUE_DELAY_US", "10000")  # a stream of several seconds
    ready, run_dir = tmp_path / "mesh.json", tmp_path / "run"
    flags = ["--expert-services", "2", "--replicas", "1", f"--router-arg={ROUTER}"]
    with running_up(
        checkpoint("mixtral"), flags, ready_file=ready, run_dir=run_dir,
        log_path=tmp_path / "up.log", ready_timeout_s=90, stop_timeout_s=30,
    ) as mesh:  # fmt: skip
        info = mesh.info
        group = info["experts"][0]["experts"]

        async def scenario() -> tuple[list[int], list[int], str, dict]:
            sampler = Sampler(info)
            sampling = asyncio.ensure_future(sampler.run())
            marks: dict = {}
            async with grpc.aio.insecure_channel(info["gateway_grpc"]) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                expected: list[int] = []
                assert await _stream(stub, expected) and len(expected) == NEW_TOKENS
                await eventually(lambda: sampler.ready_now() is True, 10, "ready at first")

                refused = await _scale(ready, group, 0)  # the only copy: refused, nothing stops
                assert refused.returncode == 2, refused.stderr
                assert f"experts {group} would have no replica left" in refused.stderr
                assert (
                    "--force" in refused.stderr
                    and len(json.loads(ready.read_text())["experts"]) == 2
                )

                tokens: list[int] = []
                running = asyncio.ensure_future(_stream(stub, tokens))
                await eventually(lambda: len(tokens) >= 8, 30, "the stream under way")
                marks["down_from"] = time.monotonic()
                gone = await _scale(ready, group, 0, "--force")
                assert gone.returncode == 0, gone.stderr
                marks["down_at"] = time.monotonic()
                assert not running.done(), "the stream should outlast the scale-down"
                await eventually(lambda: sampler.ready_now() is False, 10, "not ready")
                status = await asyncio.to_thread(moe_mesh, "status", "--ready-file", ready)
                assert status.returncode == 1 and f"experts {group}" in status.stdout, status.stdout
                paused_at = len(tokens)
                await asyncio.sleep(1.0)
                assert not running.done() and len(tokens) - paused_at <= 1  # paused, not failed

                marks["up_from"] = time.monotonic()
                back = await _scale(ready, group, 1)
                assert back.returncode == 0, back.stderr
                marks["up_at"] = time.monotonic()
                await eventually(lambda: sampler.ready_now() is True, 10, "ready again")
                finish = await asyncio.wait_for(running, 120)
            sampler.stop.set()
            await sampling
            marks["samples"] = sampler.samples
            return expected, tokens, finish, marks

        expected, tokens, finish, marks = asyncio.run(scenario())
        # No expert call failed on the way (the retiring replica answered what it had in flight).
        assert sum(total(scrape(a), FAILOVERS) for a in info["metrics"]["routers"]) == 0

    assert tokens == expected and finish  # completed, token for token as without the scale
    samples = marks["samples"]
    # HTTP and gRPC agree at every sample, but one taken across a change (a sample's three answers
    # are three requests in turn).
    mixed = [s for s in samples if len(set(s[1:])) > 1]
    assert len(mixed) <= 2, mixed
    agreed = [(t, s[1]) for t, *s in samples if len(set(s)) == 1]
    # Ready until the scale-down began; not ready from the moment it was done until the replica
    # scaled back up was started; ready after that once more.
    assert all(r for t, r in agreed if t < marks["down_from"])
    assert not any(r for t, r in agreed if marks["down_at"] + 1.0 < t < marks["up_from"])
    assert all(r for t, r in agreed if t > marks["up_at"] + 1.0)
    changes = [r for i, (t, r) in enumerate(agreed) if i == 0 or r != agreed[i - 1][1]]
    assert changes == [True, False, True], changes
