"""Live membership under a bounded load through the gateway: replicas join, die, leave, the registry goes away."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch

from common.errors import UnavailableError
from common.registry import Membership
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from moe_mesh.local.processes import start_experts
from moe_mesh.local.registry import EmbeddedConsul
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc
from router_service.app import RouterApp
from router_service.settings import RouterSettings
from tests.support.membership import instance_of, membership_of
from tests.support.polling import eventually, takes_calls
from tests.support.reference import ALL_REMOTE, PROMPTS, monolithic


class Load:
    """Greedy requests through the gateway, two at a time, until stopped (at most 2000, at most 120 s)."""

    def __init__(self, address: str, expected) -> None:
        self.address, self.expected = address, expected
        self.ok = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _worker(self, stub, offset: int) -> None:
        deadline = time.monotonic() + 120
        i = offset
        while (
            not self._stop.is_set()
            and self.ok + len(self.failures) < 2000
            and time.monotonic() < deadline
        ):
            prompt = i % len(PROMPTS)
            try:
                reply = await stub.Generate(
                    inference_pb2.GenerateRequest(
                        prompt_token_ids=PROMPTS[prompt], max_tokens=6, temperature=0.0
                    ),
                    timeout=20,
                )
                if (
                    tuple(reply.token_ids) != self.expected[prompt][: len(reply.token_ids)]
                    or not reply.token_ids
                ):
                    self.failures.append(f"wrong tokens for prompt {prompt}")
                else:
                    self.ok += 1
            except grpc.aio.AioRpcError as e:
                self.failures.append(f"{e.code().name}: {e.details()}")
            i += 2

    async def __aenter__(self) -> Load:
        self._channel = grpc.aio.insecure_channel(self.address)
        stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._task = asyncio.gather(self._worker(stub, 0), self._worker(stub, 1))
        return self

    async def run_for(self, seconds: float) -> None:
        start = self.ok
        await asyncio.sleep(seconds)
        assert self.ok > start, "the load made no progress"

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await self._task
        await self._channel.close()


async def test_membership_changes_under_load(checkpoint, tmp_path, monkeypatch) -> None:
    path = checkpoint("mixtral")
    expected = monolithic(path)
    registry = EmbeddedConsul()
    address = await registry.start()
    monkeypatch.setenv("CONSUL_HTTP_ADDR", address)
    flags = ("--registry", "consul")
    (tmp_path / "a").mkdir()
    # start_experts blocks while it waits: on a thread, so this loop keeps serving the registry.
    procs = await asyncio.to_thread(start_experts, path, ALL_REMOTE, tmp_path / "a", *flags)
    router = await RouterApp.create(
        RouterSettings(
            checkpoint=path, registry="consul", registry_address=address, connect_timeout_s=30
        )
    )
    await router.start()
    gateway = await GatewayApp.create(
        GatewaySettings(checkpoint=path, registry="consul", registry_address=address)
    )
    await gateway.start()
    membership = router.membership
    try:
        async with Load(gateway.grpc.address, expected) as load:
            await load.run_for(1.0)

            # A new replica of experts 4-7 joins: it starts taking traffic without a restart.
            (tmp_path / "b").mkdir()
            [added] = await asyncio.to_thread(
                start_experts, path, ["*:4-7"], tmp_path / "b", *flags
            )
            procs.append(added)
            await eventually(
                lambda: len(membership.backends) == 3, what="the new replica in the placement"
            )
            await eventually(
                lambda: takes_calls(added.address), what="the new replica taking calls"
            )

            # SIGKILL one of the two replicas of 4-7: in-flight calls fail over, nothing fails.
            procs[1].signal(signal.SIGKILL)
            await eventually(
                lambda: len(membership.backends) == 2, what="the dead replica to leave"
            )
            await load.run_for(1.0)

            # SIGTERM the only replica of 0-3 after a second one joined: a graceful leave, nothing fails.
            (tmp_path / "c").mkdir()
            [second] = await asyncio.to_thread(
                start_experts, path, ["*:0-3"], tmp_path / "c", *flags
            )
            procs.append(second)
            await eventually(
                lambda: takes_calls(second.address), what="the second 0-3 replica taking calls"
            )
            assert await asyncio.to_thread(procs[0].stop) == 0
            await eventually(
                lambda: len(membership.backends) == 2, what="the stopped replica to leave"
            )
            await load.run_for(1.0)

            # The registry goes away: the router keeps serving from the last known membership.
            await registry.stop()
            await eventually(
                lambda: membership.stale, what="the router to notice the registry is gone"
            )
            assert router.core.status().registry_stale
            await load.run_for(1.5)
            assert load.failures == [], load.failures[:5]

        # The only replica of experts 4-7 goes: requests fail with UNAVAILABLE naming them.
        added.signal(signal.SIGKILL)
        async with grpc.aio.insecure_channel(gateway.grpc.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                for prompt in PROMPTS:
                    await inference_pb2_grpc.InferenceStub(channel).Generate(
                        inference_pb2.GenerateRequest(
                            prompt_token_ids=prompt, max_tokens=6, temperature=0.0
                        ),
                        timeout=20,
                    )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no reachable replica for layer" in e.value.details()
        assert any(
            f"expert(s) {n}" in e.value.details() or f", {n}" in e.value.details() for n in "4567"
        )
        print(
            f"\nload: {load.ok} requests served, {len(load.failures)} failed across 4 membership changes"
        )
    finally:
        await gateway.stop()
        await router.stop()
        await registry.stop()
        for p in procs:
            await asyncio.to_thread(p.stop)


async def test_calls_in_flight_to_a_hung_departing_replica_fail_over_within_a_second(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    experts = await asyncio.to_thread(start_experts, path, ["*:0-7", "*:0-7"], tmp_path)
    m, dispatcher, ckpt = membership_of(path)
    try:
        a, b = (instance_of(m, n, int(e.address.rpartition(":")[2])) for n, e in zip("ab", experts))
        m.apply(Membership((a, b), 1))
        layer = ckpt.load_dense().layers[0]
        x = torch.randn(8, ckpt.spec.hidden_size)
        reference = await dispatcher.moe_layer(0, x, layer)
        experts[0].signal(signal.SIGSTOP)  # a hangs: calls to it stay in flight
        calls = [asyncio.ensure_future(dispatcher.moe_layer(0, x, layer)) for _ in range(4)]
        direct = asyncio.ensure_future(m.backends["a"].forward(0, [(0, x)], timeout_s=30))
        # Waiting for something not to happen needs a window: calls to the paused `a` stay open.
        await asyncio.sleep(0.3)
        assert not direct.done() and not all(c.done() for c in calls)
        start = time.monotonic()
        m.apply(Membership((b,), 2))  # a leaves the registry (its health check failed)
        # Its calls in flight may still answer for LEAVE_DRAIN_S (1 s), then they fail over.
        with pytest.raises(UnavailableError, match="left the mesh during the call"):
            await asyncio.wait_for(direct, 2)
        for got in await asyncio.wait_for(asyncio.gather(*calls), 2):
            assert torch.equal(got, reference)
        assert time.monotonic() - start < 2 and dispatcher.failovers >= 1
    finally:
        experts[0].signal(signal.SIGCONT)
        await m.stop()
        for e in experts:
            await asyncio.to_thread(e.stop)
