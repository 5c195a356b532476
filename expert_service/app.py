"""Wiring of one expert service: settings -> ExpertHost -> servicer + fast path -> GrpcServer, and its
lifetime: `await ExpertApp.create(settings)`, `await app.start()`, `await app.wait()`, `await app.stop()`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from common.fastpath.auth import HelloVerifier
from common.placement import format_experts
from common.registry import EXPERT_SERVICE, Instance, open_registry, registration_hooks
from common.server import GrpcServer, Service, advertised_host, wait_for_signal
from common.telemetry import Telemetry
from common.tls import MeshTls
from expert_service.core import ExpertHost
from expert_service.drain import quiet_hook
from expert_service.fastpath import FastPath
from expert_service.servicer import ExpertServicer
from expert_service.settings import ExpertSettings
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name[
    "ExpertService"
].full_name  # moe_mesh.v1.ExpertService


class ExpertApp:
    """A running expert service: gRPC server and, when on, the UCX fast path, over one ExpertHost."""

    def __init__(
        self,
        settings: ExpertSettings,
        host: ExpertHost,
        telemetry: Telemetry,
        tls: MeshTls | None = None,
    ) -> None:
        self.settings, self.host, self.telemetry = settings, host, telemetry
        self.fast_path = FastPath(host, HelloVerifier(tls) if tls else None)
        self.fast_paths: list[str] = []  # advertised once started: ["ucx-worker:<address>"]
        self.server = GrpcServer(
            services=[
                Service(
                    SERVICE_NAME,
                    expert_pb2_grpc.add_ExpertServiceServicer_to_server,
                    ExpertServicer(
                        host, telemetry, lambda: self.fast_paths, settings.max_message_bytes
                    ),
                )
            ],
            host=settings.host,
            port=settings.port,
            max_message_bytes=settings.max_message_bytes,
            grace_s=settings.grace_s,
            interceptors=telemetry.server_interceptors(),
            credentials=tls.server_credentials() if tls else None,
            reflection=settings.reflection,
            health_port=settings.health_port,
        )
        self.tls = tls is not None
        registration_hooks(
            self.server, open_registry(settings.registry, settings.registry_address), self._instance
        )
        if settings.registry != "none":  # routers that follow a registry stop choosing it
            self.server.on_stop.append(
                quiet_hook(lambda: host.forward_calls, settings.drain_quiet_s)
            )
        self._reports: set[asyncio.Task[None]] = set()
        host.on_down.append(self._not_serving)

    def _not_serving(self, reason: str) -> None:
        """The device failed: every health service NOT_SERVING for good (liveness included, so an
        orchestrator restarts the process), while calls are answered UNAVAILABLE."""
        log.error("expert service NOT_SERVING: %s", reason)
        task = asyncio.get_running_loop().create_task(self.server.health.enter_graceful_shutdown())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    @classmethod
    async def create(
        cls, settings: ExpertSettings, telemetry: Telemetry | None = None
    ) -> ExpertApp:
        """Load the configured experts. Telemetry comes from the settings unless given (tests pass one
        with an in-memory exporter); it is shut down by stop()."""
        tls = MeshTls.from_settings(settings)  # before loading weights: a bad file fails fast
        open_registry(settings.registry, settings.registry_address)  # so does a bad address
        telemetry = telemetry or Telemetry.from_settings("expert", settings, settings.host)
        try:
            host = ExpertHost.load(settings, telemetry)
        except BaseException:
            telemetry.shutdown()
            raise
        return cls(settings, host, telemetry, tls)

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> str:
        """The fast path first, so the registration (on gRPC start) advertises it."""
        self.fast_paths = await self.fast_path.start()
        try:
            return await self.server.start()
        except BaseException:
            await self.fast_path.stop()
            raise

    async def wait(self) -> None:
        """Until SIGTERM / SIGINT."""
        await wait_for_signal()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, deregister, accept calls of both transports until none has arrived for
        drain_quiet_s (expert_service/drain.py), then drain gRPC calls (fast-path calls are still
        served meanwhile), then the fast path's calls in flight, all within grace_s (default the
        setting) from now; then the batcher."""
        deadline = self.server.deadline(grace_s)
        try:
            await self.server.stop(deadline)
            await self.fast_path.stop(deadline.remaining())
            # Only now: draining calls of both transports still need the batcher.
            await self.host.close()
        finally:
            self.telemetry.shutdown()

    def ready_info(self) -> dict[str, Any]:
        return {
            "service": SERVICE_NAME,
            "model_id": self.host.model_id,
            "weights_checksum": self.host.weights_checksum,
            "experts": format_experts(self.host.experts),
            "device": str(self.host.device),
            "metrics": self.telemetry.metrics_address,
            "fast_paths": self.fast_paths,
        }

    def _advertised(self) -> str:
        return advertised_host(self.settings.host, self.settings.advertise_host)

    def _instance(self) -> Instance:
        address, host = self._advertised(), self.host
        return Instance(
            EXPERT_SERVICE,
            f"expert-{address}-{self.server.bound_port}",
            address,
            self.server.bound_port,
            tags=("moe-mesh", f"model:{host.model_id}"),
            meta={
                "model_id": host.model_id,
                "weights_checksum": host.weights_checksum,
                "experts": format_experts(host.experts),
                "region": self.settings.region,
                "dtype": str(host.dtype).removeprefix("torch."),
                "precision": host.describe().precision,
                "device": str(host.device),
                "fast_path": self.fast_paths[0] if self.fast_paths else "",
                "max_message_bytes": str(self.settings.max_message_bytes),
            },
            tls=self.tls,
        )
