"""The meta Kubernetes discovery asks of each endpoint (common/registry/k8s_meta.py) is what the
service registers with Consul: an expert service's Describe gives the same experts, model id,
weights checksum, region, precision and fast path as its registration, a router's Status its
model id; under mutual TLS with the mesh's certificate, and never without one. An expert service
told `--registry kubernetes` with no API server to find says so before it loads any weight."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from common.errors import InvalidArgumentError
from common.registry import EXPERT_SERVICE, ROUTER_SERVICE
from common.registry.k8s_meta import grpc_describer
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from moe_mesh.local import certs
from router_service.app import RouterApp
from router_service.settings import RouterSettings
from tests.support.certs import tls_flags


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    mesh = tmp_path_factory.mktemp("mesh-certs")
    certs.create(mesh, ["router", "expert"])
    return mesh


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
async def test_an_expert_service_describes_itself_as_it_registers(checkpoint, pki, tls) -> None:
    settings = ExpertSettings(
        checkpoint=checkpoint("mixtral"),
        experts="0:0-3; 1:5",
        region="eu-west",
        grace_s=0.5,
        **(tls_flags(pki, "expert") if tls else {}),
    )
    app = await ExpertApp.create(settings)
    await app.start()
    try:
        mesh_tls = certs.mesh_tls(pki, "router") if tls else None
        meta = await grpc_describer(mesh_tls)(EXPERT_SERVICE, app.address)
        registered = dict(app._instance().meta)  # what Consul would carry
        assert meta == registered
        assert meta["experts"] == "0:0-3; 1:5" and meta["region"] == "eu-west"
        if tls:
            with pytest.raises(grpc.aio.AioRpcError):  # no certificate: refused, the caller retries
                await grpc_describer(None, timeout_s=2.0)(EXPERT_SERVICE, app.address)
    finally:
        await app.stop()


async def test_a_router_gives_its_model_id_and_other_services_nothing(checkpoint) -> None:
    app = await RouterApp.create(RouterSettings(checkpoint=checkpoint("mixtral"), grace_s=0.5))
    await app.start()
    try:
        describe = grpc_describer()
        assert await describe(ROUTER_SERVICE, app.server.address) == {"model_id": app.core.model_id}
        assert await describe("something-else", app.server.address) == {}
    finally:
        await app.stop()


async def test_an_expert_service_without_an_api_server_fails_before_loading_weights(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # No checkpoint there: loading it would fail otherwise (CheckpointError), so this comes first.
    settings = ExpertSettings(checkpoint=tmp_path / "absent", experts="*:*", registry="kubernetes")
    with pytest.raises(InvalidArgumentError, match="registry_address: no Kubernetes API server"):
        await ExpertApp.create(settings)
