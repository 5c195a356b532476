"""A retiring expert service's quiet period: after deregistering, it keeps accepting calls until none
has arrived for a while, so that no router sees a call to it fail.

Routers learn of the departure from a registry watch, a few milliseconds to a registry round trip
later; until then they may still choose this replica, and a call planned just before may arrive
just after. gRPC's stop refuses new calls at once: each such call was a failover at a router.
So a retiring replica, once deregistered, waits until `quiet_s` has passed without a new call
(every router has stopped choosing it), then stops accepting and lets what is in flight finish.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from common.server import Deadline, StopHook

# What the quiet wait may take of the stop's remaining grace: the rest is for the calls in flight.
QUIET_SHARE = 0.5
log = logging.getLogger(__name__)


async def until_quiet(
    calls: Callable[[], int],
    quiet_s: float,
    deadline: Deadline,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Return once `calls()` (a count of calls that arrived) has not grown for `quiet_s`: True; or
    once QUIET_SHARE of `deadline`'s remaining time has passed: False (calls were still arriving,
    e.g. from a router that cannot reach the registry)."""
    clock = deadline.clock
    give_up = clock() + deadline.remaining() * QUIET_SHARE
    seen, since = calls(), clock()
    while True:
        now = clock()
        if now - since >= quiet_s:
            return True
        if now >= give_up:
            return False
        # Steps of a quarter period: a call is noticed at most quiet_s / 4 after it arrived
        # (and of a millisecond at least, so rounding cannot leave the clock short of an end).
        await sleep(max(1e-3, min(quiet_s / 4, quiet_s - (now - since), give_up - now)))
        if (count := calls()) != seen:
            seen, since = count, clock()


def quiet_hook(
    calls: Callable[[], int],
    quiet_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> StopHook:
    """An on_stop hook of common.server.GrpcServer (after deregistration): until_quiet."""

    async def hook(deadline: Deadline) -> None:
        before = calls()
        if (
            quiet_s > 0
            and not await until_quiet(calls, quiet_s, deadline, sleep)
            and calls() > before
        ):
            log.warning(
                "calls still arriving after deregistering, never %gs apart; stopping anyway "
                "(is a router cut off from the registry?)",
                quiet_s,
            )

    return hook
