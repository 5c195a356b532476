"""Health checks of ejected endpoints, so a restarted one is back within a check interval rather
than when its ejection (up to 30 s) runs out.

Envoy's `successful_active_health_check_uneject_host` is the model. While an endpoint is ejected
(resilience.EndpointHealth) it gets no calls, so with static endpoints nothing would notice that it
came back. A Prober calls a check (a cheap call the endpoint serves anyway, which also confirms it
is still the endpoint it was: same model, same weights) every `interval_s` and re-admits the
endpoint when one passes.

A check vouches for what it tests: that the endpoint is up and the right one, not that it is fast.
So a pass re-admits an endpoint only once it has been seen down, by the failure that ejected it
(it could not be reached) or by a failed check since. An endpoint ejected for being slow (a
timeout, a lost hedge race) answers checks all along and waits out its ejection as before, unless
a check fails meanwhile (it went down, say was killed, and has come back). A check's word is taken
once per streak: an endpoint a check re-admitted that fails again before any call succeeded must
be seen down anew, so one whose checks pass while its calls fail costs a failed call per ejection,
which doubles, not one per interval.

Checks start one interval after the ejection, one at a time per endpoint, and stop when the
endpoint is re-admitted, its ejection ends (its next call is then the probe, as without checks),
it leaves (`retain`) or the prober closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass

from common.resilience import EndpointHealth

log = logging.getLogger(__name__)

# One check of an endpoint within timeout_s; raises when the endpoint fails it.
Check = Callable[[float], Awaitable[object]]


@dataclass
class _Watch:
    name: str
    health: EndpointHealth
    check: Check
    seen_down: bool  # a pass may re-admit it
    task: asyncio.Task | None = None


class Prober:
    """Logs ejections, and checks ejected endpoints in the background until they pass."""

    def __init__(self, interval_s: float, what: str = "endpoint") -> None:
        """`interval_s`: between the starts of two checks of an endpoint, and each check's
        timeout; 0 turns checks off. `what` names the endpoints in logs ("router", ...)."""
        self.interval_s, self.what = interval_s, what
        self.passed = 0  # checks passed
        self.failed = 0  # checks failed
        self.readmitted = 0  # ejections a check ended early
        self._watches: dict[Hashable, _Watch] = {}
        self._closed = False

    @property
    def checking(self) -> list[Hashable]:
        """The endpoints being checked."""
        return list(self._watches)

    def ejected(
        self,
        key: Hashable,
        name: str,
        health: EndpointHealth,
        check: Check | None,
        cause: object,
        down: bool,
    ) -> None:
        """`health` just ejected the endpoint `key` (called `name` in logs) for `cause`: log it and,
        given a `check`, check it while the ejection lasts. `down`: the failure showed the endpoint
        unreachable, not merely slow."""
        log.warning(
            "%s %s ejected for %gs (ejection %d in a row): %s",
            self.what,
            name,
            health.ejection_s,
            health.streak,
            cause,
        )
        if check is None or self.interval_s <= 0 or self._closed:
            return
        seen_down = down and not health.readmitted
        watch = self._watches.get(key)
        if watch is not None:  # still waking from the ejection before: this one starts afresh
            watch.health, watch.check, watch.seen_down = health, check, seen_down
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, no background checks: the ejection runs its course
            return
        watch = self._watches[key] = _Watch(name, health, check, seen_down)
        watch.task = loop.create_task(self._run(key, watch), name=f"check {name}")

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Stop checking the endpoints not in `keys` (they left the placement or membership)."""
        keep = set(keys)
        for key in [k for k in self._watches if k not in keep]:
            task = self._watches.pop(key).task
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        """Stop every check and wait for them to end; later ejections are only logged."""
        self._closed = True
        tasks = [w.task for w in self._watches.values() if w.task is not None]
        self._watches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, key: Hashable, watch: _Watch) -> None:
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            while True:
                await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))
                if not watch.health.ejected:
                    return
                started = loop.time()
                try:
                    async with asyncio.timeout(self.interval_s):  # a check that ignores its timeout
                        await watch.check(self.interval_s)
                except Exception as e:  # whatever the check raises, the endpoint failed it
                    self.failed += 1
                    watch.seen_down = True
                    log.debug("%s %s failed a health check: %s", self.what, watch.name, e)
                    continue
                self.passed += 1
                if watch.seen_down and watch.health.ejected:
                    left = watch.health.ejection_left_s
                    watch.health.readmit()
                    self.readmitted += 1
                    log.info(
                        "%s %s re-admitted: it passed a health check %.3gs before its ejection "
                        "was due to end",
                        self.what,
                        watch.name,
                        left,
                    )
                    return
        finally:
            if self._watches.get(key) is watch:
                del self._watches[key]
