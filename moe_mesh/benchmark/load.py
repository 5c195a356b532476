"""Load generation: one load point runs the workload closed-loop (N clients, each sending its next
request when the previous one ends) or open-loop (Poisson arrivals at a rate, whatever is in flight).

Every point is bounded by `max_duration_s`: no request starts after it and requests still running
then are cancelled; both count as failed ("not finished within the time bound"), so a stalled mesh
cannot hang the benchmark. A point's duration is from its start to its last answer (or the bound).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from moe_mesh.benchmark.client import stream_completion
from moe_mesh.benchmark.stats import RequestResult
from moe_mesh.benchmark.workload import BenchRequest, poisson_arrivals

CUT_OFF = "not finished within the time bound (--max-duration-s)"


@dataclass(frozen=True)
class LoadPoint:
    """Exactly one of: `concurrency` clients in a closed loop, or `request_rate` arrivals per second."""

    concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load point has either a concurrency or a request rate")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"rate={self.request_rate:g}/s" if not math.isinf(self.request_rate) else "rate=inf"

    def as_json(self) -> dict:
        rate = self.request_rate
        return {
            "concurrency": self.concurrency,
            "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
        }


async def run_point(
    s: aiohttp.ClientSession,
    url: str,
    model: str,
    requests: list[BenchRequest],
    point: LoadPoint,
    max_duration_s: float,
    seed: int,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float]:
    """Run every request of `requests` at `point`; (results in request order, wall seconds)."""
    t0 = time.perf_counter()
    deadline = t0 + max_duration_s
    results: list[RequestResult | None] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await stream_completion(s, url, model, requests[i], t0)
        on_done(results[i])

    tasks: list[asyncio.Task] = []
    if point.concurrency is not None:
        queue = iter(range(len(requests)))

        async def client() -> None:
            for i in queue:  # shared: each client takes the next request
                if time.perf_counter() >= deadline:
                    return
                await one(i)

        tasks = [asyncio.create_task(client()) for _ in range(point.concurrency)]
        sender = None
    else:
        arrivals = poisson_arrivals(len(requests), point.request_rate, random.Random(seed))

        async def send_all() -> None:
            for i, at in enumerate(arrivals):
                delay = t0 + at - time.perf_counter()
                if t0 + at >= deadline:
                    return
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))

        sender = asyncio.create_task(send_all())
    try:
        if sender is not None:
            await asyncio.wait_for(asyncio.shield(sender), max(0.0, deadline - time.perf_counter()))
        await asyncio.wait_for(asyncio.gather(*tasks), max(0.0, deadline - time.perf_counter()))
    except TimeoutError:
        pass
    finally:
        pending = [t for t in [*tasks, sender] if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    out = [
        r or RequestResult(ok=False, prompt_tokens=req.input_len, error=CUT_OFF)
        for req, r in zip(requests, results)
    ]
    return out, duration
