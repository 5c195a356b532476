"""Balancer: the least busy admitted router, ejection on failure, and forgetting departed routers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from common.resilience import EjectionPolicy, RetryBudget
from gateway.balancer import Balancer, RouterLostError


@dataclass
class Router:
    address: str
    outstanding: int = 0


async def still_down(router: Router, timeout_s: float) -> None:
    raise RouterLostError(f"{router.address} is down")


async def test_a_departed_router_is_forgotten_and_no_longer_checked() -> None:
    a, b = Router("a:1", outstanding=3), Router("b:1")
    balancer = Balancer(
        EjectionPolicy(consecutive_failures=1),
        RetryBudget(0.2),
        check=still_down,
        check_interval_s=0.01,
    )
    try:
        assert balancer.pick([a, b]) is b  # the fewest open streams
        balancer.failed(b, RouterLostError("gone"))
        assert balancer.ejected() == ["b:1"] and balancer.prober.checking == ["b:1"]
        assert balancer.pick([a, b]) is a
        balancer.retain([a])  # b left the membership
        await asyncio.sleep(0.05)
        assert balancer.ejected() == [] and balancer.prober.checking == []
        balancer.failed(b, RouterLostError("its stream ended"))  # a call begun before it left
        assert balancer.ejected() == [] and balancer.prober.checking == []
        # Back under the same address (restarted): a fresh start, not the old ejection.
        balancer.retain([a, b])
        assert balancer.pick([a, b]) is b
    finally:
        await balancer.close()
