"""registration_hooks: deregistering on stop is bounded, so an unreachable registry cannot hold a
stop past its grace period (an orchestrator's SIGKILL comes after it however it was spent)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from common.registry import DEREGISTER_S, registration_hooks
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


async def test_a_registry_that_never_answers_holds_a_stop_for_deregister_s_at_most(caplog) -> None:
    server = SimpleNamespace(on_ready=[], on_stop=[])
    registry = HangingRegistry()
    registration_hooks(server, registry, lambda: SimpleNamespace(id="expert-1"))
    [register], [deregister] = server.on_ready, server.on_stop
    await register()
    assert registry.registered == ["expert-1"]
    began = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await deregister(Deadline.after(0))  # grace 0: still given DEREGISTER_S to try
    took = time.monotonic() - began
    assert DEREGISTER_S <= took < DEREGISTER_S + 2 and registry.closed  # not the client's 10 s
    assert "could not deregister: the registry did not answer in time" in caplog.text
