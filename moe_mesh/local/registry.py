"""`EmbeddedConsul`: a small Consul-compatible HTTP server, the registry `moe-mesh up` runs in-process.

It implements the subset of the agent API moe-mesh uses, shaped like Consul so py-consul (and
`curl`) read it unchanged:

    PUT /v1/agent/service/register          Name, ID, Address, Port, Tags, Meta, Check/Checks
    PUT /v1/agent/service/deregister/<id>
    GET /v1/health/service/<name>           ?passing, ?tag, blocking ?index & ?wait, X-Consul-Index
    GET /v1/status/leader                   so clients that ping the agent work

and it runs the gRPC health checks itself (grpc.health.v1 Check every Interval): a failing check
makes its instance critical, hidden by `passing`; critical for DeregisterCriticalServiceAfter
deregisters it. Unlike a real agent it keeps no state across restarts and its index restarts at 1,
which is also what the contract tests use to make the index go backwards. It is also the fake
Consul of those tests: `requests` logs each request's method, path and query.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registry import meta_problem
from common.tls import MeshTls

log = logging.getLogger(__name__)

NODE = "moe-mesh"
MAX_WAIT_S = 600.0  # Consul's cap on a blocking query's wait
DEFAULT_WAIT_S = 300.0  # Consul's default wait when a query has an index but no wait
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """A Go duration ("5s", "200ms", "1m30s") in seconds; a bare number is seconds, as Consul accepts."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d*)?", text):
        return float(text)
    if not text or _DURATION.sub("", text):
        raise ValueError(f"invalid duration {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))


def _fold(body: dict[str, Any]) -> dict[str, Any]:
    """Keys folded as Consul does (case-insensitive, snake_case accepted): py-consul sends `name`, `id`..."""
    return {k.replace("_", "").lower(): v for k, v in body.items()}


@dataclass
class _Check:
    id: str
    target: str  # host:port[/grpc service name]
    interval_s: float
    timeout_s: float
    deregister_after_s: float | None
    use_tls: bool
    status: str = "critical"  # Consul's initial status for a check without an explicit one
    output: str = ""
    critical_since: float = field(default_factory=time.monotonic)


@dataclass
class _Service:
    id: str
    name: str
    address: str
    port: int
    tags: list[str]
    meta: dict[str, str]
    checks: list[_Check]
    create_index: int
    modify_index: int
    tasks: list[asyncio.Task] = field(default_factory=list)

    def passing(self) -> bool:
        return all(c.status == "passing" for c in self.checks)


@dataclass(frozen=True)
class Request:
    """One logged request, for tests that assert what a client sent."""

    method: str
    path: str
    query: dict[str, str]


class EmbeddedConsul:
    """A Consul-compatible registry server on `host:port` (loopback, port 0 = any free port)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        check_timeout_s: float = 2.0,
        log_size: int = 1000,
        tls: MeshTls | None = None,
    ) -> None:
        # The certificate TLS health checks present (Consul: enable_agent_tls_for_checks).
        self.tls = tls
        self.host, self.port = host, port
        self.check_timeout_s = check_timeout_s  # for checks without their own Timeout
        self.requests: collections.deque[Request] = collections.deque(maxlen=log_size)
        self._services: dict[str, _Service] = {}
        self._index = 1
        self._service_index: dict[str, int] = {}  # name -> index of its last change
        self._changed = asyncio.Event()  # replaced on every change; see _bump
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def index(self) -> int:
        """The latest index handed out (1 on a fresh server; every change adds one)."""
        return self._index

    async def start(self) -> str:
        """Bind and serve; returns "host:port" (the CONSUL_HTTP_ADDR for clients)."""
        app = web.Application(middlewares=[self._log_request])
        app.router.add_put("/v1/agent/service/register", self._register)
        app.router.add_put("/v1/agent/service/deregister/{id}", self._deregister)
        app.router.add_get("/v1/health/service/{name}", self._health_service)
        app.router.add_get("/v1/status/leader", self._leader)
        sock = socket.socket(
            socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM
        )
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # restart on the same port at once
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        # Short shutdown: blocking queries are released by stop() before the runner cleans up.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner
        self._changed = asyncio.Event()  # bound to this loop on first wait
        log.info("embedded Consul-compatible registry on http://%s", self.address)
        return self.address

    async def stop(self) -> None:
        """Stop serving and checking; all registrations are forgotten (like a `consul agent -dev`).

        Held blocking queries are answered 503 rather than with an emptied catalog, so watchers
        keep their last membership (stale) instead of seeing every instance vanish.
        """
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        self._wake()
        tasks = [t for svc in self._services.values() for t in svc.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()  # closes the listener, then waits (briefly) for in-flight handlers
        self._services.clear()
        self._service_index.clear()
        self._index = 1

    # --- state -------------------------------------------------------------------------------------

    def _bump(self, name: str) -> None:
        self._index += 1
        self._service_index[name] = self._index
        self._wake()

    def _wake(self) -> None:
        # A fresh Event per change: every held query wakes and re-checks its own service's index.
        self._changed.set()
        self._changed = asyncio.Event()

    def _remove(self, service_id: str) -> _Service | None:
        svc = self._services.pop(service_id, None)
        if svc is not None:
            current = asyncio.current_task()
            for task in svc.tasks:
                if task is not current:  # a check task may be reaping its own service
                    task.cancel()
            self._bump(svc.name)
        return svc

    async def _run_check(self, svc: _Service, check: _Check) -> None:
        while True:
            status, output = await self._probe(check)
            # Consul keeps the latest output (a check that starts and stays critical says why);
            # only a status change is a change of index, as with Consul's check_update_interval.
            check.output = output
            if status != check.status:
                log.info(
                    "service %s check %s: %s -> %s %s",
                    svc.id,
                    check.id,
                    check.status,
                    status,
                    output,
                )
                check.status, check.output = status, output
                check.critical_since = time.monotonic()
                svc.modify_index = self._index + 1
                self._bump(svc.name)
            if (
                status == "critical"
                and check.deregister_after_s is not None
                and time.monotonic() - check.critical_since >= check.deregister_after_s
            ):
                log.info(
                    "deregistering %s: critical for over %gs", svc.id, check.deregister_after_s
                )
                if self._services.get(svc.id) is svc:
                    self._remove(svc.id)
                return
            await asyncio.sleep(check.interval_s)

    async def _probe(self, check: _Check) -> tuple[str, str]:
        # A fresh channel per probe, as Consul dials per check: a reused channel would sit in gRPC's
        # reconnect backoff (up to minutes) after the instance restarts.
        target, _, name = check.target.partition("/")
        if check.use_tls:
            creds = self.tls.channel_credentials() if self.tls else grpc.ssl_channel_credentials()
            channel = grpc.aio.secure_channel(target, creds)
        else:
            channel = grpc.aio.insecure_channel(target)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=check.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            return "critical", f"gRPC health check {check.target}: {e.code().name} {e.details()}"
        finally:
            await channel.close()
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return (
            "passing" if reply.status == health_pb2.HealthCheckResponse.SERVING else "critical",
            f"gRPC health check {check.target}: {status}",
        )

    # --- HTTP handlers -----------------------------------------------------------------------------

    @web.middleware
    async def _log_request(self, request: web.Request, handler):
        self.requests.append(Request(request.method, request.path, dict(request.query)))
        return await handler(request)

    async def _leader(self, request: web.Request) -> web.Response:
        return web.json_response(f"{self.host}:8300")

    async def _register(self, request: web.Request) -> web.Response:
        try:
            svc = self._parse_service(_fold(await request.json()))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return web.Response(status=400, text=f"Request decode failed: {e}")
        old = self._services.get(svc.id)
        if old is not None:
            self._remove(old.id)
            svc.create_index = old.create_index
            # A Consul agent restores a re-registered check's status and output: re-registration
            # (our services refresh theirs) must not hide a passing instance until its next probe.
            before = {c.id: c for c in old.checks}
            for c in svc.checks:
                if (prev := before.get(c.id)) is not None:
                    c.status, c.output, c.critical_since = (
                        prev.status,
                        prev.output,
                        prev.critical_since,
                    )
        self._services[svc.id] = svc
        self._bump(svc.name)
        svc.tasks = [
            asyncio.create_task(self._run_check(svc, c), name=f"check-{c.id}") for c in svc.checks
        ]
        return web.Response(status=200)

    def _parse_service(self, body: dict[str, Any]) -> _Service:
        name = body.get("name")
        if not name or not isinstance(name, str):
            raise ValueError("Missing service name")
        sid = body.get("id") or name
        meta = body.get("meta") or {}
        if problem := meta_problem(meta):
            raise ValueError(problem)
        raw_checks = list(body.get("checks") or []) + ([body["check"]] if body.get("check") else [])
        checks = []
        for n, raw in enumerate(raw_checks, 1):
            c = _fold(raw)
            if not c.get("grpc"):
                raise ValueError("the embedded registry supports only GRPC checks")
            interval = parse_duration(c.get("interval") or "10s")
            after = c.get("deregistercriticalserviceafter")
            default_id = (
                f"service:{sid}" if len(raw_checks) == 1 else f"service:{sid}:{n}"
            )  # Consul's naming
            checks.append(
                _Check(
                    id=c.get("checkid") or c.get("id") or default_id,
                    target=c["grpc"],
                    interval_s=max(interval, 0.01),
                    timeout_s=parse_duration(c["timeout"])
                    if c.get("timeout")
                    else min(self.check_timeout_s, interval),
                    deregister_after_s=parse_duration(after) if after else None,
                    use_tls=bool(c.get("grpcusetls")),
                    status=c.get("status") or "critical",
                )
            )
        return _Service(
            id=sid,
            name=name,
            address=body.get("address") or "",
            port=int(body.get("port") or 0),
            tags=list(body.get("tags") or []),
            meta=dict(meta),
            checks=checks,
            create_index=self._index + 1,
            modify_index=self._index + 1,
        )

    async def _deregister(self, request: web.Request) -> web.Response:
        if self._remove(request.match_info["id"]) is None:
            return web.Response(status=404, text=f'Unknown service ID "{request.match_info["id"]}"')
        return web.Response(status=200)

    async def _health_service(self, request: web.Request) -> web.Response:
        name, q = request.match_info["name"], request.query
        try:
            min_index = int(q.get("index", "0"))
            wait_s = min(parse_duration(q["wait"]), MAX_WAIT_S) if "wait" in q else DEFAULT_WAIT_S
        except ValueError as e:
            return web.Response(status=400, text=str(e))
        # Blocking query: hold while this service's index is not past the client's, up to wait_s;
        # on expiry answer with the unchanged state and index, as Consul does.
        deadline = time.monotonic() + wait_s
        while (
            min_index > 0
            and self._runner is not None
            and self._service_index.get(name, 1) <= min_index
            and (remaining := deadline - time.monotonic()) > 0
        ):
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        if self._runner is None:
            return web.Response(status=503, text="registry shutting down")
        passing = "passing" in q and q["passing"].lower() not in ("0", "false")
        tags = q.getall("tag", [])
        body = [
            self._entry(s)
            for s in sorted(self._services.values(), key=lambda s: s.id)
            if s.name == name and (not passing or s.passing()) and all(t in s.tags for t in tags)
        ]
        headers = {
            "X-Consul-Index": str(self._service_index.get(name, 1)),
            "X-Consul-KnownLeader": "true",
            "X-Consul-LastContact": "0",
        }
        return web.Response(text=json.dumps(body), content_type="application/json", headers=headers)

    def _entry(self, svc: _Service) -> dict[str, Any]:
        node = {
            "ID": "",
            "Node": NODE,
            "Address": self.host,
            "Datacenter": "dc1",
            "TaggedAddresses": {"lan": self.host},
            "Meta": {},
            "CreateIndex": 1,
            "ModifyIndex": 1,
        }
        service = {
            "ID": svc.id,
            "Service": svc.name,
            "Tags": svc.tags,
            "Address": svc.address,
            "Port": svc.port,
            "Meta": svc.meta,
            "Weights": {"Passing": 1, "Warning": 1},
            "EnableTagOverride": False,
            "CreateIndex": svc.create_index,
            "ModifyIndex": svc.modify_index,
        }
        checks = [
            {
                "Node": NODE,
                "CheckID": "serfHealth",
                "Name": "Serf Health Status",
                "Status": "passing",
                "Notes": "",
                "Output": "Agent alive and reachable",
                "ServiceID": "",
                "ServiceName": "",
                "ServiceTags": [],
                "Type": "",
                "CreateIndex": 1,
                "ModifyIndex": 1,
            }
        ]
        checks += [
            {
                "Node": NODE,
                "CheckID": c.id,
                "Name": f"Service '{svc.name}' check",
                "Status": c.status,
                "Notes": "",
                "Output": c.output,
                "ServiceID": svc.id,
                "ServiceName": svc.name,
                "ServiceTags": svc.tags,
                "Type": "grpc",
                "CreateIndex": svc.create_index,
                "ModifyIndex": svc.modify_index,
            }
            for c in svc.checks
        ]
        return {"Node": node, "Service": service, "Checks": checks}
