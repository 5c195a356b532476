"""The kubernetes target as operators deploy it: the example plan's manifests validate offline
(strict) with the kubelet's gRPC probes, the model volume and its fill Job, the gateway's Ingress
and discovery through EndpointSlices without Consul; `discovery: consul` keeps the Consul render.
Its autoscaling: a HorizontalPodAutoscaler per group with `autoscale` that carries the policy, a
Deployment that leaves the count to it, the Prometheus Adapter's rules for each metric used (and
the scrape labels they need), and nothing of it for a plan without `autoscale`. Its devices: the
router's and each CUDA group's container requests and limits one `nvidia.com/gpu` and runs with
`--device cuda`, and the manifests still validate; a CPU component asks for no GPU (and runs with
`--device cpu` where the plan uses GPUs)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from common.server import LIVENESS
from moe_mesh.autoscale.policy import SERIES
from moe_mesh.planning import deploy
from moe_mesh.planning.deploy import kubernetes_objects
from tests.support.plans import (
    EXAMPLE_PLAN,
    K8S_VERSION,
    busy_plan,
    example_raw,
    gpu_raw,
    k8s_objects,
    plan_of,
    static_plan,
)

COMPONENTS = ["expert-hot", "expert-cold", "router", "gateway"]


def containers(objects: dict, name: str) -> tuple[dict, dict]:
    pod = objects["Deployment", name]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    return pod, c


def test_the_example_validates_with_grpc_probes_model_volume_ingress_and_no_consul() -> None:
    import kubernetes_validate

    plan = deploy.load_plan(EXAMPLE_PLAN)
    objects = k8s_objects(plan)
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = {k for k, _ in objects}
    assert {"PersistentVolumeClaim", "Job", "Ingress", "ServiceAccount", "Role"} <= kinds
    port = plan.kubernetes.health_port  # the example is under TLS: the plaintext health port
    for name in COMPONENTS:
        pod, c = containers(objects, name)
        # The kubelet's own gRPC probes: readiness on the overall service, liveness and startup
        # on the one that stays SERVING while the process is sound.
        assert c["readinessProbe"]["grpc"] == {"port": port}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": LIVENESS}
        assert c["startupProbe"]["grpc"] == {"port": port, "service": LIVENESS}
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
        assert not any("exec" in c[p] for p in ("readinessProbe", "livenessProbe", "startupProbe"))
        # The checkpoint: the claim, read-only, behind the wait for the fill Job's marker.
        assert {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "moe-mesh-model", "readOnly": True},
        } in pod["volumes"]
        [wait] = pod["initContainers"]
        assert (
            wait["command"][-1] == plan.model.checkpoint
            and ".moe-mesh-filled" in wait["command"][2]
        )
        # Discovery without Consul: the API's EndpointSlices, as the ServiceAccount.
        assert c["args"][c["args"].index("--registry") + 1] == "kubernetes"
        env = {e["name"]: e for e in c["env"]}
        assert not [k for k in env if k.startswith("CONSUL")]
        assert env["MOE_MESH_K8S_NAMESPACE"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "metadata.namespace"}
        }
        assert pod["serviceAccountName"] == "moe-mesh"
    for name, kind in [("expert-hot", "expert"), ("expert-cold", "expert"), ("router", "router")]:
        svc = objects["Service", name]
        assert svc["metadata"]["labels"]["moe-mesh.io/service"] == f"moe-mesh-{kind}"
        assert svc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "moe-mesh"
        assert (
            svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        )
        assert {
            "name": "grpc",
            "port": svc["spec"]["ports"][0]["port"],
            "targetPort": "grpc",
        } in svc["spec"]["ports"]
    assert "moe-mesh.io/service" not in objects["Service", "gateway"]["metadata"]["labels"]
    [rule] = objects["Role", "moe-mesh"]["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    binding = objects["RoleBinding", "moe-mesh"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "moe-mesh", "namespace": "moe-mesh"}
    ]
    claim = objects["PersistentVolumeClaim", "moe-mesh-model"]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "2Gi"}},
    }
    [fill] = objects["Job", "moe-mesh-model-fill"]["spec"]["template"]["spec"]["containers"]
    assert (
        fill["image"] == "moe-mesh-model:mixtral-small"
        and "cp -R /checkpoint/. /fill/" in fill["command"][2]
    )
    ingress = objects["Ingress", "gateway"]["spec"]
    assert ingress["ingressClassName"] == "nginx"
    [rule] = ingress["rules"]
    assert rule["host"] == "moe-mesh.localhost"
    assert rule["http"]["paths"][0]["backend"] == {
        "service": {"name": "gateway", "port": {"name": "http"}}
    }
    # The schemas are really checked: a gRPC probe without its port is refused.
    broken = copy.deepcopy(objects["Deployment", "router"])
    del broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_example_validates_on_the_oldest_release_it_documents() -> None:
    """Kubernetes 1.27: the first release with the kubelet's gRPC probes on by default (GA)."""
    import kubernetes_validate

    for obj in k8s_objects(deploy.load_plan(EXAMPLE_PLAN)).values():
        kubernetes_validate.validate(obj, "1.27.0", strict=True)


def test_liveness_is_the_name_the_servers_keep_serving() -> None:
    assert kubernetes_objects.LIVENESS == LIVENESS  # the deploy package does not import grpc


def test_discovery_consul_keeps_the_consul_render(tmp_path: Path) -> None:
    import kubernetes_validate

    raw = example_raw()
    raw["kubernetes"]["discovery"] = "consul"
    plan = plan_of(raw, tmp_path)
    files = deploy.render(plan, "kubernetes")
    assert "rbac.yaml" not in files
    objects = k8s_objects(plan)
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    for name in COMPONENTS:
        pod, c = containers(objects, name)
        assert c["args"][c["args"].index("--registry") + 1] == "consul"
        env = {e["name"]: e for e in c["env"]}
        assert env["CONSUL_HTTP_ADDR"]["value"] == plan.kubernetes.consul_http_addr
        assert env["CONSUL_HTTP_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert "MOE_MESH_K8S_NAMESPACE" not in env and "serviceAccountName" not in pod
        assert "moe-mesh.io/service" not in objects["Service", name]["metadata"]["labels"]


def test_without_tls_the_probes_ask_the_service_port_itself(tmp_path: Path) -> None:
    raw = example_raw()
    raw.pop("security")
    plan = plan_of(raw, tmp_path)
    objects = k8s_objects(plan)
    _, c = containers(objects, "gateway")
    assert c["readinessProbe"]["grpc"] == {"port": plan.gateway.grpc_port}
    assert "--health-port" not in c["args"] and "health" not in {p["name"] for p in c["ports"]}
    _, c = containers(objects, "expert-cold")
    assert c["livenessProbe"]["grpc"] == {"port": 50061, "service": LIVENESS}


def test_the_startup_budget_and_a_health_port_in_use(tmp_path: Path) -> None:
    raw = example_raw()
    raw["kubernetes"]["startup_timeout_s"] = 1805
    _, c = containers(k8s_objects(plan_of(raw, tmp_path)), "router")
    assert c["startupProbe"]["failureThreshold"] == math.ceil(1805 / 10)
    raw["kubernetes"]["health_port"] = 50051
    with pytest.raises(deploy.PlanError, match=r"health_port 50051 is also router\.port"):
        deploy.render(plan_of(raw, tmp_path), "kubernetes")


@pytest.mark.parametrize("which", ["example", "busy"])
def test_hpa_and_adapter_rules_validate_offline(tmp_path: Path, which: str) -> None:
    import kubernetes_validate

    plan = deploy.load_plan(EXAMPLE_PLAN) if which == "example" else busy_plan(tmp_path)
    objects = k8s_objects(plan)
    autoscaled = [k for k in objects if k[0] == "HorizontalPodAutoscaler"]
    assert len(autoscaled) == sum(g.autoscale is not None for g in plan.expert_groups) >= 1
    for key in [*autoscaled, ("ConfigMap", f"{plan.name}-prometheus-adapter")]:
        kubernetes_validate.validate(objects[key], K8S_VERSION, strict=True)
    # The HPA schema is really checked: a policy without its period, a target of the wrong kind.
    broken = copy.deepcopy(objects[autoscaled[0]])
    del broken["spec"]["behavior"]["scaleUp"]["policies"][0]["periodSeconds"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(objects[autoscaled[0]])
    broken["spec"]["metrics"][0]["pods"]["target"]["averageValues"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_hpa_carries_the_policy_and_owns_the_replica_count(tmp_path: Path) -> None:
    plan = busy_plan(tmp_path)
    objects = k8s_objects(plan)
    hot = objects["HorizontalPodAutoscaler", "expert-hot"]["spec"]
    assert hot["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "expert-hot",
    }
    assert (hot["minReplicas"], hot["maxReplicas"]) == (1, 4)
    [metric] = hot["metrics"]
    assert metric["pods"] == {
        "metric": {"name": "moe_expert_token_rows_per_second"},
        "target": {"type": "AverageValue", "averageValue": "2000"},
    }
    assert hot["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert "tolerance" not in hot["behavior"]["scaleUp"]  # 0.1: the cluster's own
    cold = objects["HorizontalPodAutoscaler", "expert-cold"]["spec"]
    assert (cold["minReplicas"], cold["maxReplicas"]) == (2, 6)
    assert cold["metrics"][0]["pods"]["metric"]["name"] == "moe_expert_busy_fraction"
    assert cold["metrics"][0]["pods"]["target"]["averageValue"] == "600m"  # busy's default 0.6
    up, down = cold["behavior"]["scaleUp"], cold["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 30 and down["stabilizationWindowSeconds"] == 120
    assert up["policies"] == [{"type": "Pods", "value": 2, "periodSeconds": 60}]
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    assert up["tolerance"] == down["tolerance"] == "50m"
    # `kubectl apply` would reset an autoscaled Deployment to a rendered count: there is none.
    for name in ("expert-hot", "expert-cold"):
        assert "replicas" not in objects["Deployment", name]["spec"]
    assert objects["Deployment", "router"]["spec"]["replicas"] == plan.router.replicas


def test_adapter_rules_serve_each_metric_used_per_pod(tmp_path: Path) -> None:
    plan = busy_plan(tmp_path)
    objects = k8s_objects(plan)
    adapter = objects["ConfigMap", f"{plan.name}-prometheus-adapter"]
    assert adapter["metadata"]["namespace"] == plan.kubernetes.prometheus_adapter_namespace
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert [r["name"]["as"] for r in rules] == [
        "moe_expert_busy_fraction",
        "moe_expert_token_rows_per_second",
    ]
    for rule, metric in zip(rules, ["busy", "token_rows"]):
        assert rule["seriesQuery"] == f'{SERIES[metric]}{{namespace!="",pod!=""}}'
        assert rule["name"]["matches"] == f"^{SERIES[metric]}$"
        assert rule["resources"] == {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        }
        assert rule["metricsQuery"].startswith("sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m]))")
    # The adapter finds a pod's series by these two labels: the scrape job must set both.
    config = objects["ConfigMap", f"{plan.name}-prometheus"]["data"]["prometheus.yml"]
    [job] = yaml.safe_load(config)["scrape_configs"]
    targets = {r.get("target_label"): r.get("source_labels") for r in job["relabel_configs"]}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_a_step_period_the_hpa_cannot_hold_is_refused_at_render(tmp_path: Path) -> None:
    raw = example_raw()
    raw["expert_groups"][0]["autoscale"]["step_period_s"] = 3600  # the local controller's bound
    plan = plan_of(raw, tmp_path)
    with pytest.raises(
        deploy.PlanError, match=r"expert-hot: autoscale\.step_period_s 3600 s: .* at most 1800 s"
    ):
        deploy.render(plan, "kubernetes")
    deploy.render(plan, "nomad")  # a duration there


def test_a_plan_without_autoscale_renders_no_hpa_and_keeps_the_count(tmp_path: Path) -> None:
    plan = static_plan(tmp_path)
    objects = k8s_objects(plan)
    assert not [k for k in objects if k[0] == "HorizontalPodAutoscaler"]
    assert "prometheus-adapter.yaml" not in deploy.render(plan, "kubernetes")
    assert objects["Deployment", "expert-hot"]["spec"]["replicas"] == 2


def test_cuda_components_request_an_nvidia_gpu_and_validate(tmp_path: Path) -> None:
    import kubernetes_validate

    objects = k8s_objects(plan_of(gpu_raw(), tmp_path))
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    for name in ("router", "expert-hot"):  # cuda:1 and cuda: the scheduler picks the GPU
        _, c = containers(objects, name)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"] == c["resources"]["limits"]  # an extended resource's
        assert c["args"][c["args"].index("--device") + 1] == "cuda"  # the pod's only GPU
    for name in ("expert-cold", "gateway"):
        _, c = containers(objects, name)
        assert set(c["resources"]["limits"]) == {"cpu", "memory"}
        assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    _, c = containers(objects, "expert-cold")
    assert c["args"][c["args"].index("--device") + 1] == "cpu"
    # The schema checks the resources: a GPU count that is no quantity is refused.
    broken = copy.deepcopy(objects["Deployment", "router"])
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpu": ["1"]
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_a_cpu_plan_requests_no_gpu() -> None:
    files = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "kubernetes")
    assert not [name for name, text in files.items() if "nvidia.com/gpu" in text]
    assert not [name for name, text in files.items() if "--device" in text]
