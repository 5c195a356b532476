"""Following one service in a registry: a client per accepted instance, kept in step with every
membership snapshot. Routers follow expert services with it; gateways follow routers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Generic, TypeVar

from common.registry import Instance, Membership

C = TypeVar("C")


class Follower(Generic[C]):
    """`clients`: instance id -> the client `connect` made for it; `leave` is told of departures."""

    def __init__(self, connect: Callable[[Instance], C], leave: Callable[[C], None]) -> None:
        self._connect, self._leave = connect, leave
        self.clients: dict[str, C] = {}

    def reconcile(self, wanted: Mapping[str, Instance]) -> bool:
        """Connect instances new in `wanted`, let go of those no longer in it; True if anything changed."""
        gone = set(self.clients) - set(wanted)
        for instance_id in gone:
            self._leave(self.clients.pop(instance_id))
        new = set(wanted) - set(self.clients)
        for instance_id in new:
            self.clients[instance_id] = self._connect(wanted[instance_id])
        return bool(gone or new)


async def follow(watch: AsyncIterator[Membership], apply: Callable[[Membership], None]) -> None:
    """Hand every membership snapshot of a registry watch to `apply`, until cancelled."""
    async for membership in watch:
        apply(membership)
