"""Registry test helpers: a real `consul agent -dev` on free loopback ports, a ConsulRegistry client
with test timings, instances of a test service."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

import aiohttp

from common.registry import Instance, Membership
from common.registry.consul import ConsulRegistry
from common.server import GrpcServer
from tests.support.net import free_port

SERVICE = "contract-svc"
WAIT_S = 10.0  # blocking-query wait; "woke on change" means well before this
STEP_S = 10.0  # bound on any single expected event


class ConsulAgent:
    """`consul agent -dev` on free loopback ports; in-memory state, so a restart resets its index."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.log_path = binary, workdir / "consul.log"
        self.http_port = free_port()
        self.ports = [
            "-http-port",
            str(self.http_port),
            "-dns-port",
            "-1",
            "-grpc-port",
            "-1",
            "-serf-lan-port",
            str(free_port()),
            "-serf-wan-port",
            str(free_port()),
            "-server-port",
            str(free_port()),
        ]
        help_text = subprocess.run(
            [binary, "agent", "-h"], capture_output=True, text=True, timeout=30
        )
        # Consul >= 1.14 opens it in -dev.
        if "-grpc-tls-port" in help_text.stdout + help_text.stderr:
            self.ports += ["-grpc-tls-port", "-1"]
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    async def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "agent",
                "-dev",
                "-bind",
                "127.0.0.1",
                "-client",
                "127.0.0.1",
                "-node",
                "moe-mesh-test",
                *self.ports,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(f"http://{self.address}/v1/status/leader") as r:
                        if r.status == 200 and await r.json():
                            return
                await asyncio.sleep(0.2)
        await self.stop()
        raise RuntimeError(
            f"consul agent not ready in {timeout_s}s:\n{self.log_path.read_text()[-3000:]}"
        )

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 5)
        self.proc = None


def consul_client(address: str) -> ConsulRegistry:
    return ConsulRegistry(
        address, wait_s=WAIT_S, request_timeout_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.5
    )


def instance_of(server: GrpcServer, name: str, **meta: str) -> Instance:
    return Instance(
        SERVICE,
        name,
        "127.0.0.1",
        server.bound_port,
        tags=("moe-mesh", f"tag-{name}"),
        meta={"model_id": "m", "experts": "0:0-3", **meta},
    )


def ids(m: Membership) -> set[str]:
    return {i.id for i in m.instances}
