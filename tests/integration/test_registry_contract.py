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
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
from grpc_health.v1 import health_pb2

from common.errors import InvalidArgumentError, UnavailableError
from common.registry import Instance, Membership, Registry
from common.registry.consul import ConsulRegistry
from common.server import GrpcServer
from moe_mesh.local import certs
from moe_mesh.local.registry import EmbeddedConsul, parse_duration
from tests.support.memory_registry import MemoryRegistry
from tests.support.polling import eventually
from tests.support.registries import (
    SERVICE,
    STEP_S,
    WAIT_S,
    ConsulAgent,
    consul_client,
    ids,
    instance_of,
)


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
    agent_address: str = ""  # set for a real agent

    @property
    def http_address(self) -> str:
        return self.embedded.address if self.embedded is not None else self.agent_address

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

    async def registered_ids(self) -> set[str]:
        """Every registered instance of SERVICE, passing or not: reaped, not merely hidden."""
        if isinstance(self.registry, MemoryRegistry):
            return {i.id for i in self.registry.registered(SERVICE)}
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{self.http_address}/v1/health/service/{SERVICE}") as r,
        ):
            return {e["Service"]["ID"] for e in await r.json()}

    async def query_held(self, index: int) -> None:
        """Wait until the watch's blocking query for `index` has reached the registry."""
        if self.embedded is not None:  # its request log shows it
            await eventually(
                lambda: any(
                    r.query.get("index") == str(index)
                    for r in self.embedded.requests
                    if r.path == f"/v1/health/service/{SERVICE}"
                ),
                STEP_S,
                f"a blocking query for index {index}",
            )
        elif not isinstance(self.registry, MemoryRegistry):
            # A real agent keeps no request log: this only makes a held query likely; the tests'
            # assertions hold either way. (The memory watch waits on an event as soon as it yields.)
            await asyncio.sleep(0.3)


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
            yield Backend(
                "consul-agent", reg, 1.0, None, agent.stop, agent.start, agent_address=agent.address
            )
        finally:
            await reg.close()
            await agent.stop()


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
    await backend.query_held(first.index)  # the change must wake a held blocking query
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
    await backend.query_held(m.index)  # the next query carries the index just returned
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
        # The window under test, not synchronisation: longer than a check interval, so a status
        # reset by re-registration would show in the watch before the next probe repaired it.
        await asyncio.sleep(0.3)
    while not w.queue.empty():
        await w.next()
    assert all(ids(m) == {"a"} for m in w.seen[settled:])


async def test_reregistering_a_critical_instance_keeps_it_critical(backend, watch, grpc_servers):
    # The other half of the rule above: a service that keeps refreshing its registration while it
    # fails its health check must not come back as passing until a check passes again.
    sick, healthy = await grpc_servers(), await grpc_servers()
    a = instance_of(sick, "a")
    await backend.register(a)
    await backend.register(instance_of(healthy, "b"))
    w = watch()
    await w.until(lambda m: ids(m) == {"a", "b"})
    await backend.set_serving(sick, a, False)
    await w.until(lambda m: ids(m) == {"b"})
    settled = len(w.seen)
    for _ in range(3):
        await backend.register(a)
    # A later change the watch must show: the membership that has it was read after every
    # re-registration above, so a re-registration that made `a` passing would show there too.
    await backend.register(instance_of(healthy, "c"))
    await w.until(lambda m: "c" in ids(m))
    assert [ids(m) for m in w.seen[settled:]][-1] == {"b", "c"}
    assert all("a" not in ids(m) for m in w.seen[settled:])
    await backend.set_serving(sick, a, True)  # still registered: passing again once it is healthy
    await w.until(lambda m: ids(m) == {"a", "b", "c"})


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

    async def reaped() -> bool:
        return "a" not in await backend.registered_ids()

    await eventually(reaped, backend.reap_s + STEP_S, "the critical instance to be reaped")
    with contextlib.suppress(KeyError):  # MemoryRegistry: a is gone, so it is unknown
        await backend.set_serving(failing, a, True)
    # Waiting for something not to happen needs a window: three check intervals, in which a
    # check still registered would have passed and brought `a` back.
    await asyncio.sleep(3 * backend.check_interval_s)
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
    # The outage's length is under test, not synchronisation: long enough for several failed
    # attempts of the watch, which must still yield only one stale membership.
    await asyncio.sleep(0.5)
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
    await backend.query_held(high.index)  # held by the registry when it goes down
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
        async with asyncio.timeout(STEP_S):
            m = await anext(it)
        assert ids(m) == {"a"} and not m.stale and m.index < high.index
        await reg.register(instance_of(server, "b"), check_interval_s=0.2)
        async with asyncio.timeout(STEP_S):
            while ids(m := await anext(it)) != {"a", "b"}:  # b shows once its check passes
                pass
        queries = [r.query for r in second.requests if r.path == f"/v1/health/service/{SERVICE}"]
        # One wait, then the reset to index 0, read from the request log rather than the clock: the
        # first query to the new registry carries the old incarnation's index (held for `wait`),
        # the next is a plain read.
        assert int(queries[0]["index"]) == high.index
        assert "index" not in queries[1]
    finally:
        await it.aclose()
        await reg.close()
        await first.stop()
        await second.stop()


async def test_a_tls_instance_is_checked_over_tls_with_the_registrys_certificate(tmp_path):
    """A service under mutual TLS registers a TLS health check; it passes only for a registry that
    presents a certificate of the mesh's CA (Consul: enable_agent_tls_for_checks)."""
    certs.create(tmp_path, ["expert", "registry"])
    tls = certs.mesh_tls(tmp_path, "expert")
    server = GrpcServer([], grace_s=0.1, credentials=tls.server_credentials())
    await server.start()
    try:
        for registry_tls, status in [
            (certs.mesh_tls(tmp_path, "registry"), "passing"),
            (None, "critical"),
        ]:
            embedded = EmbeddedConsul(tls=registry_tls)
            address = await embedded.start()
            client = consul_client(address)
            try:
                await client.register(
                    replace(instance_of(server, "tls"), tls=True), check_interval_s=0.2
                )

                deadline = time.monotonic() + 10
                # Checked at least once (a new check starts critical, with no output).
                while (check := await _service_check(address, "tls"))["Status"] != status or not (
                    check["Output"]
                ):
                    assert time.monotonic() < deadline, check
                    await asyncio.sleep(0.1)
                if status == "critical":  # it did dial: the handshake failed without a certificate
                    assert "UNAVAILABLE" in check["Output"]
            finally:
                await client.close()
                await embedded.stop()
    finally:
        await server.stop()


async def _service_check(address: str, service_id: str) -> dict:
    """The health check of one registered instance, as Consul's HTTP API reports it."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{address}/v1/health/service/{SERVICE}") as r:
            entries = await r.json()
    [check] = [c for e in entries for c in e["Checks"] if c.get("ServiceID") == service_id]
    return check
