"""A retiring expert service's quiet period (expert_service/drain.py) on a fake clock, and in a real
service: deregistered first, calls that still arrive are answered, only then new ones are refused."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from common.server import Deadline
from expert_service.app import ExpertApp
from expert_service.drain import QUIET_SHARE, quiet_hook, until_quiet
from moe_mesh.local.registry import EmbeddedConsul
from protos.moe_mesh.v1 import expert_pb2_grpc
from tests.support.experts import HIDDEN, connect, forward_request
from tests.support.polling import eventually


class FakeTime:
    """A clock that only sleeping moves, and a count of calls that arrive at set moments."""

    def __init__(self, arrivals: list[float] = ()) -> None:
        self.now, self.arrivals, self.slept = 100.0, sorted(arrivals), []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0, seconds
        self.slept.append(seconds)
        self.now += seconds

    def calls(self) -> int:
        return sum(1 for t in self.arrivals if 100.0 + t <= self.now)


async def test_no_call_arriving_returns_after_one_quiet_period() -> None:
    t = FakeTime()
    assert await until_quiet(t.calls, 0.5, Deadline.after(10, t.clock), t.sleep)
    assert t.now - 100 == pytest.approx(0.5)


async def test_each_call_that_arrives_restarts_the_quiet_period() -> None:
    t = FakeTime(arrivals=[0.1, 0.3, 0.7, 1.2])
    assert await until_quiet(t.calls, 0.5, Deadline.after(10, t.clock), t.sleep)
    # Quiet from the last arrival on, noticed within a quarter period of it.
    assert 1.2 + 0.5 <= t.now - 100 <= 1.2 + 0.5 + 0.5 / 4 + 1e-9
    assert max(t.slept) <= 0.5 / 4 + 1e-9


async def test_calls_that_never_stop_give_up_at_a_share_of_the_grace() -> None:
    t = FakeTime(arrivals=[i * 0.05 for i in range(1000)])
    assert not await until_quiet(t.calls, 0.5, Deadline.after(4, t.clock), t.sleep)
    # The rest of the grace is left for the calls in flight.
    assert t.now - 100 == pytest.approx(4 * QUIET_SHARE)


async def test_a_hook_of_zero_returns_at_once_and_one_cut_short_says_why(caplog) -> None:
    t = FakeTime(arrivals=[i * 0.01 for i in range(1000)])
    await quiet_hook(t.calls, 0.0, t.sleep)(Deadline.after(4, t.clock))
    assert t.now == 100.0
    with caplog.at_level(logging.WARNING, "expert_service.drain"):
        await quiet_hook(t.calls, 0.2, t.sleep)(
            Deadline.after(0.0, t.clock)
        )  # no time, no calls meanwhile
        assert not caplog.text
        await quiet_hook(t.calls, 0.2, t.sleep)(Deadline.after(1.0, t.clock))
    assert "calls still arriving" in caplog.text


async def test_a_retiring_service_deregisters_then_answers_calls_until_quiet(settings) -> None:
    registry = EmbeddedConsul()
    address = await registry.start()
    app = await ExpertApp.create(
        # A quiet period several times the calls' spacing: on 2 busy cores a call came 0.4 s
        # after the one before, once, and found the service gone
        settings(registry="consul", registry_address=address, drain_quiet_s=1.5, grace_s=10.0)
    )
    try:
        served = await app.start()
        assert [r.method for r in registry.requests if "/register" in r.path] == ["PUT"]
        request = forward_request(app.host, 0, [(1, torch.randn(3, HIDDEN))])
        async with connect(served) as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            await stub.Forward(request, timeout=5)
            stopping = asyncio.ensure_future(app.stop())
            await eventually(
                lambda: any("/deregister/" in r.path for r in registry.requests), 5, "deregistered"
            )
            # Deregistered, yet a call that a router sent meanwhile is answered: for as long as
            # calls keep coming, and a quiet period after the last.
            for _ in range(3):
                await asyncio.sleep(0.2)
                await stub.Forward(request, timeout=5)
                assert not stopping.done()
            await asyncio.wait_for(stopping, 6)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Forward(request, timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop()
        await registry.stop()
