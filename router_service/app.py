"""Wire a router process together: engine (with expert placement) -> core -> servicer -> server."""

from __future__ import annotations

import asyncio

from common.server import GrpcServer, Service
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from router_service.build import build_mesh_engine, default_model_id
from router_service.core import RouterCore
from router_service.servicer import RouterServicer
from router_service.settings import RouterSettings

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


class RouterApp:
    """A running router: `await RouterApp.create(settings)`, `await app.start()`, `await app.stop()`."""

    def __init__(self, settings: RouterSettings, core: RouterCore, remotes: list) -> None:
        self.settings, self.core, self.remotes = settings, core, remotes
        self.server = GrpcServer([Service(SERVICE_NAME, router_pb2_grpc.add_RouterServiceServicer_to_server,
                                          RouterServicer(core))],
                                 host=settings.host, port=settings.port,
                                 max_message_bytes=settings.max_message_bytes, grace_s=settings.grace_s)

    @classmethod
    async def create(cls, settings: RouterSettings) -> RouterApp:
        engine, remotes = await build_mesh_engine(settings)
        model_id = settings.model_id or default_model_id(settings.checkpoint)
        return cls(settings, RouterCore(engine, model_id), remotes)

    async def start(self) -> str:
        self.core.start()
        return await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
        await self.core.stop()
        await asyncio.gather(*(r.close() for r in self.remotes))
