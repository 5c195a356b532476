"""The kubernetes target's autoscaling: a HorizontalPodAutoscaler per group with `autoscale` that
validates offline against the API schemas and carries the policy, a Deployment that leaves the
count to it, the Prometheus Adapter's rules for each metric used (and the scrape labels they
need), and nothing of it for a plan without `autoscale`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from moe_mesh.autoscale.policy import SERIES
from moe_mesh.planning import deploy
from tests.support.plans import EXAMPLE_PLAN, busy_plan, example_raw, plan_of, static_plan

K8S_VERSION = "1.37.0"  # kubernetes-validate carries the API schemas of each release offline


def k8s_objects(plan: deploy.Plan) -> dict[tuple[str, str], dict]:
    out = {}
    for text in deploy.render(plan, "kubernetes").values():
        for obj in yaml.safe_load_all(text):
            out[obj["kind"], obj["metadata"]["name"]] = obj
    return out


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
