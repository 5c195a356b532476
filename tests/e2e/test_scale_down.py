"""Scaling an expert group down under load loses nothing (issue 43 item 3): a retiring replica
deregisters, answers the calls that still arrive until none has for a quiet period, drains both
transports, then exits; the router never sees one of its calls fail.

`moe-mesh up` with two replicas of each group, 8 concurrent greedy and seeded streams over gRPC
and HTTP, and the group scaled 2 -> 1 -> 2 -> 1 with `moe-mesh scale` meanwhile; and a router's
call in flight to a replica that leaves the registry is answered by it, not failed over.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import grpc
import torch

from bench.chaos import Request, Result, request_set, stream_grpc, stream_http
from common.registry import Membership
from moe_mesh.benchmark import client
from moe_mesh.local.processes import running_up, start_experts
from protos.moe_mesh.v1 import inference_pb2_grpc
from router_service.experts.membership import LEAVE_DRAIN_S
from tests.support.cli import moe_mesh
from tests.support.membership import instance_of, membership_of
from tests.support.metrics import scrape, total
from tests.support.polling import eventually

FAILOVERS = "moe_router_failovers_total"
EJECTIONS = "moe_router_ejections_total"
FALLBACKS = "moe_router_fast_path_fallbacks_total"
STEPS = (1, 2, 1)  # replicas of the group, from 2
LOAD_BOUND_S = 60.0
# Slowness on a shared host is not what this test measures: hedges, UCX attempts and learned call
# timeouts wait far longer than any call takes here, so only a call that failed or was refused
# moves the counters (a call stuck at a retiring replica still would, within 10 s).
PATIENT_ROUTER = "--hedge-min-delay-s 30 --expert-call-timeout-min-s 10 --fast-path-timeout-s 5"


def _counters(info: dict) -> dict[str, float]:
    """Each counter summed over the mesh's routers."""
    scraped = [scrape(address) for address in info["metrics"]["routers"]]
    return {
        name: sum(total(s, name) for s in scraped) for name in (FAILOVERS, EJECTIONS, FALLBACKS)
    }


class Load:
    """8 streams at a time through the gateway, cycling through `requests` until stopped (each
    request at least once); bounded by LOAD_BOUND_S."""

    def __init__(self, info: dict, requests: list[Request]) -> None:
        self.info, self.requests = info, requests
        self.results: list[Result] = []
        self.stop = asyncio.Event()

    async def run(self, concurrency: int = 8) -> list[Result]:
        deadline = time.monotonic() + LOAD_BOUND_S
        started = 0
        async with (
            grpc.aio.insecure_channel(self.info["gateway_grpc"]) as channel,
            client.session(timeout_s=60) as session,
        ):
            stub = inference_pb2_grpc.InferenceStub(channel)
            url = f"http://{self.info['gateway_http']}"

            async def worker() -> None:
                nonlocal started
                while started < len(self.requests) or not self.stop.is_set():
                    assert time.monotonic() < deadline, "the load outlived its bound"
                    r = self.requests[started % len(self.requests)]
                    started += 1
                    self.results.append(
                        await (
                            stream_grpc(stub, r, 60)
                            if r.transport == "grpc"
                            else stream_http(session, url, r)
                        )
                    )

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return self.results


def _ejection_causes(run_dir: Path) -> list[str]:
    """The cause of every expert-replica ejection the routers logged."""
    return [
        line.partition(" in a row): ")[2]
        for log in sorted(run_dir.glob("router-*.log"))
        for line in log.read_text().splitlines()
        if "expert replica" in line and " ejected for " in line
    ]


def test_scaling_a_group_down_under_load_fails_no_call(checkpoint, tmp_path, monkeypatch) -> None:
    began = time.monotonic()
    # Expert services (children of `up`, which inherit this) hold each call 10 ms for batch-mates,
    # so a router nearly always has a call in flight to the replica that leaves (without this, a
    # router that cancelled such calls failed one over in some runs only).
    monkeypatch.setenv("MOE_EXPERT_MAX_QUEUE_DELAY_US", "10000")
    ready, run_dir = tmp_path / "mesh.json", tmp_path / "run"
    flags = ["--expert-services", "2", "--replicas", "2", f"--router-arg={PATIENT_ROUTER}"]
    with running_up(
        checkpoint("mixtral"), flags, ready_file=ready, run_dir=run_dir,
        log_path=tmp_path / "up.log", ready_timeout_s=60, stop_timeout_s=30,
    ) as mesh:  # fmt: skip
        info, requests = mesh.info, request_set(16)  # greedy and seeded, gRPC and HTTP
        undisturbed = Load(info, requests)
        undisturbed.stop.set()
        baseline = asyncio.run(undisturbed.run())
        assert not [r.error for r in baseline if r.error]
        expected = {r.key: (r.tokens, r.finish) for r in baseline}
        before = _counters(info)
        group = info["experts"][0]["experts"]

        async def scaled() -> tuple[list[Result], list[int]]:
            load = Load(info, requests)
            running = asyncio.ensure_future(load.run())
            done_at_step = [0]
            for replicas in STEPS:
                # Streams finish on the group as it is before each change.
                await eventually(
                    lambda: len(load.results) >= done_at_step[-1] + 4, 30, "load progress"
                )
                done_at_step.append(len(load.results))
                scale = await asyncio.to_thread(
                    moe_mesh, "scale", "--ready-file", ready, "--experts", group,
                    "--replicas", str(replicas),
                )  # fmt: skip
                assert scale.returncode == 0, scale.stderr
                changed = json.loads(scale.stdout)["removed" if replicas == 1 else "added"]
                assert len(changed) == 1, scale.stdout
            await asyncio.sleep(1.0)
            load.stop.set()
            return await running, done_at_step

        results, done_at_step = asyncio.run(scaled())
        after = _counters(info)

    failed = [r.error for r in results if r.error]
    assert not failed, failed[:5]
    changed = [r.key for r in results if (r.tokens, r.finish) != expected[r.key]]
    assert not changed, changed
    # The load ran across every change: streams finished after the last one too.
    assert len(results) > done_at_step[-1] >= 4 * len(STEPS), (len(results), done_at_step)
    assert after == before, (before, after, _ejection_causes(run_dir))
    assert time.monotonic() - began < 90, f"took {time.monotonic() - began:.0f}s"


async def test_a_call_in_flight_to_a_replica_that_leaves_is_answered_not_failed_over(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    experts = await asyncio.to_thread(start_experts, path, ["*:0-7", "*:0-7"], tmp_path)
    m, _, ckpt = membership_of(path)
    try:
        a, b = (instance_of(m, n, int(e.address.rpartition(":")[2])) for n, e in zip("ab", experts))
        m.apply(Membership((a, b), 1))
        leaving = m.backends["a"]
        x = torch.randn(8, ckpt.spec.hidden_size)
        want = await leaving.forward(0, [(0, x)], timeout_s=30)
        experts[0].signal(signal.SIGSTOP)  # slow: the call is still in flight when `a` leaves
        call = asyncio.ensure_future(leaving.forward(0, [(0, x)], timeout_s=30))
        await asyncio.sleep(0.2)
        m.apply(Membership((b,), 2))  # `a` deregistered, as a replica scaled down does first
        await asyncio.sleep(LEAVE_DRAIN_S / 4)
        assert not call.done() and not leaving.retired
        experts[0].signal(signal.SIGCONT)  # it answers what is in flight, within LEAVE_DRAIN_S
        got = await asyncio.wait_for(call, LEAVE_DRAIN_S)
        assert torch.equal(got[0], want[0])
        await eventually(lambda: leaving.retired, 2, "the departed backend retired once idle")
    finally:
        experts[0].signal(signal.SIGCONT)
        await m.stop()
        for e in experts:
            await asyncio.to_thread(e.stop)
