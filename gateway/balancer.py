"""Which router a gateway call goes to, and whether a failed call may be tried again elsewhere.

Routers that fail are ejected for a while (Envoy-style outlier ejection, common/resilience.py);
among the admitted ones the call goes to the one with the fewest open streams, ties rotating. A
dead router has no open streams, so without ejection it would attract every new request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Protocol

from moe_mesh.common.errors import UnavailableError
from moe_mesh.common.resilience import (
    Clock,
    EjectionPolicy,
    EndpointHealth,
    RetryBudget,
    pick_healthy,
)

log = logging.getLogger(__name__)


class RouterLostError(UnavailableError):
    """A router call failed with gRPC UNAVAILABLE: the router is down, unreachable, shutting down,
    or cannot reach its experts. Another router may serve the request (retried by the core)."""


class Routable(Protocol):
    address: str
    outstanding: int


class Balancer:
    def __init__(
        self, policy: EjectionPolicy, budget: RetryBudget, clock: Clock = time.monotonic
    ) -> None:
        self.policy, self.budget, self._clock = policy, budget, clock
        self._health: dict[str, EndpointHealth] = {}
        self._turn = 0
        self.failovers = 0  # calls continued on another router, for status and tests
        self.ejections = 0  # times a router was ejected, for metrics

    def health(self, router: Routable) -> EndpointHealth:
        h = self._health.get(router.address)
        if h is None:
            h = self._health[router.address] = EndpointHealth(self.policy, self._clock)
        return h

    def failed(self, router: Routable, cause: Exception) -> None:
        """Count a failed call of `router`; an ejection is logged, as the operator's first clue."""
        health = self.health(router)
        if health.failure():
            self.ejections += 1
            log.warning(
                "router %s ejected for %.0f s after: %s",
                router.address,
                health.ejected_until - self._clock(),
                cause,
            )

    def pick(self, routers: Sequence[Routable], avoid: Collection[str] = ()) -> Routable:
        """The admitted router with the fewest open streams, preferring ones not in `avoid` (tried already)."""
        if not routers:
            raise UnavailableError("no router replica is available")
        # Routers leave with membership changes: forget them.
        if len(self._health) > 2 * len(routers):
            keep = {r.address for r in routers}
            self._health = {a: h for a, h in self._health.items() if a in keep}
        fresh = [r for r in routers if r.address not in avoid] or list(routers)
        candidates = pick_healthy(fresh, self.health)
        self._turn += 1
        n = len(candidates)
        return min(
            (candidates[(self._turn + i) % n] for i in range(n)), key=lambda r: r.outstanding
        )

    def ejected(self) -> list[str]:
        return sorted(a for a, h in self._health.items() if h.ejected)
