"""common/registry/follow.py: a Follower holds one client per wanted instance, connecting the new,
letting go of the departed (each exactly once) and leaving the others' clients as they are;
`follow` hands every snapshot of a watch to its consumer in order."""

from __future__ import annotations

from common.registry import Instance, Membership
from common.registry.follow import Follower, follow


def instance(name: str, port: int = 1) -> Instance:
    return Instance("svc", name, "127.0.0.1", port)


def test_reconcile_connects_the_new_lets_go_of_the_gone_and_keeps_the_rest() -> None:
    connected: list[str] = []
    left: list[tuple[str, int]] = []

    def connect(i: Instance) -> tuple[str, int]:
        connected.append(i.id)
        return (i.id, connected.count(i.id))  # the client: its instance and which connection

    follower: Follower[tuple[str, int]] = Follower(connect, left.append)
    a, b, c = instance("a"), instance("b"), instance("c")
    assert follower.reconcile({"a": a, "b": b})
    assert not follower.reconcile({"a": a, "b": b})  # nothing changed: nobody reconnected
    assert follower.reconcile({"a": a, "c": c})
    assert sorted(connected) == ["a", "b", "c"] and left == [("b", 1)]
    assert follower.clients == {"a": ("a", 1), "c": ("c", 1)}
    assert follower.reconcile({"b": b})  # b back: a new connection
    assert sorted(left) == [("a", 1), ("b", 1), ("c", 1)]
    assert follower.clients == {"b": ("b", 2)}


async def test_follow_hands_every_snapshot_to_its_consumer_in_order() -> None:
    snapshots = [Membership((instance("a"),), 1), Membership((), 2), Membership((), 3)]

    async def watch():
        for m in snapshots:
            yield m

    seen: list[Membership] = []
    await follow(watch(), seen.append)
    assert seen == snapshots
