"""The kubernetes target: manifests for one namespace, one Deployment per expert group.

Each component (an expert group, the routers, the gateways) gets a Deployment (replicas, the plan's
resources as requests and limits, one `nvidia.com/gpu` on CUDA, the kubelet's gRPC startup,
readiness and liveness probes, the checkpoint mounted read-only, pods annotated for Prometheus), a
Service and a PodDisruptionBudget (a voluntary eviction never takes down more than one replica at a
time); the objects around them (probes, model volume, discovery's RBAC, Ingress) are
kubernetes_objects.py's, the autoscaling ones kubernetes_hpa.py's. Discovery (`kubernetes.discovery`):
  kubernetes: routers and expert groups have headless Services labelled for discovery; services
    run with `--registry kubernetes` and list and watch those Services' EndpointSlices (ready pods
    only, so readiness is registration) as the ServiceAccount `moe-mesh` (rbac.yaml); no Consul.
  consul: every pod registers itself with the address it advertises (its pod IP) in the cluster's
    Consul (`kubernetes.consul_http_addr`); an optional Secret supplies CONSUL_HTTP_TOKEN.
The gateway's Service is a ClusterIP one with its public gRPC and HTTP ports, of type LoadBalancer
with `expose: loadbalancer`, or behind an Ingress with `expose: ingress`. A ConfigMap holds the
Prometheus scrape configuration (pod discovery by annotation). Under `security`, each pod mounts its
certificate, key, CA and (gateway) API keys from Secrets the operator creates (secret_names), in one
projected read-only volume.
"""

from __future__ import annotations

from typing import Any

import yaml

from common.device import is_cuda
from moe_mesh.planning.deploy import secrets
from moe_mesh.planning.deploy.compose import (
    HEADER,
    cpus,
    expert_command,
    gateway_command,
    router_command,
    wrap,
)
from moe_mesh.planning.deploy.kubernetes_hpa import adapter_rules, hpa
from moe_mesh.planning.deploy.kubernetes_objects import (
    MODEL_VOLUME,
    SERVICE_ACCOUNT,
    discovery_labels,
    health_port,
    ingress,
    labels,
    meta,
    model_objects,
    model_volume,
    probes,
    rbac,
    wait_for_model,
)
from moe_mesh.planning.deploy.plan import Plan, PlanError, Resources
from moe_mesh.planning.deploy.prometheus import (
    METRICS_PORT,
    kubernetes_pods_job,
    prometheus_yml,
)

SECRETS_VOLUME, SECRETS_DIR = "secrets", "/run/secrets/moe-mesh"
GPU = "nvidia.com/gpu"  # NVIDIA's device plugin's extended resource


def _env(plan: Plan, component: str) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    k = plan.kubernetes
    env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": field("status.podIP")}]
    if k.discovery == "kubernetes":
        env.append({"name": "MOE_MESH_K8S_NAMESPACE", "valueFrom": field("metadata.namespace")})
    else:
        token = {"name": k.consul_token_secret, "key": "token", "optional": True}
        env += [
            {"name": "CONSUL_HTTP_ADDR", "value": k.consul_http_addr},
            {"name": "CONSUL_HTTP_TOKEN", "valueFrom": {"secretKeyRef": token}},
        ]
    return env + [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": k.otlp_endpoint},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.01"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"service.namespace={plan.name},moe_mesh.component={component}",
        },
    ]


def _args(plan: Plan, component: str, args: list[str]) -> list[str]:
    """The service's flags: discovery's registry instead of the shared commands' Consul, the secret
    files, the plaintext health port under TLS, metrics."""
    args = list(args)
    i = args.index("--registry")
    args[i + 1] = plan.kubernetes.discovery
    if plan.security.tls:
        args += ["--health-port", str(plan.kubernetes.health_port)]
    return [
        *args,
        *secrets.flags(plan, component, SECRETS_DIR),
        "--metrics-port",
        str(METRICS_PORT),
    ]


def _size(resources: Resources, device: str) -> dict[str, Any]:
    """Requests and limits (equal, as an extended resource's must be): on CUDA one GPU, which the
    scheduler picks (cuda:N's index means nothing to it) and the pod sees as its device 0."""
    size: dict[str, Any] = {"cpu": cpus(resources), "memory": f"{resources.memory_mb}Mi"}
    return {**size, GPU: 1} if is_cuda(device) else size


def _container(
    plan: Plan,
    component: str,
    args: list[str],
    ports: dict[str, int],
    resources: Resources,
    device: str,
) -> dict[str, Any]:
    size = _size(resources, device)
    grpc_port = next(iter(ports.values()))
    mounts = [{"name": MODEL_VOLUME, "mountPath": plan.model.checkpoint, "readOnly": True}]
    if secret_names(plan, component):
        mounts.append({"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR, "readOnly": True})
    named = dict(ports)
    if plan.security.tls:
        named["health"] = health_port(plan, grpc_port)
    return {
        "name": component,
        "image": plan.image,
        # $(POD_IP) is Kubernetes' own expansion of the variable in _env.
        "args": _args(plan, component, args),
        "env": _env(plan, component),
        "ports": [
            *({"name": n, "containerPort": p} for n, p in named.items()),
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "resources": {"requests": size, "limits": size},
        **probes(plan, grpc_port),
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
    device: str,
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [model_volume(plan)]
    pod: dict[str, Any] = {}
    if secret_names(plan, component):
        volumes.append(_secrets_volume(plan, component))
        pod["securityContext"] = {"fsGroup": 10001}  # the image's user reads the 0440 files
    if plan.kubernetes.discovery == "kubernetes":
        pod["serviceAccountName"] = SERVICE_ACCOUNT  # discovery lists EndpointSlices
    if init := wait_for_model(plan):
        pod["initContainers"] = init
    # None: a HorizontalPodAutoscaler owns the count, which `kubectl apply` would otherwise reset.
    count = {} if replicas is None else {"replicas": replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(plan, component, component),
        "spec": {
            **count,
            "selector": {"matchLabels": labels(plan, component)},
            "template": {
                "metadata": {
                    "labels": labels(plan, component),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                    },
                },
                "spec": {
                    # Services drain in-flight calls for up to 10 s after SIGTERM.
                    "terminationGracePeriodSeconds": 20,
                    "containers": [_container(plan, component, args, ports, resources, device)],
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
        "selector": labels(plan, component),
        "ports": [
            {"name": n, "port": p, "targetPort": n}
            for n, p in [*ports.items(), ("metrics", METRICS_PORT)]
        ],
    }
    if headless:
        # DNS, and discovery's EndpointSlices, list every ready replica's pod IP (ready only).
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = False
    elif plan.kubernetes.expose == "loadbalancer":
        spec["type"] = "LoadBalancer"
    metadata = meta(plan, component, component)
    metadata["labels"] |= discovery_labels(plan, component)
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


def _budget(plan: Plan, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(plan, component, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(plan, component)}},
    }


def _component(
    plan: Plan,
    component: str,
    replicas: int | None,
    args: list[str],
    ports: dict[str, int],
    resources: Resources,
    headless: bool = True,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    return [
        _deployment(plan, component, replicas, args, ports, resources, device),
        _service(plan, component, ports, headless),
        _budget(plan, component),
    ]


ADVERTISE = ["--advertise-host", "$(POD_IP)"]


def _check_ports(plan: Plan) -> None:
    """The plaintext health port must not be one a container already listens on."""
    if not plan.security.tls:
        return
    taken = {
        "metrics": METRICS_PORT,
        "router.port": plan.router.port,
        "gateway.grpc_port": plan.gateway.grpc_port,
        "gateway.http_port": plan.gateway.http_port,
        **{f"expert_groups.{g.name}.port": g.port for g in plan.expert_groups},
    }
    for field, port in taken.items():
        if port == plan.kubernetes.health_port:
            raise PlanError(
                f"kubernetes.health_port {port} is also {field}: choose another health port"
            )


def manifests(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds."""
    _check_ports(plan)
    files: dict[str, list[dict[str, Any]]] = {}
    for g in plan.expert_groups:
        name = f"expert-{g.name}"
        args = expert_command(plan, g, str(g.port), ADVERTISE)
        replicas = g.replicas if g.autoscale is None else None
        files[f"{name}.yaml"] = _component(
            plan, name, replicas, args, {"grpc": g.port}, g.resources, device=g.device
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
        device=r.device,
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
    if plan.kubernetes.expose == "ingress":
        files["gateway.yaml"].append(ingress(plan))
    if plan.kubernetes.discovery == "kubernetes":
        files["rbac.yaml"] = rbac(plan)
    if model := model_objects(plan):
        files["model.yaml"] = model
    files["prometheus.yaml"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(plan, f"{plan.name}-prometheus", "prometheus"),
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


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the configuration files ConfigMaps hold) as literal blocks, readable;
    a dict used twice (requests and limits, two probes' checks) written out twice, never as an
    anchor and alias that readers of a manifest would have to resolve."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


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
