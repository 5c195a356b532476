"""The mesh discovered the way it is on a cluster without Consul: expert services, a router and a
gateway, each its own process with `--registry kubernetes`, find each other through the
EndpointSlices of a fake API server (tests/support/fake_kubernetes.py). The test plays the
EndpointSlice controller: it adds each process's endpoint once the process is up, as readiness
would, and takes a replica out of its slice, as scaling down would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx

from common.registry import EXPERT_SERVICE, ROUTER_SERVICE
from moe_mesh.local.processes import ServiceProcess, start_experts, stop_all
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from tests.support.fake_kubernetes import TOKEN, FakeKubernetes
from tests.support.polling import calls, eventually
from tests.support.reference import PROMPTS, monolithic

NS = "serving"
PART_OF = {"app.kubernetes.io/part-of": "moe-mesh"}


def service_account(tmp_path: Path) -> dict[str, str]:
    """The directory kubelet mounts (token, namespace), and the env that points the services at it."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "namespace").write_text(NS)
    return {"MOE_MESH_K8S_SERVICE_ACCOUNT_DIR": str(account)}


async def publish(fake: FakeKubernetes, service: str, label: str, pod: str, address: str) -> None:
    host, port = address.rsplit(":", 1)
    labels = {**PART_OF, "moe-mesh.io/service": label}
    await fake.set_endpoint(NS, service, labels, pod, host, int(port))


async def backends(router: str) -> set[str]:
    async with grpc.aio.insecure_channel(router) as channel:
        status = await router_pb2_grpc.RouterServiceStub(channel).Status(
            router_pb2.RouterStatusRequest(), timeout=5
        )
    return {p.backend for p in status.placement}


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = await http.post("/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def test_a_mesh_discovered_through_endpointslices_serves_and_drops_a_removed_replica(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    expected = monolithic(path)
    fake = FakeKubernetes()
    url = await fake.start()
    env = service_account(tmp_path)
    flags = ("--registry", "kubernetes", "--registry-address", url)
    procs: list[ServiceProcess] = []
    try:
        # Two replicas of experts 4-7: one is taken out of its slice below.
        experts = await asyncio.to_thread(
            start_experts, path, ["*:0-3", "*:4-7", "*:4-7"], tmp_path, *flags, env=env
        )
        procs += experts
        for i, (group, e) in enumerate(zip(["a", "b", "b"], experts)):
            await publish(fake, f"experts-{group}", EXPERT_SERVICE, f"expert-{i}", e.address)
        router = ServiceProcess(
            "router_service",
            ["--checkpoint", str(path), "--compute-threads", "1", *flags],
            tmp_path,
            "router",
            env,
        )
        procs.append(router)
        await asyncio.to_thread(router.wait_ready, 120)
        await publish(fake, "routers", ROUTER_SERVICE, "router-0", router.address)
        gateway = ServiceProcess(
            "gateway", ["--checkpoint", str(path), *flags], tmp_path, "gateway", env
        )
        procs.append(gateway)
        await asyncio.to_thread(gateway.wait_ready, 60)
        assert await backends(router.address) == {e.address for e in experts}

        async with httpx.AsyncClient(base_url=f"http://{gateway.ready['http_address']}") as http:
            for prompt, want in zip(PROMPTS, expected):
                got = await complete(http, prompt)
                assert got and tuple(got) == want[: len(got)], (prompt, got, want)
            # Every replica took calls, the one removed below too (the router spreads 4-7 over two).
            assert all([await calls(e.address) > 0 for e in experts])

            # Scaled down: its Pod leaves the slice. The router stops calling it; tokens hold.
            removed = experts[2]
            await fake.remove_endpoint(NS, "experts-b", "expert-2")
            await eventually(
                lambda: _without(router.address, removed.address),
                what="the router to drop the removed replica",
            )
            await asyncio.sleep(1.5)  # calls in flight to it may still answer (LEAVE_DRAIN_S)
            before = await calls(removed.address)
            for prompt, want in zip(PROMPTS, expected):
                got = await complete(http, prompt)
                assert got and tuple(got) == want[: len(got)], (prompt, got, want)
            assert await calls(removed.address) == before  # alive, but no longer chosen
        assert fake.lists >= 2 and fake.watches >= 2  # router and gateway listed, then watched
    finally:
        await asyncio.to_thread(stop_all, procs)
        await fake.stop()


async def _without(router: str, address: str) -> bool:
    return address not in await backends(router)
