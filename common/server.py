"""The one gRPC server lifecycle every service uses.

start: bind (loopback by default; TLS with `credentials`), health SERVING, reflection when asked,
       then `on_ready` hooks (registration). With `health_port`, a second, plaintext listener serves
       the same health service and nothing else: Kubernetes' native gRPC probe cannot speak TLS.
stop:  health NOT_SERVING, `on_stop` hooks (deregistration, a gateway's HTTP drain), stop accepting,
       let in-flight calls finish, then stop; all of it by one Deadline, `grace_s` after stop began.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import runtime

Hook = Callable[[], Awaitable[None]]
# A health service name that is SERVING from start until stop (or a fault the process cannot
# recover from, e.g. a router whose engine loop gave up): what a liveness probe asks about. Readiness
# (the overall "" service) can go NOT_SERVING in a sound process, e.g. a gateway missing experts,
# and a liveness probe on it would restart that process in a loop.
LIVENESS = "moe_mesh.liveness"


@dataclass(frozen=True)
class Deadline:
    """One moment on the monotonic clock that every stage of a stop shares: each waits only for what
    the stages before it left. Waits that each took the whole grace period added up (a gateway took
    2-3x grace_s), and an orchestrator's SIGKILL comes after its grace period however it was spent."""

    at: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + seconds, clock)

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock())


StopHook = Callable[[Deadline], Awaitable[None]]


@dataclass
class Service:
    """One gRPC service to host: its full name, the generated add_*_to_server function and the servicer."""

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options both ends use: message limits sized for activations (gRPC's default 4 MiB is too small)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def peer_channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """A long-lived channel to a mesh peer (router -> expert service, gateway -> router):
    channel_options, and reconnection attempts at most a second apart.

    gRPC's reconnect back-off grows 1.6-fold per failed attempt up to 120 s, so a peer restarted
    after 25 s down was measured waiting 18 s for its channel to try again: long after a health
    check (common/probing.py) would have re-admitted it, and every call meanwhile failed. An
    attempt per second costs a dead peer one refused connection a second."""
    return [*channel_options(max_message_bytes), ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class GrpcServer:
    services: Sequence[Service]
    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 64 * 1024 * 1024
    grace_s: float = 10.0
    on_ready: list[Hook] = field(default_factory=list)
    on_stop: list[StopHook] = field(default_factory=list)  # given the stop's deadline
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()  # e.g. tracing
    credentials: grpc.ServerCredentials | None = None  # None: plaintext
    # Reflection lists every method to anyone who connects (a fuzzer found Forward through it):
    # internal services leave it off unless an operator asks.
    reflection: bool = False
    # A plaintext port serving only grpc.health.v1 (the same statuses): for probes without TLS.
    health_port: int | None = None
    clock: Callable[[], float] = time.monotonic  # what a stop's deadline is measured on
    # Whether "" and the services start SERVING (a gateway missing experts starts NOT_SERVING):
    # set before the port opens, so no probe sees a status the service does not mean.
    ready: Callable[[], bool] = lambda: True

    def __post_init__(self) -> None:
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.bound_port = 0
        self.bound_health_port = 0

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.bound_port}"

    async def start(self) -> str:
        server = grpc.aio.server(
            options=[*channel_options(self.max_message_bytes), ("grpc.so_reuseport", 0)],
            interceptors=list(self.interceptors),
        )
        for s in self.services:
            s.add_to_server(s.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [s.name for s in self.services]
        if self.reflection:
            reflection.enable_server_reflection(
                [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
            )
        address = f"{self.host}:{self.port}"
        try:
            self.bound_port = (
                server.add_secure_port(address, self.credentials)
                if self.credentials is not None
                else server.add_insecure_port(address)
            )
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") and says no more
            raise bind_error(self.host, self.port, "gRPC") from None
        if self.health_port is not None:  # bound first: a port in use fails before any serving
            await self._start_health_listener(self.health_port)
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *names]:
            await self.health.set(name, status)
        await self.health.set(LIVENESS, serving)
        await server.start()
        self._server = server
        for hook in self.on_ready:
            await hook()
        return self.address

    async def _start_health_listener(self, port: int) -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.bound_health_port = server.add_insecure_port(f"{self.host}:{port}")
        except RuntimeError:
            raise bind_error(self.host, port, "the gRPC health port") from None
        await server.start()
        self._health_server = server

    def deadline(self, grace_s: float | None = None) -> Deadline:
        """A stop's deadline: `grace_s` (default the server's) from now."""
        return Deadline.after(self.grace_s if grace_s is None else grace_s, self.clock)

    async def stop(self, deadline: Deadline | None = None) -> None:
        """NOT_SERVING, the on_stop hooks, then in-flight calls may finish until `deadline` (default:
        grace_s from now), when those left are cancelled."""
        if self._server is None:
            return
        server, self._server = self._server, None
        deadline = deadline or self.deadline()
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        for hook in self.on_stop:
            await hook(deadline)
        await server.stop(deadline.remaining())
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None


def bind_error(host: str, port: int, what: str) -> OSError:
    """One line naming the address, why it cannot be listened on, and what to do."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
        why = "it could not be bound"
    except OSError as e:
        why = e.strerror or str(e)
    hint = (
        "choose another port (0 picks a free one) or stop what holds it"
        if port
        else "is the host one of this machine's addresses?"
    )
    return OSError(f"cannot listen on {host}:{port} for {what}: {why.lower()}; {hint}")


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A bound, listening TCP socket, or bind_error's one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise bind_error(host, port, what) from None
    return sock


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """The address others should dial: explicit, else the bind host, else (all interfaces) the hostname."""
    if advertise:
        return advertise
    return socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host


def write_ready_file(path: Path, info: dict[str, Any], indent: int | None = None) -> None:
    """Atomically write the JSON a launcher waits for."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info, indent=indent))
    os.replace(tmp, path)


def announce(address: str, ready_file: Path | None, ready_info: dict[str, Any] | None) -> None:
    """Tell launchers a service is serving: a JSON line on stdout and, when asked, a ready file."""
    info = {"address": address, "pid": os.getpid(), **(ready_info or {})}
    print(json.dumps({"event": "serving", **info}), flush=True)
    if ready_file is not None:
        write_ready_file(ready_file, info)


async def wait_for_signal() -> None:
    """Return on SIGTERM / SIGINT (each is then consumed here, not by the default handler)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class App(Protocol):
    """The shape of every service: `await X.create(settings)`, then these."""

    async def start(self) -> str: ...
    async def wait(self) -> None: ...
    async def stop(self, grace_s: float | None = None) -> None: ...
    def ready_info(self) -> dict[str, Any]: ...


async def serve_app(app: App, ready_file: Path | None = None) -> None:
    """A service's whole life after create(): start, announce, wait for SIGTERM/SIGINT, stop
    gracefully (stop also runs when start fails half-way).

    create() loaded the model on this thread; from here a compute thread does the parallel torch
    work, so this one's OpenMP workers end (runtime.release_openmp_threads; nothing to end in a
    process without torch). What create() built lives as long as the process: runtime.freeze_heap
    keeps the collector from walking it again."""
    runtime.freeze_heap()
    runtime.release_openmp_threads(serial=True)
    try:
        address = await app.start()
        announce(address, ready_file, app.ready_info())
        await app.wait()
        print(json.dumps({"event": "stopping", "address": address}), flush=True)
    finally:
        await app.stop()
