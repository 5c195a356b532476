"""registration_hooks: deregistering on stop is bounded, so an unreachable registry cannot hold a
stop past its grace period (an orchestrator's SIGKILL comes after it however it was spent)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import common.registry as registry_module
from common.registry import registration_hooks
from common.server import Deadline


class HangingRegistry:
    """Registers at once; deregistering never answers (an agent that went away mid-stop)."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.closed = False

    async def register(self, instance) -> None:
        self.registered.append(instance.id)

    async def deregister(self, instance_id: str) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.closed = True


async def test_a_registry_that_never_answers_holds_a_stop_for_deregister_s_at_most(
    caplog, monkeypatch
) -> None:
    monkeypatch.setattr(registry_module, "DEREGISTER_S", 0.05)  # the bound, short for the test
    server = SimpleNamespace(on_ready=[], on_stop=[])
    registry = HangingRegistry()
    registration_hooks(server, registry, lambda: SimpleNamespace(id="expert-1"))
    [register], [deregister] = server.on_ready, server.on_stop
    await register()
    assert registry.registered == ["expert-1"]
    with caplog.at_level(logging.WARNING):
        # Unbounded, this would wait forever: the guard only catches that.
        await asyncio.wait_for(deregister(Deadline.after(0)), 30)
    assert registry.closed
    assert "could not deregister: the registry did not answer in time" in caplog.text


class SlowRegistry(HangingRegistry):
    """Deregisters after a few turns of the event loop: later than a grace of 0 allows."""

    def __init__(self) -> None:
        super().__init__()
        self.deregistered: list[str] = []

    async def deregister(self, instance_id: str) -> None:
        for _ in range(10):
            await asyncio.sleep(0)
        self.deregistered.append(instance_id)


async def test_a_stop_with_no_grace_left_still_gives_deregistering_deregister_s(caplog) -> None:
    server = SimpleNamespace(on_ready=[], on_stop=[])
    registry = SlowRegistry()
    registration_hooks(server, registry, lambda: SimpleNamespace(id="expert-1"))
    [register], [deregister] = server.on_ready, server.on_stop
    await register()
    with caplog.at_level(logging.WARNING):
        await deregister(Deadline.after(0))
    assert registry.deregistered == ["expert-1"] and registry.closed
    assert "could not deregister" not in caplog.text
