"""common/registry/kubernetes.py against the fake API server (tests/support/fake_kubernetes.py):
the first membership lists what is ready, the watch follows joins and leaves, an expired version
lists again, the service account's token is sent, and an API server that refuses or is gone
leaves the last membership stale with the reason in words."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.errors import InvalidArgumentError
from common.registry import EXPERT_SERVICE, Membership, open_registry
from common.registry.k8s_api import KubeConfig
from common.registry.kubernetes import KubernetesRegistry, ready_endpoints
from tests.support.fake_kubernetes import TOKEN, FakeKubernetes
from tests.support.net import bound_port

NS = "moe"
LABELS = {"app.kubernetes.io/part-of": "moe-mesh", "moe-mesh.io/service": EXPERT_SERVICE}
STEP_S = 10.0
GRPC = [{"name": "grpc", "port": 1, "protocol": "TCP"}]
K8S_VERSION = "1.37.0"  # as tests/unit/moe_mesh/planning/deploy/test_kubernetes.py


def account(tmp_path: Path, token: str = TOKEN) -> dict[str, str]:
    """A service account directory as kubelet mounts it; the env pointing at it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "namespace").write_text(NS)
    return {"MOE_MESH_K8S_SERVICE_ACCOUNT_DIR": str(tmp_path)}


async def describe(service: str, endpoint: str) -> dict[str, str]:
    return {"model_id": "m", "endpoint": endpoint}


def registry(url: str, tmp_path: Path, **kw) -> KubernetesRegistry:
    kw.setdefault("describe", describe)
    return KubernetesRegistry(
        url, env=account(tmp_path), backoff_initial_s=0.02, backoff_max_s=0.1, **kw
    )


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubernetes]:
    f = FakeKubernetes()
    await f.start()
    yield f
    await f.stop()


async def add(fake: FakeKubernetes, pod: str, port: int, ready: bool = True, **kw) -> None:
    await fake.set_endpoint(NS, "experts-a", LABELS, pod, "127.0.0.1", port, ready, **kw)


async def until(it: AsyncIterator[Membership], check) -> Membership:
    async with asyncio.timeout(STEP_S):
        while not check(m := await anext(it)):
            pass
    return m


def pods(m: Membership) -> set[str]:
    return {i.id.split("@")[0] for i in m.instances}


async def test_lists_ready_endpoints_with_their_meta_then_follows_joins_and_leaves(
    fake, tmp_path
) -> None:
    await add(fake, "pod-a", 5001)
    await add(fake, "pod-b", 5002, ready=False)  # not ready: not served
    await fake.set_endpoint(
        NS, "routers", {"moe-mesh.io/service": "moe-mesh-router"}, "r", "10.0.0.9", 1
    )
    reg = registry(fake.base_url, tmp_path)
    it = reg.watch(EXPERT_SERVICE)
    try:
        first = await anext(it)
        assert not first.stale and pods(first) == {"pod-a"}
        [a] = first.instances
        assert (a.host, a.port, a.service) == ("127.0.0.1", 5001, EXPERT_SERVICE)
        assert a.meta == {"model_id": "m", "endpoint": "127.0.0.1:5001"}  # asked of itself
        await add(fake, "pod-b", 5002)  # readiness passes
        assert pods(await until(it, lambda m: len(m.instances) == 2)) == {"pod-a", "pod-b"}
        await add(fake, "pod-a", 5001, ready=False, terminating=True)  # scaled down
        assert pods(await until(it, lambda m: len(m.instances) == 1)) == {"pod-b"}
        await fake.remove_endpoint(NS, "experts-a", "pod-b")
        assert pods(await until(it, lambda m: not m.instances)) == set()
        assert fake.lists == 1  # one list, then the watch carried every change
    finally:
        await it.aclose()
        await reg.close()


@pytest.mark.parametrize("http_gone", [False, True], ids=["error-event", "http-410"])
async def test_an_expired_version_lists_again_and_misses_nothing(fake, tmp_path, http_gone) -> None:
    fake.http_gone = http_gone
    await add(fake, "pod-a", 5001)
    reg = registry(fake.base_url, tmp_path, watch_timeout_s=1.0)  # streams end: resumes
    it = reg.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
        await asyncio.sleep(1.5)  # at least one stream ended and the watch resumed from its version
        assert fake.lists == 1 and fake.watches >= 2
        await add(fake, "pod-b", 5002)
        await fake.compact()  # the version the watch holds is gone now
        await add(fake, "pod-c", 5003)
        m = await until(it, lambda m: len(m.instances) == 3)
        assert pods(m) == {"pod-a", "pod-b", "pod-c"} and not m.stale
        assert fake.lists >= 2
    finally:
        await it.aclose()
        await reg.close()


async def test_bookmarks_move_the_watch_on_so_a_compaction_does_not_cost_a_list(
    fake, tmp_path
) -> None:
    """Changes of other services move the server's version on without an event for this watch;
    a bookmark carries the version to it, so resuming after a compaction needs no list."""
    await add(fake, "pod-a", 5001)
    reg = registry(fake.base_url, tmp_path, watch_timeout_s=1.0)
    it = reg.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
        await fake.set_endpoint(NS, "routers", {"moe-mesh.io/service": "r"}, "r", "10.0.0.9", 1)
        await fake.bookmark()
        await asyncio.sleep(0.2)  # delivered before the compaction, as a real server would have
        await fake.compact(before=fake.version)  # only the bookmark's version is still known
        await asyncio.sleep(1.5)  # the stream ended; the watch resumed from the bookmark
        await add(fake, "pod-b", 5002)
        assert pods(await until(it, lambda m: len(m.instances) == 2)) == {"pod-a", "pod-b"}
        assert fake.lists == 1 and fake.watches >= 2
    finally:
        await it.aclose()
        await reg.close()


async def test_the_service_account_token_is_sent_and_a_wrong_one_is_named(fake, tmp_path) -> None:
    await add(fake, "pod-a", 5001)
    good = registry(fake.base_url, tmp_path / "ok")
    it = good.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
    finally:
        await it.aclose()
        await good.close()
    bad = KubernetesRegistry(
        fake.base_url, env=account(tmp_path / "bad", "expired"), describe=describe
    )
    it = bad.watch(EXPERT_SERVICE)
    try:
        m = await anext(it)
        assert m.stale and not m.instances
        assert "401 Unauthorized" in bad.problem and str(tmp_path / "bad" / "token") in bad.problem
    finally:
        await it.aclose()
        await bad.close()


@pytest.mark.parametrize("verb", ["list", "watch"])
async def test_a_missing_rbac_permission_is_named(fake, tmp_path, verb) -> None:
    await add(fake, "pod-a", 5001)
    fake.forbidden = {verb}
    reg = registry(fake.base_url, tmp_path)
    it = reg.watch(EXPERT_SERVICE)
    try:
        m = await until(it, lambda m: m.stale)
        assert pods(m) == (set() if verb == "list" else {"pod-a"})  # the last known, stale
        assert f"forbids verb {verb!r} on resource 'endpointslices'" in reg.problem
        assert "403 Forbidden" in reg.problem and f"namespace {NS!r}" in reg.problem
        fake.forbidden = set()  # the Role is applied: it recovers by itself
        m = await until(it, lambda m: not m.stale)
        assert pods(m) == {"pod-a"} and reg.problem is None
    finally:
        await it.aclose()
        await reg.close()


async def test_an_unreachable_api_server_keeps_the_last_membership_stale(tmp_path) -> None:
    with bound_port() as closed:
        reg = registry(f"http://127.0.0.1:{closed}", tmp_path)
        it = reg.watch(EXPERT_SERVICE)
        try:
            m = await anext(it)
            assert m.stale and not m.instances
            assert f"Kubernetes API server http://127.0.0.1:{closed}" in reg.problem
        finally:
            await it.aclose()
            await reg.close()
    with bound_port(listen=True) as hung:  # accepts connections, never answers
        reg = registry(f"http://127.0.0.1:{hung}", tmp_path, request_timeout_s=0.5)
        it = reg.watch(EXPERT_SERVICE)
        try:
            async with asyncio.timeout(2.0):  # within the request timeout, not a TCP one
                assert (await anext(it)).stale
            assert "TimeoutError" in reg.problem
        finally:
            await it.aclose()
            await reg.close()
    fake = FakeKubernetes()
    await fake.start()
    await add(fake, "pod-a", 5001)
    reg = registry(fake.base_url, tmp_path, watch_timeout_s=1.0)
    it = reg.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
        await fake.stop()  # gone: the next resumed watch fails
        m = await until(it, lambda m: m.stale)
        assert pods(m) == {"pod-a"}  # still served from
    finally:
        await it.aclose()
        await reg.close()


async def test_an_object_not_of_the_api_shape_is_reported_not_fatal(fake, tmp_path) -> None:
    await add(fake, "pod-a", 5001)
    reg = registry(fake.base_url, tmp_path)
    it = reg.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
        broken = {"metadata": {"name": "bad", "namespace": NS, "labels": LABELS}}
        await fake.put_raw(NS, {**broken, "addressType": "IPv4", "endpoints": 5, "ports": GRPC})
        m = await until(it, lambda m: m.stale)
        assert pods(m) == {"pod-a"} and "malformed EndpointSlice" in reg.problem
        await fake.delete_slice(NS, "bad")  # fixed: the next list succeeds
        assert pods(await until(it, lambda m: not m.stale)) == {"pod-a"}
    finally:
        await it.aclose()
        await reg.close()


async def test_an_endpoint_that_does_not_answer_describe_yet_joins_once_it_does(
    fake, tmp_path
) -> None:
    answers = {"127.0.0.1:5002": 2}  # fails twice, then answers

    async def flaky(service: str, endpoint: str) -> dict[str, str]:
        if answers.get(endpoint, 0) > 0:
            answers[endpoint] -= 1
            raise ConnectionError("not yet")
        return {"model_id": "m"}

    await add(fake, "pod-a", 5001)
    await add(fake, "pod-b", 5002)
    reg = registry(fake.base_url, tmp_path, describe=flaky, describe_timeout_s=0.01)
    it = reg.watch(EXPERT_SERVICE)
    try:
        assert pods(await anext(it)) == {"pod-a"}
        assert pods(await until(it, lambda m: len(m.instances) == 2)) == {"pod-a", "pod-b"}
        assert answers["127.0.0.1:5002"] == 0
    finally:
        await it.aclose()
        await reg.close()


def test_ready_endpoints_follow_the_api_conventions() -> None:
    def slice_(endpoints, ports, kind="IPv4"):
        return {"addressType": kind, "endpoints": endpoints, "ports": ports}

    grpc_port = [{"name": "metrics", "port": 9}, {"name": "grpc", "port": 50051}]
    unknown = {"addresses": ["10.0.0.1", "10.0.0.2"], "targetRef": {"name": "p1"}}  # ready unset
    got = ready_endpoints(
        {
            "a": slice_(
                [unknown, {"addresses": ["10.0.0.3"], "conditions": {"ready": False}}], grpc_port
            ),
            "b": slice_(
                [{"addresses": ["fd00::1"], "conditions": {"ready": True}}], [{"port": 7}], "IPv6"
            ),
            "c": slice_([{"addresses": ["a.example"]}], [{"name": "grpc", "port": 1}], "FQDN"),
            "d": slice_([{"addresses": ["10.0.0.4"]}], [{"name": "http", "port": 1}, {"port": 2}]),
        }
    )
    assert {(e.name, e.address) for e in got} == {
        ("p1", "10.0.0.1:50051"),  # the first address, the port named grpc
        ("fd00::1", "[fd00::1]:7"),  # the only port; named by its address without a targetRef
    }


def test_in_cluster_defaults_and_a_missing_api_server_is_an_error_naming_the_field(
    tmp_path,
) -> None:
    env = {
        **account(tmp_path),
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    (tmp_path / "ca.crt").write_text("unused here")
    config = KubeConfig.from_env(None, env)
    assert (
        config.url()
        == "https://10.96.0.1:443/apis/discovery.k8s.io/v1/namespaces/moe/endpointslices"
    )
    assert config.headers() == {"Authorization": f"Bearer {TOKEN}"}
    assert config.ca_file == tmp_path / "ca.crt"
    assert KubeConfig.from_env(None, {**env, "MOE_MESH_K8S_NAMESPACE": "prod"}).namespace == "prod"
    proxy = KubeConfig.from_env(
        "http://127.0.0.1:8001", {"MOE_MESH_K8S_SERVICE_ACCOUNT_DIR": str(tmp_path / "no")}
    )
    assert (proxy.namespace, proxy.headers(), proxy.ca_file) == ("default", {}, None)
    with pytest.raises(InvalidArgumentError, match="registry_address: .*not http"):
        open_registry("kubernetes", "127.0.0.1:8001")


async def test_register_and_deregister_leave_it_to_kubernetes(fake, tmp_path) -> None:
    from common.registry import Instance

    reg = registry(fake.base_url, tmp_path)
    await reg.register(Instance(EXPERT_SERVICE, "x", "127.0.0.1", 1))
    await reg.deregister("x")
    assert fake.lists == 0 and fake.watches == 0
    await reg.close()


async def test_the_fake_serves_endpointslices_that_validate_against_the_api_schema(fake) -> None:
    """What the fake lists and streams is what the API server would: checked offline against
    kubernetes-validate's EndpointSlice schema, strict (no field the API lacks)."""
    import aiohttp
    import kubernetes_validate

    await add(fake, "pod-a", 5001)
    await add(fake, "pod-b", 5001, ready=False, terminating=True)
    url = f"{fake.base_url}/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(
            url, params={"labelSelector": f"moe-mesh.io/service={EXPERT_SERVICE}"}
        ) as r:
            listed = await r.json()
        async with http.get(
            url, params={"watch": "true", "resourceVersion": "0", "timeoutSeconds": "1"}
        ) as r:
            events = [json.loads(line) for line in (await r.text()).splitlines()]
        async with http.get(url) as r:  # no selector: everything in the namespace
            assert len((await r.json())["items"]) == 1
        async with aiohttp.ClientSession() as anonymous, anonymous.get(url) as r:
            assert r.status == 401 and (await r.json())["code"] == 401
    assert listed["kind"] == "EndpointSliceList" and listed["metadata"]["resourceVersion"]
    [item] = listed["items"]
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
    for obj in [{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", **item}] + [
        e["object"] for e in events
    ]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert item["metadata"]["labels"]["kubernetes.io/service-name"] == "experts-a"
    assert [e["conditions"] for e in item["endpoints"]] == [
        {"ready": True, "serving": True, "terminating": False},
        {"ready": False, "serving": True, "terminating": True},
    ]
    broken = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        **item,
        "addressType": 4,
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
