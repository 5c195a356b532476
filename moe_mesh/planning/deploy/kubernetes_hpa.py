"""The kubernetes target's autoscaling objects: a HorizontalPodAutoscaler per group with `autoscale`
and the Prometheus Adapter's rules that feed it the groups' measured load (kubernetes.py renders
them beside the group's Deployment)."""

from __future__ import annotations

import math
from typing import Any

import yaml

from moe_mesh.autoscale import queries
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.planning.deploy.kubernetes_objects import labels, meta
from moe_mesh.planning.deploy.plan import Plan, PlanError

DEFAULT_HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance


def _quantity(x: float) -> str:
    """A Kubernetes quantity as the API server writes it back: 2000 -> '2000', 0.6 -> '600m'."""
    return str(int(x)) if float(x).is_integer() else f"{max(1, round(x * 1000))}m"


def _seconds(deployment: str, policy: Autoscale, field: str, most: int) -> int:
    """A policy duration as the HPA's whole seconds, refused past the HPA's bound."""
    value = math.ceil(getattr(policy, field))
    if value > most:
        raise PlanError(
            f"{deployment}: autoscale.{field} {value} s: the HorizontalPodAutoscaler takes at "
            f"most {most} s"
        )
    return value


def hpa(plan: Plan, deployment: str, policy: Autoscale) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler holding the group's load per pod at the target,
    read from the Prometheus Adapter (adapter_rules), with the policy's windows and step limits as
    its `behavior`. Tolerance: the cluster's (kube-controller-manager
    --horizontal-pod-autoscaler-tolerance, 0.1) unless the policy's differs; the per-HPA field
    is KEP-4951's (Kubernetes 1.33+, feature gate HPAConfigurableTolerance; dropped where off)."""
    period = _seconds(deployment, policy, "step_period_s", 1800)

    def rules(window: str, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stabilizationWindowSeconds": _seconds(deployment, policy, window, 3600),
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": step, "periodSeconds": period}],
        }
        if policy.tolerance != DEFAULT_HPA_TOLERANCE:
            out["tolerance"] = _quantity(policy.tolerance)
        return out

    metric = {"name": queries.ADAPTER_METRIC[policy.metric]}
    target = {"type": "AverageValue", "averageValue": _quantity(policy.level)}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(plan, deployment, deployment),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicas": policy.min_replicas,
            "maxReplicas": policy.max_replicas,
            "metrics": [{"type": "Pods", "pods": {"metric": metric, "target": target}}],
            "behavior": {
                "scaleUp": rules("scale_up_window_s", policy.max_step_up),
                "scaleDown": rules("scale_down_window_s", policy.max_step_down),
            },
        },
    }


def adapter_rules(plan: Plan, metrics: list[str]) -> dict[str, Any]:
    """The Prometheus Adapter's configuration (its Helm chart's `rules.existing` ConfigMap, key
    config.yaml): a custom metric per pod for each policy metric the plan's groups use."""
    config = {"rules": [queries.adapter_rule(m) for m in metrics]}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{plan.name}-prometheus-adapter",
            "namespace": plan.kubernetes.prometheus_adapter_namespace,
            "labels": labels(plan, "prometheus-adapter"),
        },
        "data": {"config.yaml": yaml.safe_dump(config, sort_keys=False, width=1000)},
    }
