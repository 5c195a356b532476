"""Gateway core against fake router backends: admission by priority, balancing over router replicas."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import ResourceExhaustedError
from common.tokenizer import Tokenizer
from gateway.admission import Admission
from gateway.core import GatewayCore, ModelInfo, TextRequest
from gateway.router_client import Chunk
from gateway.settings import GatewaySettings


class FakeRouter:
    """Answers every request with `n` tokens, one per message, after an optional gate opens."""

    def __init__(self, address: str, gate: asyncio.Event | None = None) -> None:
        self.address, self.gate, self.outstanding, self.served = address, gate, 0, []

    async def generate(self, request, timeout_s, trace_context=None):
        self.outstanding += 1
        try:
            self.served.append(request.request_id)
            if self.gate is not None:
                await self.gate.wait()
            n = request.params.max_tokens
            for i in range(n):
                yield Chunk([5 + i], "length" if i == n - 1 else None, len(request.prompt_token_ids), i + 1)
        finally:
            self.outstanding -= 1

    async def status(self, timeout_s):  # pragma: no cover - not used by the core
        raise NotImplementedError


def core(path, routers, **settings) -> GatewayCore:
    s = GatewaySettings(checkpoint=path, routers=[r.address for r in routers], **settings)
    return GatewayCore(s, Tokenizer(path), routers, ModelInfo("m", "mixtral", 512, 512))


async def test_requests_spread_over_router_replicas_by_outstanding_streams(checkpoint) -> None:
    gate = asyncio.Event()
    a, b = FakeRouter("a:1", gate), FakeRouter("b:1", gate)
    gw = core(checkpoint("mixtral"), [a, b])
    tasks = [asyncio.create_task(gw.complete(TextRequest(prompt_token_ids=[1, 2], max_tokens=3))) for _ in range(6)]
    await asyncio.sleep(0.05)
    assert (a.outstanding, b.outstanding) == (3, 3)  # concurrent streams balance
    gate.set()
    results = await asyncio.gather(*tasks)
    assert all(r.token_ids == [5, 6, 7] and r.finish_reason == "length" for r in results)
    for _ in range(4):  # sequential requests rotate between idle replicas
        await gw.complete(TextRequest(prompt_token_ids=[1], max_tokens=1))
    assert len(a.served) == len(b.served) == 5


async def test_admission_serves_waiting_requests_by_priority_then_arrival() -> None:
    adm = Admission(max_in_flight=1, max_queued=3, retry_after_s=2.0)
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        async with adm.slot(priority):
            order.append(name)
            await asyncio.sleep(0.01)

    first = asyncio.create_task(request("first", 0))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(request(n, p)) for n, p in [("low", -1), ("high", 5), ("normal", 0)]]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhaustedError, match="retry after 2s") as e:
        await request("rejected", 9)
    assert e.value.retry_after_s == 2.0 and adm.rejected == 1
    await asyncio.gather(first, *waiting)
    assert order == ["first", "high", "normal", "low"]
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    adm = Admission(max_in_flight=1, max_queued=1, retry_after_s=1.0)
    async with adm.slot():
        waiter = asyncio.create_task(adm.slot().__aenter__())
        await asyncio.sleep(0)
        assert adm.queued == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
    assert adm.in_flight == 0
    async with adm.slot():  # still usable
        assert adm.in_flight == 1
