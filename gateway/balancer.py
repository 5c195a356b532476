"""Which router a gateway call goes to, and whether a failed call may be tried again elsewhere.

Routers that fail are ejected for a while (Envoy-style outlier ejection, common/resilience.py)
and checked meanwhile, so that one restarted is back as soon as it answers (common/probing.py);
among the admitted ones the call goes to the one with the fewest open streams, ties rotating. A
dead router has no open streams, so without ejection it would attract every new request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from functools import partial
from typing import Protocol

from common.errors import UnavailableError
from common.probing import Prober
from common.resilience import (
    Clock,
    EjectionPolicy,
    EndpointHealth,
    RetryBudget,
    pick_healthy,
)


class RouterLostError(UnavailableError):
    """A router call failed with gRPC UNAVAILABLE: the router is down, unreachable, shutting down,
    or cannot reach its experts. Another router may serve the request (retried by the core)."""


class Routable(Protocol):
    address: str
    outstanding: int


class Balancer:
    def __init__(
        self,
        policy: EjectionPolicy,
        budget: RetryBudget,
        clock: Clock = time.monotonic,
        check: Callable[[Routable, float], Awaitable[object]] | None = None,
        check_interval_s: float = 0.0,
    ) -> None:
        """`check(router, timeout_s)` raises unless the router is back; an ejected router is
        checked every `check_interval_s` (0: never, it waits out its ejection)."""
        self.policy, self.budget, self._clock = policy, budget, clock
        self._health: dict[str, EndpointHealth] = {}
        self._members: set[str] | None = None  # since the first retain()
        self._turn = 0
        self.failovers = 0  # calls continued on another router, for status and tests
        self.ejections = 0  # times a router was ejected, for metrics
        self.check = check
        self.prober = Prober(check_interval_s, "router")

    def health(self, router: Routable) -> EndpointHealth:
        h = self._health.get(router.address)
        if h is None:
            h = self._health[router.address] = EndpointHealth(self.policy, self._clock)
        return h

    def pick(self, routers: Sequence[Routable], avoid: Collection[str] = ()) -> Routable:
        """The admitted router with the fewest open streams, preferring ones not in `avoid` (tried already)."""
        if not routers:
            raise UnavailableError("no router replica is available")
        fresh = [r for r in routers if r.address not in avoid] or list(routers)
        candidates = pick_healthy(fresh, self.health)
        self._turn += 1
        n = len(candidates)
        return min(
            (candidates[(self._turn + i) % n] for i in range(n)), key=lambda r: r.outstanding
        )

    def failed(self, router: Routable, cause: BaseException) -> None:
        """A call to `router` failed as a lost router's do (UNAVAILABLE: unreachable, or refusing
        calls); once that ejects it, it is logged and checked until it answers again. One that left
        the membership meanwhile is not: it is forgotten."""
        if self._members is not None and router.address not in self._members:
            return
        health = self.health(router)
        if health.failure():
            self.ejections += 1
            check = None if self.check is None else partial(self.check, router)
            self.prober.ejected(router.address, router.address, health, check, cause, down=True)

    def retain(self, routers: Sequence[Routable]) -> None:
        """The routers are these from now on: the others are forgotten and not checked any more."""
        self._members = {r.address for r in routers}
        self._health = {a: h for a, h in self._health.items() if a in self._members}
        self.prober.retain(self._members)

    async def close(self) -> None:
        """Stop checking ejected routers (before their channels close)."""
        await self.prober.close()

    def ejected(self) -> list[str]:
        return sorted(a for a, h in self._health.items() if h.ejected)
