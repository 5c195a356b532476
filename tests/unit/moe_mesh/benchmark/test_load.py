"""Load points against the fake gateway (conftest.py): how many requests are in flight, exact token
counts, timings, and the time bound."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from moe_mesh.benchmark import client
from moe_mesh.benchmark.load import CUT_OFF, LoadPoint, run_point
from moe_mesh.benchmark.workload import BenchRequest


def _requests(n: int, output_len: int = 4) -> list[BenchRequest]:
    return [BenchRequest([1, 2, 3], output_len) for _ in range(n)]


async def test_closed_loop_keeps_exactly_n_in_flight_and_counts_every_token(gateway) -> None:
    async with client.session(30) as s:
        model = await client.fetch_model(s, client.base_url(gateway.url + "/v1/"))
        assert model == client.ModelInfo("fake", 64, 100)
        results, duration = await run_point(
            s, gateway.url, "fake", _requests(8, 4), LoadPoint(concurrency=2), 30, seed=0
        )
    assert gateway.most_in_flight == 2
    assert all(r.ok and r.output_tokens == 4 and r.prompt_tokens == 3 for r in results)
    # 8 requests of 4 tokens, two at a time: at least 4 rounds of 4 token gaps
    assert duration >= 4 * 4 * gateway.token_s
    for r in results:
        assert gateway.token_s * 0.8 <= r.ttft_s < r.latency_s <= duration
        assert len(r.itl_s) == 3 and r.tpot_s == pytest.approx(sum(r.itl_s) / 3)
    body = gateway.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4
    assert body["ignore_eos"] and body["stream"] and body["return_token_ids"]


async def test_open_loop_at_an_infinite_rate_sends_everything_at_once(gateway) -> None:
    gateway.token_s = 0.05  # a busy host took 30 ms to start six requests: gaps it cannot blur
    async with client.session(30) as s:
        results, _ = await run_point(
            s, gateway.url, "fake", _requests(6), LoadPoint(request_rate=math.inf), 30, seed=0
        )
    assert gateway.most_in_flight == 6 and all(r.ok for r in results)
    assert max(r.start_s for r in results) < 3 * gateway.token_s


async def test_open_loop_spaces_requests_by_the_rate(gateway) -> None:
    async with client.session(30) as s:
        results, duration = await run_point(
            s, gateway.url, "fake", _requests(10, 1), LoadPoint(request_rate=50), 30, seed=3
        )
    starts = [r.start_s for r in results]
    assert starts == sorted(starts) and all(r.ok for r in results)
    assert 0.05 < starts[-1] < 0.6  # nine exponential gaps of mean 20 ms


async def test_the_time_bound_cuts_a_point_short_and_counts_the_rest_as_failed(gateway) -> None:
    gateway.token_s = 0.05
    start = time.perf_counter()
    async with client.session(30) as s:
        results, duration = await run_point(
            s, gateway.url, "fake", _requests(6, 10), LoadPoint(concurrency=1), 0.3, seed=0
        )
    assert time.perf_counter() - start < 1.5 and duration == pytest.approx(0.3, abs=0.2)
    assert [r.error for r in results] == [CUT_OFF] * 6  # each needs 0.5 s
    assert gateway.most_in_flight == 1
    await asyncio.sleep(0.1)
    assert gateway.in_flight == 0  # the cut request's stream was closed
