"""A registry in its own process, frozen (SIGSTOP) the way a hung agent is: the watch goes stale
within its wait window and recovers when the registry thaws."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.registry.consul import ConsulRegistry
from tests.support.registries import SERVICE, STEP_S, ConsulAgent, ids, instance_of

# A registry in its own process, so it can be frozen (SIGSTOP) the way a hung agent is: connections are
# accepted by the kernel and never answered.
EMBEDDED_PROCESS = """
import asyncio, sys
from moe_mesh.local.registry import EmbeddedConsul

async def main():
    print(await EmbeddedConsul().start(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def registry_process(
    kind: str, tmp_path: Path
) -> AsyncIterator[tuple[str, subprocess.Popen]]:
    if kind == "consul-agent":
        binary = shutil.which("consul")
        if binary is None:
            pytest.skip("consul binary not on PATH")
        agent = ConsulAgent(binary, tmp_path)
        await agent.start()
        try:
            yield agent.address, agent.proc
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
            await agent.stop()
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", EMBEDDED_PROCESS], stdout=subprocess.PIPE, text=True
    )
    try:
        address = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip()
        yield address, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize("kind", ["embedded-process", "consul-agent"])
async def test_a_frozen_registry_makes_the_watch_stale_within_its_wait_window(
    kind, grpc_servers, tmp_path
):
    server = await grpc_servers()
    async with registry_process(kind, tmp_path) as (address, proc):
        reg = ConsulRegistry(address, wait_s=1.0, request_timeout_s=30.0, stale_after_s=0.5)
        it = reg.watch(SERVICE)
        try:
            await reg.register(instance_of(server, "a"), check_interval_s=1.0)
            async with asyncio.timeout(STEP_S):
                while ids(m := await anext(it)) != {"a"}:
                    pass
            assert not m.stale
            os.kill(proc.pid, signal.SIGSTOP)
            # Within STEP_S (10 s): well before the call's own bound (wait + jitter +
            # request_timeout_s = 31 s) gives up.
            async with asyncio.timeout(STEP_S):
                frozen = await anext(it)
            assert frozen.stale and ids(frozen) == {"a"}
            os.kill(proc.pid, signal.SIGCONT)
            async with asyncio.timeout(STEP_S):
                thawed = await anext(it)
            assert not thawed.stale and ids(thawed) == {"a"}
        finally:
            await it.aclose()
            await reg.close()
