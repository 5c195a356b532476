"""The kubernetes target: manifests for one namespace, one Deployment per expert group.

Discovery stays Consul's, as in the other targets: every pod registers itself with the address it
advertises (its pod IP), so routers find expert services and gateways find routers without listing
addresses; `kubernetes.consul_http_addr` names the cluster's Consul (e.g. the Consul Helm chart's
server service), and an optional Secret supplies CONSUL_HTTP_TOKEN. Each component gets:
  a Deployment (replicas, the plan's resources as requests and limits, gRPC readiness and liveness
  probes on the standard health service, a read-only checkpoint volume from a PersistentVolumeClaim,
  pods annotated for Prometheus), a headless Service (stable DNS for every replica's pod IP), and a
  PodDisruptionBudget (a voluntary eviction never takes down more than one replica at a time).
The gateway's Service is a ClusterIP one with its public gRPC and HTTP ports. A ConfigMap holds the
Prometheus scrape configuration (pod discovery by annotation). Under `security`, each pod mounts its
certificate, key, CA and (gateway) API keys from Secrets the operator creates (secret_names), in one
projected read-only volume, and probes with `moe-mesh probe` (the kubelet's gRPC probe has no TLS).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from moe_mesh.autoscale import queries
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.planning.deploy import secrets
from moe_mesh.planning.deploy.compose import (
    HEADER,
    cpus,
    expert_command,
    gateway_command,
    router_command,
    wrap,
)
from moe_mesh.planning.deploy.plan import Plan, PlanError, Resources
from moe_mesh.planning.deploy.prometheus import (
    METRICS_PORT,
    kubernetes_pods_job,
    prometheus_yml,
)

DEFAULT_HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance
MODEL_VOLUME = "model"
SECRETS_VOLUME, SECRETS_DIR = "secrets", "/run/secrets/moe-mesh"


def _labels(plan: Plan, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": plan.name, "app": component}


def _meta(plan: Plan, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": plan.kubernetes.namespace,
        "labels": _labels(plan, component),
    }


def _container(
    plan: Plan, component: str, args: list[str], ports: dict[str, int], resources: Resources
) -> dict[str, Any]:
    size = {"cpu": cpus(resources), "memory": f"{resources.memory_mb}Mi"}
    grpc_port = next(iter(ports.values()))
    # The kubelet's gRPC probe speaks plaintext only: under TLS the probe is `moe-mesh probe`.
    check = (
        {"exec": {"command": secrets.probe(plan, str(grpc_port), SECRETS_DIR)}}
        if plan.security.tls
        else {"grpc": {"port": grpc_port}}
    )
    probe = {**check, "periodSeconds": 10, "timeoutSeconds": 3}
    mounts = [{"name": MODEL_VOLUME, "mountPath": plan.model.checkpoint, "readOnly": True}]
    if secret_names(plan, component):
        mounts.append({"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR, "readOnly": True})
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "CONSUL_HTTP_ADDR", "value": plan.kubernetes.consul_http_addr},
        {
            "name": "CONSUL_HTTP_TOKEN",
            "valueFrom": {
                "secretKeyRef": {
                    "name": plan.kubernetes.consul_token_secret,
                    "key": "token",
                    "optional": True,
                }
            },
        },
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": plan.kubernetes.otlp_endpoint},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.01"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"service.namespace={plan.name},moe_mesh.component={component}",
        },
    ]
    return {
        "name": component,
        "image": plan.image,
        # $(POD_IP) is Kubernetes' own expansion of the variable above.
        "args": [
            *args,
            *secrets.flags(plan, component, SECRETS_DIR),
            "--metrics-port",
            str(METRICS_PORT),
        ],
        "env": env,
        "ports": [
            *({"name": n, "containerPort": p} for n, p in ports.items()),
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "resources": {"requests": size, "limits": size},
        # Loading weights takes a while: liveness waits for the first readiness.
        "startupProbe": {**probe, "failureThreshold": 60},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 3},
        "volumeMounts": mounts,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
    }


def _deployment(
    plan: Plan,
    component: str,
    replicas: int | None,
    args: list[str],
    ports: dict[str, int],
    resources: Resources,
) -> dict[str, Any]:
    labels = _labels(plan, component)
    volumes: list[dict[str, Any]] = [
        {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": plan.kubernetes.model_claim, "readOnly": True},
        }
    ]
    pod: dict[str, Any] = {}
    if secret_names(plan, component):
        volumes.append(_secrets_volume(plan, component))
        pod["securityContext"] = {"fsGroup": 10001}  # the image's user reads the 0440 files
    # None: a HorizontalPodAutoscaler owns the count, which `kubectl apply` would otherwise reset.
    count = {} if replicas is None else {"replicas": replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, component, component),
        "spec": {
            **count,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                    },
                },
                "spec": {
                    # Services drain in-flight calls for up to 10 s after SIGTERM.
                    "terminationGracePeriodSeconds": 20,
                    "containers": [_container(plan, component, args, ports, resources)],
                    "volumes": volumes,
                    **pod,
                },
            },
        },
    }


def secret_names(plan: Plan, component: str) -> dict[str, str]:
    """file -> the Secret it comes from: `<name>-tls-<kind>` (keys tls-ca.pem, tls-cert.pem,
    tls-key.pem), `<name>-api-keys` (key api-keys) and the Consul token's Secret (key token)."""
    out = {}
    for f in secrets.files(plan, component):
        if f in (secrets.CA, secrets.CERT, secrets.KEY):
            out[f] = f"{plan.name}-tls-{secrets.kind(component)}"
        elif f == secrets.API_KEYS:
            out[f] = f"{plan.name}-api-keys"
    return out  # the Consul token stays CONSUL_HTTP_TOKEN from its (optional) Secret


def _secrets_volume(plan: Plan, component: str) -> dict[str, Any]:
    """One projected volume of every secret file the component reads (never environment values)."""
    by_secret: dict[str, list[str]] = {}
    for f, secret in secret_names(plan, component).items():
        by_secret.setdefault(secret, []).append(f)
    sources = [
        {"secret": {"name": s, "items": [{"key": f, "path": f} for f in fs]}}
        for s, fs in by_secret.items()
    ]
    return {"name": SECRETS_VOLUME, "projected": {"sources": sources, "defaultMode": 0o440}}


def _service(plan: Plan, component: str, ports: dict[str, int], headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": _labels(plan, component),
        "ports": [
            {"name": n, "port": p, "targetPort": n}
            for n, p in [*ports.items(), ("metrics", METRICS_PORT)]
        ],
    }
    if headless:
        spec["clusterIP"] = "None"  # DNS answers with every ready replica's pod IP
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, component, component),
        "spec": spec,
    }


def _budget(plan: Plan, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(plan, component, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(plan, component)}},
    }


def _component(
    plan: Plan,
    component: str,
    replicas: int | None,
    args: list[str],
    ports: dict[str, int],
    resources: Resources,
    headless: bool = True,
) -> list[dict[str, Any]]:
    return [
        _deployment(plan, component, replicas, args, ports, resources),
        _service(plan, component, ports, headless),
        _budget(plan, component),
    ]


ADVERTISE = ["--advertise-host", "$(POD_IP)"]


def manifests(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds."""
    files: dict[str, list[dict[str, Any]]] = {}
    for g in plan.expert_groups:
        name = f"expert-{g.name}"
        args = expert_command(plan, g, str(g.port), ADVERTISE)
        replicas = g.replicas if g.autoscale is None else None
        files[f"{name}.yaml"] = _component(
            plan, name, replicas, args, {"grpc": g.port}, g.resources
        )
        if g.autoscale is not None:
            files[f"{name}.yaml"].append(hpa(plan, name, g.autoscale))
    r, gw = plan.router, plan.gateway
    files["router.yaml"] = _component(
        plan,
        "router",
        r.replicas,
        router_command(plan, str(r.port), ADVERTISE),
        {"grpc": r.port},
        r.resources,
    )
    files["gateway.yaml"] = _component(
        plan,
        "gateway",
        gw.replicas,
        gateway_command(plan),
        {"grpc": gw.grpc_port, "http": gw.http_port},
        gw.resources,
        headless=False,
    )
    files["prometheus.yaml"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(plan, f"{plan.name}-prometheus", "prometheus"),
            "data": {
                "prometheus.yml": prometheus_yml([kubernetes_pods_job(plan.kubernetes.namespace)])
            },
        }
    ]
    metrics = sorted({g.autoscale.metric for g in plan.expert_groups if g.autoscale})
    if metrics:
        files["prometheus-adapter.yaml"] = [adapter_rules(plan, metrics)]
    files["namespace.yaml"] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": plan.kubernetes.namespace}}
    ]
    return files


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
        "metadata": _meta(plan, deployment, deployment),
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
            "labels": _labels(plan, "prometheus-adapter"),
        },
        "data": {"config.yaml": yaml.safe_dump(config, sort_keys=False, width=1000)},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the configuration files ConfigMaps hold) as literal blocks, readable."""


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def render_kubernetes(plan: Plan) -> dict[str, str]:
    head = "".join(f"# {line}\n" for line in wrap(HEADER.format(target="kubernetes")))
    return {
        name: head
        + yaml.dump_all(
            objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000
        )
        for name, objects in sorted(manifests(plan).items())
    }
