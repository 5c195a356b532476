"""Mutual TLS inside the mesh, against real services on loopback: a router and an expert service
serve only callers holding a certificate of the mesh CA, over gRPC and over the UCX fast path,
where an unproven hello is dropped and the router's call falls back to gRPC (which its certificate
opens). Reflection is off on both unless asked."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.fastpath import parse_worker_url
from common.fastpath.auth import HelloSigner
from common.fastpath.client import FastPathError, FrameClient
from common.fastpath.frame import RequestHeader
from common.fastpath.ucx import load_ucxx
from common.tls import MeshTls, open_channel
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from moe_mesh.local import certs
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from router_service.app import RouterApp
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.remote import Identity, RemoteExperts
from router_service.settings import RouterSettings
from tests.support.certs import tls_flags
from tests.support.metrics import scrape, total

HIDDEN = 64


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[Path, Path]:
    """The mesh's certificates, and another CA's."""
    mesh, other = tmp_path_factory.mktemp("mesh-certs"), tmp_path_factory.mktemp("other-certs")
    certs.create(mesh, ["router", "expert", "client"])
    certs.create(other, ["client"])
    return mesh, other


@asynccontextmanager
async def expert(checkpoint, pki, **overrides) -> AsyncIterator[ExpertApp]:
    settings = ExpertSettings(
        checkpoint=checkpoint("mixtral"),
        experts="0-1:0-3",
        grace_s=0.5,
        **tls_flags(pki[0], "expert"),
        **overrides,
    )
    app = await ExpertApp.create(settings)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


def callers(pki) -> dict[str, MeshTls | None | str]:
    """Every kind of caller that must be refused: plaintext, TLS without a certificate, and a
    certificate of another CA (which also does not trust the mesh's server certificate: it is
    given the mesh CA to check the server with, so only its own certificate is wrong)."""
    mesh, other = pki
    stranger = certs.mesh_tls(other, "client")
    return {
        "plaintext": None,
        "no certificate": MeshTls.ca_only(mesh / certs.CA_FILE),
        "another CA": MeshTls(stranger.cert, stranger.key, (mesh / certs.CA_FILE).read_bytes()),
    }


async def health(address: str, tls: MeshTls | None) -> int:
    async with open_channel(address, [], tls=tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=3
        )
        return reply.status


async def test_an_expert_service_serves_only_callers_of_the_mesh_ca(checkpoint, pki) -> None:
    async with expert(checkpoint, pki) as app:
        assert await health(app.address, certs.mesh_tls(pki[0], "client")) == 1  # SERVING
        for name, tls in callers(pki).items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health(app.address, tls)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert app._instance().tls  # registered with a TLS health check


async def test_a_router_serves_only_callers_of_the_mesh_ca_and_lists_no_methods(
    checkpoint, pki
) -> None:
    settings = RouterSettings(checkpoint=checkpoint("mixtral"), **tls_flags(pki[0], "router"))
    app = await RouterApp.create(settings)
    await app.start()
    try:
        async with open_channel(app.server.address, [], tls=certs.mesh_tls(pki[0], "client")) as ch:
            status = await router_pb2_grpc.RouterServiceStub(ch).Status(
                router_pb2.RouterStatusRequest(), timeout=5
            )
            assert status.model_id
            # Reflection is off: nothing tells a caller which methods exist.
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.ServerReflectionInfo(iter([request]), timeout=3):
                    pass
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for name, tls in callers(pki).items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health(app.server.address, tls)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
    finally:
        await app.stop()


@pytest.mark.skipif(load_ucxx(loopback=True) is None, reason="ucxx cannot be imported")
async def test_the_fast_path_drops_unproven_hellos_and_the_router_falls_back_to_grpc(
    checkpoint, pki
) -> None:
    mesh, other = pki
    async with expert(checkpoint, pki, metrics_port=0) as app:
        server = app.fast_path.server
        target = parse_worker_url(app.fast_paths)
        header = RequestHeader(
            model_id=app.host.model_id,
            weights_checksum=app.host.weights_checksum,
            layer=1,
            expert_ids=[0],
            token_counts=[2],
            dtype="float32",
            shape=[2, HIDDEN],
            payload_bytes=2 * HIDDEN * 4,
        )
        hidden = torch.randn(2, HIDDEN)
        strangers = [None, HelloSigner.from_tls(certs.mesh_tls(other, "client"))]
        for signer in strangers:
            client = FrameClient(target, 2**24, signer=signer)
            try:
                with pytest.raises(FastPathError):
                    await client.call(header, hidden, 1.0)
            finally:
                client.close()
        assert server.refused == 2 and server.frames == 0 and not server.clients
        assert total(scrape(app.telemetry), "moe_expert_fast_path_hellos_refused_total") == 2

        identity = Identity(app.host.model_id, app.host.weights_checksum)
        router_tls = certs.mesh_tls(mesh, "router")

        def backend(signer: HelloSigner | None, timeout_s: float) -> RemoteExperts:
            config = FastPathConfig(mode="ucx", timeout_s=timeout_s, signer=signer)
            return RemoteExperts(
                app.address,
                identity,
                2**24,
                fast_path=config,
                fast_paths=app.fast_paths,
                tls=router_tls,
            )

        groups = [(0, torch.randn(3, HIDDEN)), (2, torch.randn(1, HIDDEN))]
        # The proven one has 10 s: its first call timed out at 0.5 s on a loaded fresh clone.
        unproven, proven = backend(None, 0.5), backend(HelloSigner.from_tls(router_tls), 10.0)
        try:
            began = time.monotonic()
            fell_back = await unproven.forward(1, groups, 10.0)
            assert fell_back.transport == "grpc" and unproven.fast_path.fallbacks
            assert time.monotonic() - began < 5
            fast = await proven.forward(1, groups, 10.0)
            assert fast.transport == "ucx" and not proven.fast_path.fallbacks
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fast, fell_back))
            assert server.frames == 1 and server.refused >= 3
        finally:
            await unproven.close()
            await proven.close()
