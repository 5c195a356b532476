"""The Registry contract, run against every backend:

  embedded      ConsulRegistry -> EmbeddedConsul started in the test (the fake Consul; request log)
  consul-agent  ConsulRegistry -> a real `consul agent -dev` on free loopback ports (needs `consul` on PATH)
  memory        MemoryRegistry (health via set_health, outages via fail())

Health is real for the Consul backends: instances point at a grpc.aio server with the standard
health service, flipped between SERVING and NOT_SERVING. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2

from moe_mesh.common.errors import InvalidArgumentError, UnavailableError
from moe_mesh.common.registry import Instance, Membership, Registry
from moe_mesh.common.registry.consul import ConsulConfig, ConsulRegistry
from moe_mesh.common.server import GrpcServer
from moe_mesh.local.registry import EmbeddedConsul, parse_duration
from tests.support.memory_registry import MemoryRegistry

SERVICE = "contract-svc"
WAIT_S = 10.0  # blocking-query wait; "woke on change" means well before this
STEP_S = 10.0  # bound on any single expected event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@dataclass
class Backend:
    """One registry under test plus the knobs the contract needs from outside the protocol."""

    name: str
    registry: Registry
    check_interval_s: float  # smallest check interval the backend honours
    reap_s: (
        float | None
    )  # a deregister_critical_after_s it honours quickly; None = not testable fast
    outage: Callable[[], Awaitable[None]]
    recover: Callable[[], Awaitable[None]]
    embedded: EmbeddedConsul | None = None  # set for the fake Consul: its request log

    async def set_serving(self, server: GrpcServer, instance: Instance, serving: bool) -> None:
        if isinstance(self.registry, MemoryRegistry):
            self.registry.set_health(instance.id, serving)
        else:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await server.health.set("", status)

    async def register(self, instance: Instance, reap_s: float = 30.0) -> None:
        await self.registry.register(
            instance, check_interval_s=self.check_interval_s, deregister_critical_after_s=reap_s
        )


def consul_client(address: str) -> ConsulRegistry:
    return ConsulRegistry(
        address, wait_s=WAIT_S, request_timeout_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.5
    )


@pytest.fixture(params=["embedded", "consul-agent", "memory"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "memory":
        reg = MemoryRegistry()

        async def outage() -> None:
            reg.fail(reachable=False)

        async def recover() -> None:
            reg.fail(reachable=True)

        yield Backend("memory", reg, 0.2, 0.3, outage, recover)
        await reg.close()
    elif request.param == "embedded":
        server = EmbeddedConsul()
        reg = consul_client(await server.start())
        b: Backend

        async def outage() -> None:
            await b.embedded.stop()

        async def recover() -> None:  # a new registry on the same port, as after a restart
            b.embedded = EmbeddedConsul(port=server.port)
            await b.embedded.start()

        b = Backend("embedded", reg, 0.2, 0.5, outage, recover, embedded=server)
        try:
            yield b
        finally:
            await reg.close()
            await b.embedded.stop()
    else:
        binary = shutil.which("consul")
        if binary is None:
            pytest.skip("consul binary not on PATH")
        agent = ConsulAgent(binary, tmp_path)
        await agent.start()
        reg = consul_client(agent.address)
        # Consul raises check intervals below 1s to 1s and reaps critical services no sooner than
        # 1 minute (its reaper runs every 30s), so the reaping point is left to the fake.
        try:
            yield Backend("consul-agent", reg, 1.0, None, agent.stop, agent.start)
        finally:
            await reg.close()
            await agent.stop()


@pytest.fixture
async def grpc_servers() -> AsyncIterator[Callable[[], Awaitable[GrpcServer]]]:
    """Factory of tiny real gRPC servers (health service only) on loopback port 0."""
    servers: list[GrpcServer] = []

    async def make() -> GrpcServer:
        server = GrpcServer([], grace_s=0.1)
        await server.start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        await s.stop()


def instance_of(server: GrpcServer, name: str, **meta: str) -> Instance:
    return Instance(
        SERVICE,
        name,
        "127.0.0.1",
        server.bound_port,
        tags=("moe-mesh", f"tag-{name}"),
        meta={"model_id": "m", "experts": "0:0-3", **meta},
    )


class Watch:
    """A watch consumed eagerly in the background, as services do (so a query is always in flight);
    `next` and `until` read what it yielded, with bounded waits."""

    def __init__(self, registry: Registry) -> None:
        self.queue: asyncio.Queue[Membership] = asyncio.Queue()
        self.seen: list[Membership] = []
        self.task = asyncio.create_task(self._pump(registry))

    async def _pump(self, registry: Registry) -> None:
        async for m in registry.watch(SERVICE):
            self.queue.put_nowait(m)

    async def next(self, timeout_s: float = STEP_S) -> Membership:
        async with asyncio.timeout(timeout_s):
            m = await self.queue.get()
        self.seen.append(m)
        return m

    async def until(
        self, pred: Callable[[Membership], bool], timeout_s: float = STEP_S
    ) -> Membership:
        async with asyncio.timeout(timeout_s):
            while not pred(m := await self.next(timeout_s)):
                pass
        return m

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def watch(backend: Backend) -> AsyncIterator[Callable[[], Watch]]:
    opened: list[Watch] = []

    def make() -> Watch:
        opened.append(Watch(backend.registry))
        return opened[-1]

    yield make
    for w in opened:
        await w.close()


def ids(m: Membership) -> set[str]:
    return {i.id for i in m.instances}


# --- the contract --------------------------------------------------------------------------------------


async def test_watch_yields_current_state_at_once(backend, watch, grpc_servers):
    server = await grpc_servers()
    first = await watch().next(timeout_s=2.0)
    assert first == Membership((), first.index) and not first.stale
    a = instance_of(server, "a")
    await backend.register(a)
    await watch().until(lambda m: ids(m) == {"a"})  # registered and passing
    t0 = time.monotonic()
    m = await watch().next(timeout_s=2.0)  # a new watch answers at once with the current state
    assert time.monotonic() - t0 < 1.0
    assert m.instances == (a,) and not m.stale


async def test_register_then_watch_sees_instance_with_meta_intact(backend, watch, grpc_servers):
    server = await grpc_servers()
    a = instance_of(server, "a", weights_checksum="sha256:abc", region="eu-1", fast_path="")
    await backend.register(a)
    m = await watch().until(lambda m: ids(m) == {"a"})
    (got,) = m.instances
    assert got == a  # service, id, host, port, tags, and every meta key and value (even empty)
    assert dict(got.meta) == {
        "model_id": "m",
        "experts": "0:0-3",
        "weights_checksum": "sha256:abc",
        "region": "eu-1",
        "fast_path": "",
    }


@pytest.mark.parametrize(
    "meta",
    [
        {"experts": "x" * 513},
        {"bad key": "v"},
        {"consul-x": "v"},
        {f"k{n}": "v" for n in range(65)},
    ],
)
async def test_meta_beyond_consul_limits_is_rejected(backend, grpc_servers, meta):
    server = await grpc_servers()
    with pytest.raises(InvalidArgumentError):
        await backend.register(Instance(SERVICE, "a", "127.0.0.1", server.bound_port, meta=meta))
    await backend.register(
        Instance(SERVICE, "a", "127.0.0.1", server.bound_port, meta={"experts": "x" * 512})
    )


async def test_blocking_watch_wakes_on_change_well_before_wait(backend, watch, grpc_servers):
    server = await grpc_servers()
    w = watch()
    first = await w.next()
    await asyncio.sleep(0.3)  # let the watch settle into a held blocking query
    t0 = time.monotonic()
    await backend.register(instance_of(server, "a"))
    m = await w.until(lambda m: ids(m) == {"a"})
    assert time.monotonic() - t0 < WAIT_S / 3, (
        "the watch waited out its blocking query instead of waking"
    )
    assert m.index > first.index  # the index the registry reports increases with changes
    await backend.registry.deregister("a")
    t0 = time.monotonic()
    gone = await w.until(lambda m: not m.instances)
    assert time.monotonic() - t0 < WAIT_S / 3
    assert gone.index > m.index


async def test_client_sends_the_returned_index_and_wait_back(backend, watch, grpc_servers):
    if backend.embedded is None:
        pytest.skip("needs the fake Consul's request log")
    server = await grpc_servers()
    w = watch()
    await w.next()
    await backend.register(instance_of(server, "a"))
    m = await w.until(lambda m: ids(m) == {"a"})
    await asyncio.sleep(0.2)  # the next (held) query has been sent
    queries = [
        r.query for r in backend.embedded.requests if r.path == f"/v1/health/service/{SERVICE}"
    ]
    assert "index" not in queries[0]  # the first read does not block
    assert all(q.get("passing") == "1" for q in queries)
    blocking = queries[1:]
    assert blocking and all(parse_duration(q["wait"]) == WAIT_S for q in blocking)
    sent = [int(q["index"]) for q in blocking]
    assert (
        sent == sorted(sent) and sent[-1] == m.index
    )  # each query carries the last X-Consul-Index


async def test_only_passing_instances_are_returned(backend, watch, grpc_servers):
    healthy, sick = await grpc_servers(), await grpc_servers()
    a, b = instance_of(healthy, "a"), instance_of(sick, "b")
    await backend.register(a)
    await backend.register(b)
    w = watch()
    await w.until(lambda m: ids(m) == {"a", "b"})
    await backend.set_serving(sick, b, False)
    assert (await w.until(lambda m: ids(m) != {"a", "b"})).instances == (a,)
    await backend.set_serving(sick, b, True)
    await w.until(lambda m: ids(m) == {"a", "b"})
    if not isinstance(backend.registry, MemoryRegistry):  # a dead endpoint fails its check too
        await healthy.stop()
        assert (await w.until(lambda m: ids(m) != {"a", "b"})).instances == (b,)


async def test_reregistering_a_passing_instance_never_hides_it(backend, watch, grpc_servers):
    # Services re-register every few seconds; as on a Consul agent, a check keeps its status across
    # re-registration, or every replica of a group would drop out of `passing` at once.
    server = await grpc_servers()
    a = instance_of(server, "a")
    await backend.register(a)
    w = watch()
    await w.until(lambda m: ids(m) == {"a"})
    settled = len(w.seen)
    for _ in range(3):
        await backend.register(a)
        await asyncio.sleep(0.3)
    while not w.queue.empty():
        await w.next()
    assert all(ids(m) == {"a"} for m in w.seen[settled:])


async def test_deregister_removes_instance(backend, watch, grpc_servers):
    server = await grpc_servers()
    await backend.register(instance_of(server, "a"))
    await backend.register(instance_of(server, "b"))
    w = watch()
    await w.until(lambda m: ids(m) == {"a", "b"})
    await backend.registry.deregister("a")
    await w.until(lambda m: ids(m) == {"b"})
    await backend.registry.deregister("a")  # unknown ids are fine
    assert ids(await watch().next()) == {"b"}


async def test_critical_instance_is_deregistered_after_its_limit(backend, watch, grpc_servers):
    if backend.reap_s is None:
        pytest.skip(f"{backend.name} reaps critical services after minutes, not seconds")
    failing, healthy = await grpc_servers(), await grpc_servers()
    a, b = instance_of(failing, "a"), instance_of(healthy, "b")
    await backend.register(a, reap_s=backend.reap_s)
    await backend.register(b, reap_s=backend.reap_s)
    w = watch()
    await w.until(lambda m: ids(m) == {"a", "b"})
    await backend.set_serving(failing, a, False)
    await w.until(lambda m: ids(m) == {"b"})
    await asyncio.sleep(backend.reap_s + 2 * backend.check_interval_s)
    with contextlib.suppress(KeyError):  # MemoryRegistry: a is gone, so it is unknown
        await backend.set_serving(failing, a, True)
    await asyncio.sleep(3 * backend.check_interval_s)  # a registered check would have passed by now
    assert ids(await watch().next()) == {"b"}


async def test_unreachable_registry_goes_stale_then_recovers(backend, watch, grpc_servers):
    server = await grpc_servers()
    a = instance_of(server, "a")
    await backend.register(a)
    w = watch()
    await w.until(lambda m: ids(m) == {"a"})
    await backend.outage()
    stale = await w.next()
    assert stale.stale and stale.instances == (a,)  # the last known membership, kept for serving
    with pytest.raises(UnavailableError):
        await backend.register(instance_of(server, "b"))
    await asyncio.sleep(0.5)  # several failed attempts in the meantime
    await backend.recover()
    back = await w.next()
    assert not back.stale and w.seen[-2] is stale  # one stale yield for the whole outage
    if back.instances != (a,):  # a restarted agent (dev mode / embedded) forgot registrations
        assert back.instances == ()
        await backend.register(a)
        await w.until(lambda m: m.instances == (a,))


async def test_watch_started_while_unreachable_yields_stale_at_once(backend, watch, grpc_servers):
    await backend.outage()
    m = await watch().next(timeout_s=2.0)
    assert m.stale and m.instances == ()
    await backend.recover()
    assert not (await watch().next()).stale


async def test_index_going_backwards_resets_and_watch_keeps_working(backend, watch, grpc_servers):
    if isinstance(backend.registry, MemoryRegistry):
        pytest.skip("the memory registry has no restart")
    server = await grpc_servers()
    for n in range(20):  # push the index well above where a fresh registry (or dev agent) starts
        await backend.register(instance_of(server, f"x{n}"))
        await backend.registry.deregister(f"x{n}")
    w = watch()
    high = await w.next()
    await asyncio.sleep(0.2)  # the next blocking query is held by the registry when it goes down
    await backend.outage()
    await backend.recover()
    low = await w.until(lambda m: not m.stale)
    assert low.index < high.index  # the restarted registry's index restarted low
    t0 = time.monotonic()
    await backend.register(instance_of(server, "a"))
    after = await w.until(lambda m: ids(m) == {"a"})
    assert (
        time.monotonic() - t0 < WAIT_S / 3
    )  # blocking on the new, low index: not stuck on the old one
    assert low.index < after.index < high.index
    if backend.embedded is not None:
        queries = [
            r.query for r in backend.embedded.requests if r.path == f"/v1/health/service/{SERVICE}"
        ]
        assert "index" not in queries[0]  # after the outage the client started over
        assert all(int(q["index"]) < high.index for q in queries[1:])


async def test_index_backwards_without_an_error_recovers_after_one_wait(grpc_servers):
    """A restart between two queries is invisible to the client: it asks the new registry for its old,
    higher index, which Consul holds for the whole `wait`; the lower index returned then resets it."""
    server = await grpc_servers()
    first = EmbeddedConsul()
    address = await first.start()
    reg = ConsulRegistry(address, wait_s=1.0, backoff_initial_s=0.05)
    it = reg.watch(SERVICE)  # consumed lazily: no query is in flight between two `anext`s
    second = EmbeddedConsul(port=first.port)
    try:
        for n in range(5):
            await reg.register(Instance(SERVICE, f"x{n}", "127.0.0.1", 1), check_interval_s=60)
            await reg.deregister(f"x{n}")
        high = await anext(it)
        await first.stop()
        await second.start()
        await reg.register(instance_of(server, "a"), check_interval_s=0.2)
        t0 = time.monotonic()
        async with asyncio.timeout(STEP_S):
            m = await anext(it)
        assert ids(m) == {"a"} and not m.stale and m.index < high.index
        assert 0.9 < time.monotonic() - t0 < 3.0  # one wait, then the reset to index 0
        await reg.register(instance_of(server, "b"), check_interval_s=0.2)
        await asyncio.sleep(0.3)
        async with asyncio.timeout(STEP_S):
            assert ids(await anext(it)) == {"a", "b"}
        queries = [r.query for r in second.requests if r.path == f"/v1/health/service/{SERVICE}"]
        assert (
            int(queries[0]["index"]) == high.index
        )  # the old incarnation's index, held for `wait`
        assert "index" not in queries[1]  # then reset: a plain read
    finally:
        await it.aclose()
        await reg.close()
        await first.stop()
        await second.stop()


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
            t0 = time.monotonic()
            async with asyncio.timeout(STEP_S):
                frozen = await anext(it)
            # Well before the call's own bound (wait + jitter + request_timeout_s = 31 s) gives up.
            assert (
                frozen.stale
                and ids(frozen) == {"a"}
                and time.monotonic() - t0 < 1.0 * 17 / 16 + 0.5 + 1.0
            )
            os.kill(proc.pid, signal.SIGCONT)
            async with asyncio.timeout(STEP_S):
                thawed = await anext(it)
            assert not thawed.stale and ids(thawed) == {"a"}
        finally:
            await it.aclose()
            await reg.close()


# --- ConsulRegistry details beyond the protocol ------------------------------------------------------


async def test_consul_client_index_rules_against_scripted_server():
    """Consul's documented index rules: echo the index back, reset it to 0 when it goes backwards
    or is not > 0, and yield only when the membership changes."""
    entry = {"Node": {"Node": "n", "Address": "127.0.0.1"}, "Checks": []}
    a = {
        **entry,
        "Service": {
            "ID": "a",
            "Service": SERVICE,
            "Tags": None,
            "Address": "",
            "Port": 1,
            "Meta": None,
        },
    }
    b = {
        **entry,
        "Service": {
            "ID": "b",
            "Service": SERVICE,
            "Tags": ["t"],
            "Address": "10.0.0.2",
            "Port": 2,
            "Meta": {"k": "v"},
        },
    }
    script = [(5, [a]), (7, [a]), (3, [a, b]), (4, [a, b]), (0, [b]), (6, [b])]
    sent: list[str | None] = []

    async def health(request: web.Request) -> web.Response:
        sent.append(request.query.get("index"))
        if not script:
            await asyncio.sleep(60)  # hold the last query, like a blocking query with nothing new
        index, body = script.pop(0)
        return web.json_response(body, headers={"X-Consul-Index": str(index)})

    app = web.Application()
    app.router.add_get(f"/v1/health/service/{SERVICE}", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    reg = consul_client(f"127.0.0.1:{sock.getsockname()[1]}")
    got: list[Membership] = []

    async def consume() -> None:
        async for m in reg.watch(SERVICE):
            got.append(m)

    consumer = asyncio.create_task(consume())
    try:
        async with asyncio.timeout(STEP_S):
            while len(sent) < 7:  # the 7th query is held: everything before it was handled
                await asyncio.sleep(0.01)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await reg.close()
        await runner.cleanup()
    assert [ids(m) for m in got] == [{"a"}, {"a", "b"}, {"b"}]
    assert got[0].instances[0].host == "127.0.0.1"  # empty service address -> the node's
    assert got[1].instances[1] == Instance(SERVICE, "b", "10.0.0.2", 2, ("t",), {"k": "v"})
    assert sent == [None, "5", "7", None, "4", None, "6"]


@pytest.mark.parametrize(
    "env, expect",
    [
        ({}, ("127.0.0.1", 8500, "http")),
        ({"CONSUL_HTTP_ADDR": "10.1.2.3:8600"}, ("10.1.2.3", 8600, "http")),
        ({"CONSUL_HTTP_ADDR": "https://consul.local:8501"}, ("consul.local", 8501, "https")),
        (
            {"CONSUL_HTTP_ADDR": "consul.local:8501", "CONSUL_HTTP_SSL": "true"},
            ("consul.local", 8501, "https"),
        ),
        ({"CONSUL_HTTP_ADDR": "[::1]:8500"}, ("::1", 8500, "http")),
    ],
)
def test_consul_config_from_environment(env, expect):
    c = ConsulConfig.from_env(env=env)
    assert (c.host, c.port, c.scheme) == expect


def test_consul_config_tls_and_token_sources(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {
        "CONSUL_HTTP_ADDR": "https://h:8501",
        "CONSUL_HTTP_TOKEN_FILE": str(token_file),
        "CONSUL_CACERT": "/ca.pem",
        "CONSUL_CLIENT_CERT": "/c.pem",
        "CONSUL_CLIENT_KEY": "/k.pem",
        "CONSUL_HTTP_SSL_VERIFY": "false",
    }
    c = ConsulConfig.from_env(env=env)
    assert (c.token, c.ca_file, c.client_cert, c.client_key, c.verify) == (
        "from-file",
        "/ca.pem",
        "/c.pem",
        "/k.pem",
        False,
    )
    assert (
        ConsulConfig.from_env(token="explicit", env={**env, "CONSUL_HTTP_TOKEN": "env"}).token
        == "explicit"
    )
    assert (
        ConsulConfig.from_env(address="http://x:1", env=env).address == "http://x:1"
    )  # explicit wins
    assert (
        ConsulConfig.from_env(
            env={"CONSUL_HTTP_ADDR": "https://h:1", "CONSUL_HTTP_SSL_VERIFY": "false"}
        ).ssl_context()
        is False
    )
    with pytest.raises(ValueError):
        ConsulConfig.from_env(env={"CONSUL_HTTP_ADDR": "h:notaport"})


def test_go_durations_parse_like_consul():
    assert (
        parse_duration("5s") == 5.0
        and parse_duration("200ms") == 0.2
        and parse_duration("1m30s") == 90.0
    )
    assert parse_duration("10") == 10.0
    with pytest.raises(ValueError):
        parse_duration("5 parsecs")


async def test_embedded_rejects_what_it_cannot_check():
    server = EmbeddedConsul()
    address = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            bad = {"Name": "x", "Check": {"HTTP": "http://127.0.0.1:1/", "Interval": "1s"}}
            async with http.put(f"http://{address}/v1/agent/service/register", json=bad) as r:
                assert r.status == 400 and "GRPC" in await r.text()
            async with http.put(
                f"http://{address}/v1/agent/service/register", json={"ID": "x"}
            ) as r:
                assert r.status == 400
            async with http.get(f"http://{address}/v1/status/leader") as r:
                assert r.status == 200 and await r.json()
    finally:
        await server.stop()
