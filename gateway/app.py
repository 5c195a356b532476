"""Wire a gateway process: tokenizer + router clients -> core -> gRPC servicer and HTTP app -> servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health_pb2

from common.errors import InvalidArgumentError, MoeMeshError, UnavailableError
from common.registry import ROUTER_SERVICE, Instance, Membership, Registry, open_registry
from common.registry.follow import Follower, follow
from common.server import Deadline, GrpcServer, Service, listen_socket, wait_for_signal
from common.telemetry import Telemetry
from common.tls import MeshTls, public_server_credentials
from common.tokenizer import NoTokenizer, Tokenizer
from gateway.auth import ApiKeys
from gateway.core import GatewayCore
from gateway.exposure import exposure_warning
from gateway.grpc_api import InferenceServicer
from gateway.http_api import create_app
from gateway.readiness import Readiness
from gateway.router_client import ModelInfo, RouterClient
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
# Past the grace period, how long the requests still running get to send their clients the error
# that ends them.
CUT_REPORT_S = 0.5


class _EmbeddedUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # common.server owns SIGTERM/SIGINT for the whole process


class GatewayApp:
    """A running gateway: `await GatewayApp.create(settings)`, `await start()`, `await stop()`."""

    def __init__(
        self,
        settings: GatewaySettings,
        core: GatewayCore,
        routers: list[RouterClient],
        telemetry: Telemetry,
        public_credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        """`public_credentials`: TLS of the public endpoints (settings.public_tls_files, checked)."""
        self.settings, self.core, self.routers, self.telemetry = settings, core, routers, telemetry
        public = settings.public_tls_files() if public_credentials else None
        self.grpc = GrpcServer(
            [
                Service(
                    SERVICE_NAME,
                    inference_pb2_grpc.add_InferenceServicer_to_server,
                    InferenceServicer(core),
                )
            ],
            host=settings.host,
            port=settings.grpc_port,
            # The public API's messages are small: its limit is the HTTP body's.
            max_message_bytes=settings.max_body_bytes,
            grace_s=settings.grace_s,
            interceptors=telemetry.server_interceptors(),
            credentials=public_credentials,
            reflection=settings.reflection,
            health_port=settings.health_port,
            ready=lambda: self.readiness.ready,
        )
        self.readiness = Readiness(self._report_ready)
        # Before HTTP starts: its /health/ready says what the gRPC health service already does.
        self.grpc.on_ready.append(lambda: self._report_ready(self.readiness.ready))
        self.grpc.on_ready.append(self._start_http)
        self.grpc.on_stop.append(self._drain)
        # timeout_graceful_shutdown is set when stopping, to what the stop's deadline leaves.
        self.http = _EmbeddedUvicorn(
            uvicorn.Config(
                create_app(core, telemetry.registry),
                host=settings.host,
                port=settings.http_port,
                log_level="warning",
                lifespan="off",
                loop="none",
                ssl_certfile=public[0] if public else None,
                ssl_keyfile=public[1] if public else None,
            )
        )
        self._http_task: asyncio.Task | None = None
        self._follow_task: asyncio.Task | None = None
        self._registry: Registry | None = None  # closed by stop(), once its watch has stopped
        self._stopped = False

    @classmethod
    async def create(
        cls, settings: GatewaySettings, telemetry: Telemetry | None = None
    ) -> GatewayApp:
        """Telemetry comes from the settings unless given (tests pass in-memory exporters)."""
        telemetry = telemetry or Telemetry.from_settings(
            "gateway", settings, settings.host, collect_metrics=True
        )
        try:
            return await cls._create(settings, telemetry)
        except BaseException:
            telemetry.shutdown()
            raise

    @classmethod
    async def _create(cls, settings: GatewaySettings, telemetry: Telemetry) -> GatewayApp:
        # Files first: a bad key, certificate or checkpoint fails before any router is dialed.
        keys = ApiKeys.from_environment(settings.api_key_file)
        tls = MeshTls.from_settings(settings)
        public = settings.public_tls_files()
        credentials = public_server_credentials(*public) if public else None
        if warning := exposure_warning(settings.host, public is not None, keys.enabled):
            log.warning(warning)
        tokenizer = _tokenizer(settings)
        registry = open_registry(settings.registry, settings.registry_address, tls)
        if registry is not None:
            return await cls._create_following(
                settings, registry, telemetry, keys, tls, credentials, tokenizer
            )
        if not settings.routers:
            raise InvalidArgumentError(
                "routers",
                "give at least one router address, or a registry ('consul', 'kubernetes')",
            )
        routers = [
            RouterClient(a, settings.max_message_bytes, telemetry.client_interceptors(), tls)
            for a in settings.routers
        ]
        try:
            models = await asyncio.gather(*(_model(r, settings.connect_timeout_s) for r in routers))
        except UnavailableError:
            await asyncio.gather(*(r.close() for r in routers))
            raise
        ids = {m.id for m in models}
        if len(ids) != 1:
            raise UnavailableError(f"routers serve different models: {sorted(ids)}")
        core = GatewayCore(settings, tokenizer, routers, models[0], telemetry, keys)
        return cls(settings, core, routers, telemetry, credentials)

    @classmethod
    async def _create_following(
        cls,
        settings: GatewaySettings,
        registry: Registry,
        telemetry: Telemetry,
        keys: ApiKeys,
        tls: MeshTls | None,
        credentials: grpc.ServerCredentials | None,
        tokenizer: Tokenizer | NoTokenizer,
    ) -> GatewayApp:
        """Routers come and go with the registry; start once one is there and answers Status."""
        interceptors = telemetry.client_interceptors()

        def connect(inst: Instance) -> RouterClient:
            return RouterClient(inst.endpoint, settings.max_message_bytes, interceptors, tls)

        def leave(client: RouterClient) -> None:
            # Streams in flight keep the channel; close it once they have had time to end.
            loop = asyncio.get_running_loop()
            loop.call_later(settings.grace_s, lambda: asyncio.ensure_future(client.close()))

        routers: Follower[RouterClient] = Follower(connect, leave)
        watch = registry.watch(ROUTER_SERVICE)
        try:
            first = await asyncio.wait_for(_first_nonempty(watch), settings.connect_timeout_s)
        except TimeoutError:
            why = getattr(registry, "problem", None) or "none registered and passing"
            raise UnavailableError(
                f"no router in the registry after {settings.connect_timeout_s:g}s: {why}"
            ) from None
        routers.reconcile({i.id: i for i in first.instances})
        model = await next(iter(routers.clients.values())).model(settings.connect_timeout_s)
        clients = list(routers.clients.values())
        core = GatewayCore(settings, tokenizer, clients, model, telemetry, keys)
        app = cls(settings, core, clients, telemetry, credentials)

        def apply(m: Membership) -> None:
            if routers.reconcile(
                {i.id: i for i in m.instances if i.meta.get("model_id") == model.id}
            ):
                app.routers = list(routers.clients.values())
                app.core.set_routers(app.routers)
                app.readiness.follow(app.routers)

        app._follow_task = asyncio.create_task(follow(watch, apply), name="router-membership")
        app._registry = registry
        return app

    @property
    def http_address(self) -> str:
        port = self.http.servers[0].sockets[0].getsockname()[1] if self.http.servers else 0
        return f"{self.settings.host}:{port}"

    async def _start_http(self) -> None:
        # Bound here, not by uvicorn, which would log the failure and exit the process itself.
        sock = listen_socket(self.settings.host, self.settings.http_port, "HTTP")
        self._http_task = asyncio.create_task(self.http.serve([sock]), name="gateway-http")
        while not self.http.started:
            if self._http_task.done():
                self._http_task.result()  # raises the bind error
                raise OSError(
                    f"HTTP server on {self.settings.host}:{self.settings.http_port} did not start"
                )
            await asyncio.sleep(0.01)

    async def _drain(self, deadline: Deadline) -> None:
        """/health/ready answers 503 and new requests get 503 / UNAVAILABLE, while admitted ones (HTTP
        and gRPC) may finish until `deadline`. Those still running then are cut off: each ends with
        an UNAVAILABLE error its client can act on (an SSE error event, a gRPC status), given up to
        CUT_REPORT_S to be sent. Only then does HTTP stop listening (gRPC stops after this hook)."""
        self.core.draining = True
        self.http.config.app.state.ready = False
        if not await self._idle_by(deadline):
            self.core.cut_off(
                "the gateway is shutting down and its grace period ran out before this request "
                "finished; retry on another replica"
            )
            deadline = Deadline.after(CUT_REPORT_S)
            await self._idle_by(deadline)
        if self._http_task is not None:
            # uvicorn closes idle connections at once and gives the others what is left (at least a
            # moment: at 0 it would cancel them without looking, and log that it did).
            self.http.config.timeout_graceful_shutdown = max(0.1, deadline.remaining())
            self.http.should_exit = True
            await self._http_task

    async def _idle_by(self, deadline: Deadline) -> bool:
        """Whether every admitted or queued request finished by `deadline`."""
        while self.core.admission.in_flight + self.core.admission.queued:
            if not deadline.remaining():
                return False
            await asyncio.sleep(min(0.05, deadline.remaining()))
        return True

    async def start(self) -> str:
        """Serve, once every router has said whether it serves every expert (or
        connect_timeout_s passed): the readiness announced is already the truth."""
        self.readiness.follow(self.routers)
        if not await self.readiness.heard(self.settings.connect_timeout_s):
            log.warning("starting not ready: %s", self.readiness.why())
        return await self.grpc.start()

    async def _report_ready(self, ready: bool) -> None:
        """HTTP /health/ready and the gRPC health service ("" and Inference) say `ready` together.
        Requests are not refused meanwhile: a router waits a while for a missing expert's replica
        (missing_expert_wait_s) before it fails the calls that need it."""
        self.http.config.app.state.ready = ready and not self.core.draining
        status = health_pb2.HealthCheckResponse.SERVING if ready else NOT_SERVING
        for name in ("", SERVICE_NAME):  # ignored once the server is shutting down
            await self.grpc.health.set(name, status)

    async def wait(self) -> None:
        """Until SIGTERM / SIGINT."""
        await wait_for_signal()

    def ready_info(self) -> dict[str, Any]:
        """After start(): the HTTP address is known once uvicorn has bound."""
        return {
            "service": "gateway",
            "http_address": self.http_address,
            "metrics": self.telemetry.metrics_address,
        }

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain HTTP and gRPC, both within grace_s (default the setting) from now, cutting off what
        is left then, and close the routers."""
        if self._stopped:
            return
        self._stopped = True
        await self.grpc.stop(self.grpc.deadline(grace_s))
        await self.readiness.close()
        if self._follow_task is not None:
            self._follow_task.cancel()
            await asyncio.gather(self._follow_task, return_exceptions=True)
        if self._registry is not None:  # after its watch stopped: nothing reopens a session
            await self._registry.close()
        await self.core.balancer.close()  # its checks use the channels closed next
        await asyncio.gather(*(r.close() for r in self.routers))
        self.telemetry.shutdown()


def _tokenizer(settings: GatewaySettings) -> Tokenizer | NoTokenizer:
    return NoTokenizer() if settings.skip_tokenizer_init else Tokenizer(settings.checkpoint)


async def _model(router: RouterClient, timeout_s: float) -> ModelInfo:
    try:
        return await router.model(timeout_s)
    except MoeMeshError as e:  # an operator's message at start-up: name the router
        raise UnavailableError(
            f"router {router.address} not reachable within {timeout_s}s: {e}"
        ) from e


async def _first_nonempty(watch) -> Membership:
    async for m in watch:
        if m.instances:
            return m
    raise UnavailableError("registry watch ended")
