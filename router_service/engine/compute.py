"""The router's compute thread: torch work runs here so the event loop keeps gRPC and UCX traffic
moving while the model computes (torch releases the GIL inside its kernels)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

from common import runtime

T = TypeVar("T")


class ComputeThread:
    """One thread, not a pool: torch already spreads each kernel over the cores, and one queue
    runs micro-batches' stretches in the order they become ready.

    A call carries the caller's context (the current span), so spans opened while computing
    hang under the request that asked for them."""

    def __init__(self) -> None:
        self._pool = runtime.compute_thread("router-compute")

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, fn, *args)

    def release_openmp_threads(self) -> None:
        """End this thread's OpenMP workers (runtime.release_openmp_threads), e.g. before another
        thread computes in parallel for a while."""
        self._pool.submit(runtime.release_openmp_threads).result()

    def close(self) -> None:
        """Drop queued work and wait for a stretch still running (milliseconds), so nothing
        computes or opens spans after the service shut its telemetry down."""
        self._pool.shutdown(wait=True, cancel_futures=True)
