"""Wiring of one expert service: settings -> ExpertHost -> servicer -> GrpcServer, and its lifetime."""

from __future__ import annotations

from pathlib import Path

from moe_mesh.common.placement import format_experts
from moe_mesh.common.registry import EXPERT_SERVICE, Instance, open_registry, registration_hooks
from moe_mesh.common.server import GrpcServer, Service, advertised_host, serve_until_signal
from moe_mesh.common.telemetry import Telemetry
from moe_mesh.expert_service.core import ExpertHost
from moe_mesh.expert_service.servicer import ExpertServicer
from moe_mesh.expert_service.settings import ExpertSettings
from moe_mesh.protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc

SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name[
    "ExpertService"
].full_name  # moe_mesh.v1.ExpertService


def build_server(
    settings: ExpertSettings, telemetry: Telemetry | None = None
) -> tuple[GrpcServer, ExpertHost]:
    """Load the configured experts and build (not start) their server; used by __main__ and by tests.

    Telemetry comes from the settings unless given (tests pass one with an in-memory exporter); it is
    shut down with the server."""
    telemetry = telemetry or Telemetry.from_settings("expert", settings, settings.host)
    host = ExpertHost(settings, telemetry)
    service = Service(
        SERVICE_NAME,
        expert_pb2_grpc.add_ExpertServiceServicer_to_server,
        ExpertServicer(host, telemetry),
    )
    server = GrpcServer(
        services=[service],
        host=settings.host,
        port=settings.port,
        max_message_bytes=settings.max_message_bytes,
        grace_s=settings.grace_s,
        interceptors=telemetry.server_interceptors(),
    )

    def instance() -> Instance:
        address = advertised_host(settings.host, settings.advertise_host)
        return Instance(
            EXPERT_SERVICE,
            f"expert-{address}-{server.bound_port}",
            address,
            server.bound_port,
            tags=("moe-mesh", f"model:{host.model_id}"),
            meta={
                "model_id": host.model_id,
                "weights_checksum": host.weights_checksum,
                "experts": format_experts(host.experts),
                "region": settings.region,
                "dtype": settings.dtype,
                "fast_path": "",
            },
        )

    registration_hooks(
        server, open_registry(settings.registry, settings.registry_address), instance
    )
    return server, host


async def serve(server: GrpcServer, host: ExpertHost, ready_file: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT, drain in-flight calls, then stop the batcher."""
    ready_info = {
        "service": SERVICE_NAME,
        "model_id": host.model_id,
        "weights_checksum": host.weights_checksum,
        "experts": format_experts(host.experts),
        "metrics": host.telemetry.metrics_address,
    }
    try:
        await serve_until_signal(server, ready_file, ready_info)
    finally:
        await server.stop()  # no-op after a normal stop; stops a half-started server on errors
        # Only now: on_stop hooks run before the drain, and draining calls still need the batcher.
        await host.close()
        host.telemetry.shutdown()
