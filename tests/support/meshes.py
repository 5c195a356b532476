"""In-process meshes for gateway tests: a real router gRPC server and a real gateway (gRPC + HTTP), port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from router_service.app import RouterApp
from router_service.settings import RouterSettings


@dataclass
class LocalMesh:
    router: RouterApp
    gateway: GatewayApp

    @property
    def grpc_address(self) -> str:
        return self.gateway.grpc.address

    @property
    def http_base_url(self) -> str:
        scheme = "https" if self.gateway.settings.public_tls_files() else "http"
        return f"{scheme}://{self.gateway.http_address}"


@asynccontextmanager
async def local_mesh(
    checkpoint: Path, router: dict | None = None, **gateway: object
) -> AsyncIterator[LocalMesh]:
    """Router (all experts colocated) + gateway, both serving on loopback in this event loop."""
    r = await RouterApp.create(RouterSettings(checkpoint=checkpoint, **(router or {})))
    await r.start()
    try:
        g = await GatewayApp.create(
            GatewaySettings(checkpoint=checkpoint, routers=[r.server.address], **gateway)
        )
        await g.start()
        try:
            yield LocalMesh(r, g)
        finally:
            await g.stop()
    finally:
        await r.stop()
