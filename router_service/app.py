"""Wire a router process together: engine (with expert placement) -> core -> servicer -> server."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpc_health.v1 import health_pb2

from common.registry import ROUTER_SERVICE, Instance, open_registry, registration_hooks
from common.server import GrpcServer, Service, advertised_host, wait_for_signal
from common.status import EXPERTS_HEALTH
from common.telemetry import Telemetry
from common.tls import MeshTls
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from router_service.build import RouterParts, build_router, default_model_id
from router_service.core import RouterCore
from router_service.servicer import RouterServicer
from router_service.settings import RouterSettings

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
log = logging.getLogger(__name__)


class RouterApp:
    """A running router: `await RouterApp.create(settings)`, `await app.start()`, `await app.stop()`."""

    def __init__(
        self,
        settings: RouterSettings,
        parts: RouterParts,
        model_id: str,
        telemetry: Telemetry,
    ) -> None:
        self.settings, self.parts, self.telemetry = settings, parts, telemetry
        self.membership = parts.membership
        core = self.core = RouterCore(
            parts.engine,
            model_id,
            parts.tierer,
            parts.membership,
            telemetry,
            on_unhealthy=self._not_serving,
            max_loop_deaths=settings.max_loop_deaths,
            loop_death_window_s=settings.loop_death_window_s,
        )
        self._tiering: asyncio.Task | None = None
        self.server = GrpcServer(
            [
                Service(
                    SERVICE_NAME,
                    router_pb2_grpc.add_RouterServiceServicer_to_server,
                    RouterServicer(core, telemetry),
                )
            ],
            host=settings.host,
            port=settings.port,
            max_message_bytes=settings.max_message_bytes,
            grace_s=settings.grace_s,
            interceptors=telemetry.server_interceptors(),
            credentials=parts.tls.server_credentials() if parts.tls else None,
            reflection=settings.reflection,
            health_port=settings.health_port,
        )

        def instance() -> Instance:
            address = advertised_host(settings.host, settings.advertise_host)
            return Instance(
                ROUTER_SERVICE,
                f"router-{address}-{self.server.bound_port}",
                address,
                self.server.bound_port,
                tags=("moe-mesh",),
                meta={"model_id": core.model_id},
                tls=parts.tls is not None,
            )

        registration_hooks(
            self.server, open_registry(settings.registry, settings.registry_address), instance
        )
        self._every_expert = [
            (layer, e)
            for layer in parts.engine.model.spec.moe_layer_ids
            for e in range(parts.engine.model.spec.num_experts)
        ]
        self._reports: set[asyncio.Task] = set()  # coverage reports under way (held: not collected)
        parts.tierer.placement.listeners.append(self._coverage_changed)

    def missing_experts(self) -> list[tuple[int, int]]:
        """The (layer, expert) pairs no replica serves now (colocated or remote)."""
        return self.parts.tierer.placement.missing(self._every_expert)

    async def _report_coverage(self) -> None:
        """EXPERTS_HEALTH as the placement is when this runs (not when it was asked for), so reports
        that overtake each other still leave the latest truth. Ignored once the server stops."""
        status = health_pb2.HealthCheckResponse
        serving = status.NOT_SERVING if self.missing_experts() else status.SERVING
        await self.server.health.set(EXPERTS_HEALTH, serving)

    def _coverage_changed(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # changed outside the event loop: start() reports it
            return
        task = loop.create_task(self._report_coverage())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _not_serving(self, reason: str) -> None:
        """The engine loop gave up: every health service NOT_SERVING (for good), so registries and
        balancers drop this router while it keeps answering with UNAVAILABLE."""
        log.error("router NOT_SERVING: %s", reason)
        await self.server.health.enter_graceful_shutdown()

    @classmethod
    async def create(
        cls, settings: RouterSettings, telemetry: Telemetry | None = None
    ) -> RouterApp:
        """Telemetry comes from the settings unless given (tests pass in-memory exporters)."""
        model_id = settings.model_id or default_model_id(settings.checkpoint)
        telemetry = telemetry or Telemetry.from_settings("router", settings, settings.host)
        try:
            # The mesh identity too: Kubernetes discovery describes expert services with it.
            tls = MeshTls.from_settings(settings) if settings.registry == "kubernetes" else None
            registry = open_registry(settings.registry, settings.registry_address, tls)
            parts = await build_router(settings, registry, telemetry)
        except BaseException:
            telemetry.shutdown()
            raise
        return cls(settings, parts, model_id, telemetry)

    def start_core(self) -> None:
        """Step the engine and, with a colocation budget, re-tier experts as utilization moves."""
        self.core.start()
        if self.parts.tierer.config.budget_bytes > 0:
            self._tiering = asyncio.create_task(self.parts.tierer.run(), name="router-tiering")

    async def start(self) -> str:
        # The core first: it keeps stepping while the server drains in-flight streams on stop.
        self.start_core()
        # Before the server answers: a gateway's first look at this router already tells the truth.
        await self._report_coverage()
        return await self.server.start()

    async def wait(self) -> None:
        """Until SIGTERM / SIGINT."""
        await wait_for_signal()

    def ready_info(self) -> dict[str, Any]:
        return {"service": "router", "metrics": self.telemetry.metrics_address}

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, deregister, drain streams, the three within grace_s (default the setting)
        from now, then the engine loop, membership and expert channels."""
        await self.server.stop(self.server.deadline(grace_s))
        if self._tiering is not None:
            self._tiering.cancel()
            await asyncio.gather(self._tiering, return_exceptions=True)
        await self.core.stop()
        self.core.engine.model.close()
        await self.core.engine.model.dispatcher.close()  # its checks use the channels closed next
        if self.membership is not None:
            await self.membership.stop()
        await asyncio.gather(*(r.close() for r in self.parts.remotes))
        self.telemetry.shutdown()
