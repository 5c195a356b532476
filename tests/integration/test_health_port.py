"""`--health-port` on a real expert service under mutual TLS: a plaintext caller, as the kubelet's
gRPC probe is, gets the health statuses there (readiness and liveness) and nothing else, while the
service's own port still refuses it; the listener goes with the service."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server import LIVENESS
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from moe_mesh.local import certs
from tests.support.certs import tls_flags


async def _check(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return reply.status


async def test_a_tls_expert_service_answers_plaintext_health_checks_on_its_health_port(
    checkpoint, tmp_path
) -> None:
    certs.create(tmp_path, ["expert"])
    settings = ExpertSettings(
        checkpoint=checkpoint("mixtral"),
        experts="0-1:0-3",
        grace_s=0.5,
        health_port=0,
        **tls_flags(tmp_path, "expert"),
    )
    app = await ExpertApp.create(settings)
    await app.start()
    health = f"127.0.0.1:{app.server.bound_health_port}"
    try:
        for service in ("", LIVENESS):
            assert await _check(health, service) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):  # the service's own port wants a certificate
            await _check(f"127.0.0.1:{app.server.bound_port}")
    finally:
        await app.stop()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _check(health)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
