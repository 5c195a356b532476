"""The benchmark's HTTP client against the fake gateway (conftest.py) and against nothing."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import UnavailableError
from moe_mesh.benchmark import client
from moe_mesh.benchmark.workload import BenchRequest


async def test_errors_are_failed_results_with_the_servers_message(gateway) -> None:
    async with client.session(30) as s:
        refused, broken = await asyncio.gather(
            client.stream_completion(s, gateway.url, "fake", BenchRequest([1], 60), 0.0),
            client.stream_completion(s, gateway.url, "fake", BenchRequest([1], 7), 0.0),
        )
    assert not refused.ok and refused.error == "HTTP 400: max_tokens: too many"
    assert not broken.ok and broken.error == "UNAVAILABLE: router gone"


async def test_an_unreachable_gateway_is_unavailable_with_a_hint() -> None:
    async with client.session(5) as s:
        with pytest.raises(UnavailableError, match=r"127\.0\.0\.1:9/v1/models: .*moe-mesh up"):
            await client.fetch_model(s, "http://127.0.0.1:9")


def test_base_url_takes_what_users_paste() -> None:
    for text in ("127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"):
        assert client.base_url(text) == "http://127.0.0.1:8000"


async def test_stream_tokens_times_each_chunk_on_the_clock_it_is_given(gateway) -> None:
    ticks = iter(range(0, 100, 10))  # the request starts at 0; each chunk with tokens reads on
    body = {"model": "fake", "prompt": [1, 2], "max_tokens": 3, "stream": True}
    async with client.session(30) as s:
        streamed = await client.stream_tokens(s, gateway.url, body, clock=lambda: next(ticks))
    assert streamed.error is None and streamed.token_ids == [0, 1, 2]
    assert (streamed.ttft_s, streamed.itl_s, streamed.latency_s) == (10, [10, 10], 30)
    assert streamed.usage_tokens == 3 and streamed.max_gap_s == 10
    assert gateway.bodies == [body]


async def test_stream_tokens_reports_a_refusal_and_a_broken_stream_as_errors(gateway) -> None:
    async with client.session(30) as s:
        refused = await client.stream_tokens(s, gateway.url, {"prompt": [1], "max_tokens": 60})
        broken = await client.stream_tokens(s, gateway.url, {"prompt": [1], "max_tokens": 7})
    assert refused.error == "HTTP 400: max_tokens: too many" and refused.token_ids == []
    assert broken.error == "UNAVAILABLE: router gone" and broken.token_ids == [0, 1, 2]
