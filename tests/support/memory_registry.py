"""`MemoryRegistry`: the Registry protocol inside one process, for unit tests and single-process meshes.

Same semantics as Consul without the network: instances are passing until `set_health` says
otherwise (nothing probes them), re-registering keeps an instance's health, a critical instance
is deregistered after its `deregister_critical_after_s`, and `fail(reachable=False)` simulates an unreachable registry.
One object is shared by every service of the process, so `close()` leaves it usable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.errors import InvalidArgumentError, UnavailableError
from common.registry import Instance, Membership, meta_problem


@dataclass
class _Entry:
    instance: Instance
    deregister_critical_after_s: float
    passing: bool = True
    reaper: asyncio.TimerHandle | None = None


class MemoryRegistry:
    """In-process registry; watchers are woken by notification, not polling."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._index = 1  # Consul indexes start above 0; keep the same invariant
        self._reachable = True
        self._changed = asyncio.Event()

    def _bump(self) -> None:
        self._index += 1
        # A fresh Event per change: every waiter of the old one wakes, none misses a later change.
        self._changed.set()
        self._changed = asyncio.Event()

    def _check_reachable(self, action: str) -> None:
        if not self._reachable:
            raise UnavailableError(f"memory registry unreachable (simulated): cannot {action}")

    async def register(
        self,
        instance: Instance,
        check_interval_s: float = 2.0,
        deregister_critical_after_s: float = 30.0,
    ) -> None:
        """Add `instance`, passing, or replace a registered one keeping its health; meta beyond
        Consul's limits raises InvalidArgumentError. `check_interval_s` is unused: nothing is
        probed here."""
        self._check_reachable(f"register {instance.id}")
        if problem := meta_problem(dict(instance.meta)):  # Consul's limits, so both backends agree
            raise InvalidArgumentError("meta", problem)
        entry = self._entries.get(instance.id)
        if entry is None:
            self._entries[instance.id] = _Entry(instance, deregister_critical_after_s)
        else:
            # As on a Consul agent, re-registering keeps the check's status and when it went
            # critical: services refresh their registration every few seconds, which must neither
            # hide a passing instance nor revive (or spare from reaping) a critical one.
            entry.instance = instance
            entry.deregister_critical_after_s = deregister_critical_after_s
        self._bump()

    async def deregister(self, instance_id: str) -> None:
        self._check_reachable(f"deregister {instance_id}")
        if self._drop(instance_id):
            self._bump()

    def _drop(self, instance_id: str) -> bool:
        entry = self._entries.pop(instance_id, None)
        if entry is not None and entry.reaper is not None:
            entry.reaper.cancel()
        return entry is not None

    def set_health(self, instance_id: str, passing: bool) -> None:
        """Mark an instance passing or critical (what a failing health check does in Consul).

        Critical starts the deregister-critical timer, so this needs a running event loop; unknown
        ids raise KeyError.
        """
        entry = self._entries[instance_id]
        if entry.passing == passing:
            return
        entry.passing = passing
        if entry.reaper is not None:
            entry.reaper.cancel()
            entry.reaper = None
        if not passing:
            entry.reaper = asyncio.get_running_loop().call_later(
                entry.deregister_critical_after_s, self._reap, instance_id, entry
            )
        self._bump()

    def _reap(self, instance_id: str, entry: _Entry) -> None:
        if self._entries.get(instance_id) is entry and not entry.passing:
            del self._entries[instance_id]
            self._bump()

    def fail(self, reachable: bool) -> None:
        """Simulate the registry going away (`reachable=False`) or coming back (`reachable=True`)."""
        if reachable != self._reachable:
            self._reachable = reachable
            self._bump()

    def _passing(self, service: str) -> tuple[Instance, ...]:
        return tuple(
            sorted(
                (
                    e.instance
                    for e in self._entries.values()
                    if e.instance.service == service and e.passing
                ),
                key=lambda i: i.id,
            )
        )

    def registered(self, service: str) -> tuple[Instance, ...]:
        """Every registered instance of `service`, passing or not (Consul's health endpoint without
        `?passing`): what tests look at to see an instance reaped rather than only hidden."""
        return tuple(e.instance for e in self._entries.values() if e.instance.service == service)

    async def watch(self, service: str) -> AsyncIterator[Membership]:
        """See `Registry.watch`: yields on a change of this service's passing set or of reachability."""
        last: Membership | None = None
        while True:
            changed = (
                self._changed
            )  # taken before reading state, so no change slips between the two
            if self._reachable:
                current = Membership(self._passing(service), self._index)
            else:
                current = Membership.stale_from(last)
            if last is None or (current.instances, current.stale) != (last.instances, last.stale):
                last = current
                yield current
            await changed.wait()

    async def close(self) -> None:
        """Nothing to release; the registry stays usable by the other services sharing it."""
