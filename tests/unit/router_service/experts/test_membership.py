"""ExpertMembership on its own: compatibility of registered services, coverage at start."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.errors import PreconditionError, UnavailableError
from common.registry import Membership
from tests.support.membership import instance_of, membership_of
from tests.support.memory_registry import MemoryRegistry


async def test_services_of_another_model_or_other_weights_are_ignored(checkpoint, caplog) -> None:
    m, dispatcher, _ = membership_of(checkpoint("mixtral"))
    good = instance_of(m, "good", 1)
    others = [
        instance_of(m, "other-model", 2, model_id="llama"),
        instance_of(m, "other-weights", 3, weights_checksum="x"),
        instance_of(m, "bad-experts", 4, experts="9:0"),
    ]
    m.apply(Membership((good, *others), 1))
    m.apply(Membership((good, *others), 2))
    assert set(m.backends) == {"good"}
    assert {b.address for bs in dispatcher.placement.values() for b in bs} == {"127.0.0.1:1"}
    warned = [r.message for r in caplog.records if "ignoring expert service" in r.message]
    assert len(warned) == 3 and any(
        "'llama'" in w for w in warned
    )  # once per service, naming what differs
    assert any("'9:0' does not fit this model" in w for w in warned)
    await m.stop()


async def test_calls_stay_under_the_message_limit_a_service_registers(checkpoint) -> None:
    m, _, _ = membership_of(checkpoint("mixtral"))  # the router's limit: 64 MiB
    said = [instance_of(m, "small", 1, max_message_bytes="8388608"), instance_of(m, "older", 2)]
    m.apply(Membership((*said, instance_of(m, "garbled", 3, max_message_bytes="-1")), 1))
    assert {name: b.call_bytes for name, b in m.backends.items()} == {
        "small": 8 * 2**20,
        "older": 64 * 2**20,  # registered before services said theirs
        "garbled": 64 * 2**20,
    }
    await m.stop()


async def test_start_times_out_naming_the_experts_no_service_covers(checkpoint) -> None:
    m, _, _ = membership_of(checkpoint("mixtral"))
    registry = MemoryRegistry()
    await registry.register(instance_of(m, "half", 1, experts="*:0-3"))
    start = time.monotonic()
    with pytest.raises(
        PreconditionError, match=r"after 0.5s no registered expert service serves 0-2:4-7 "
    ):
        await m.start(registry, timeout_s=0.5)
    assert time.monotonic() - start < 3
    await m.stop()


class _Silent:
    """A registry whose agent never answers: its watch only ever reports stale, empty memberships."""

    closed = False

    async def watch(self, service: str):
        while True:
            yield Membership((), 0, stale=True)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.closed = True


async def test_start_says_the_registry_never_answered_and_closes_it(checkpoint) -> None:
    m, _, _ = membership_of(checkpoint("mixtral"))
    registry = _Silent()
    with pytest.raises(UnavailableError, match="the registry did not answer in 0.3s"):
        await m.start(registry, timeout_s=0.3)
    assert registry.closed
