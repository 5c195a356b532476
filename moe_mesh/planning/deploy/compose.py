"""The compose target: docker-compose.yml and .env.example rendered from a plan.

The image they run is built from the repository's deploy/compose/Dockerfile, which is a source file
of its own (linted, and the same for every plan), not part of a render.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from common.device import is_cuda
from moe_mesh.planning.deploy import secrets
from moe_mesh.planning.deploy.plan import ExpertGroup, Plan, Resources, gpu_index
from moe_mesh.planning.deploy.prometheus import METRICS_PORT, dns_job, prometheus_yml

HEADER = (
    "Rendered by `moe-mesh deploy render --target {target}` from a deploy plan. "
    "Do not edit: change the plan and render again."
)
EXPERT_SERVICE_PREFIX = "expert-"  # compose service of group G: expert-G
SECRETS_DIR = "/run/secrets"  # where compose mounts a service's secrets


def _dollar(s: str) -> str:
    """A plan value as compose text: '$' would start an interpolation."""
    return s.replace("$", "$$")


def _compose_healthcheck(plan: Plan, port: int, start_period: str) -> dict[str, Any]:
    return {
        "test": ["CMD", *secrets.probe(plan, str(port), SECRETS_DIR)],
        "interval": "10s",
        "timeout": "5s",
        "retries": 3,
        "start_period": start_period,
    }


def otel_env(plan: Plan, component: str) -> dict[str, str]:
    """OpenTelemetry's standard variables: traces go to OTLP once an endpoint is set (deployment's
    choice, empty by default), sampled at 1%; the resource names the deployment and the component."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "${OTEL_EXPORTER_OTLP_ENDPOINT:-}",
        "OTEL_TRACES_SAMPLER_ARG": "${OTEL_TRACES_SAMPLER_ARG:-0.01}",
        "OTEL_RESOURCE_ATTRIBUTES": f"service.namespace={plan.name},moe_mesh.component={component}",
    }


def cpus(r: Resources) -> str:
    """The plan's CPU share in cores: 1000 MHz is counted as one core, as Nomad's docs suggest."""
    return f"{r.cpu_mhz / 1000:g}"


def uses_gpus(plan: Plan) -> bool:
    return is_cuda(plan.router.device) or any(is_cuda(g.device) for g in plan.expert_groups)


def device_flags(plan: Plan, device: str) -> list[str]:
    """A service's --device. On CUDA `cuda`, for cuda:N too: a container sees only the GPU reserved
    for it, as its device 0 (the reservation names N). On the CPU `cpu` where the plan reserves
    GPUs: its image is then the cuda build, whose NVIDIA_VISIBLE_DEVICES=all shows a container
    every GPU of a node whose default runtime is NVIDIA's, and the services' default (auto) would
    take one nobody reserved. None in a plan without GPUs, which renders as before the field."""
    if is_cuda(device):
        return ["--device", "cuda"]
    return ["--device", "cpu"] if uses_gpus(plan) else []


def gpu_devices(device: str) -> list[dict[str, Any]]:
    """compose's `deploy.resources.reservations.devices` for one replica on `device`: any one
    NVIDIA GPU for cuda, GPU N of the Docker host for cuda:N (every replica shares it)."""
    index = gpu_index(device)
    which: dict[str, Any] = {"count": 1} if index is None else {"device_ids": [str(index)]}
    return [{"driver": "nvidia", **which, "capabilities": ["gpu"]}]


def _compose_service(
    plan: Plan,
    name: str,
    command: list[str],
    port: int,
    replicas: int,
    depends_on: Iterable[str],
    start_period: str,
    resources: Resources,
    device: str = "cpu",
) -> dict[str, Any]:
    size = {"cpus": cpus(resources), "memory": f"{resources.memory_mb}M"}
    # The same dict on the CPU: the file writes it once (an anchor), as it always has.
    reserved = {**size, "devices": gpu_devices(device)} if is_cuda(device) else size
    command = [*command, *secrets.flags(plan, name, SECRETS_DIR)]
    # Under `security` the Consul token is a secret file too, not a value in .env.
    token = (
        {"CONSUL_HTTP_TOKEN_FILE": f"{SECRETS_DIR}/{secrets.CONSUL_TOKEN}"}
        if secrets.secure(plan)
        else {"CONSUL_HTTP_TOKEN": "${CONSUL_HTTP_TOKEN:-}"}
    )
    service: dict[str, Any] = {
        "image": "${MOE_MESH_IMAGE:-" + _dollar(plan.image) + "}",
        "command": [_dollar(c) for c in [*command, "--metrics-port", str(METRICS_PORT)]],
        "environment": {
            "CONSUL_HTTP_ADDR": "${CONSUL_HTTP_ADDR:-consul:8500}",
            **token,
            # The services of one compose project share the host's cores (common/runtime.py).
            "OMP_WAIT_POLICY": "${OMP_WAIT_POLICY:-PASSIVE}",
            **otel_env(plan, name),
        },
        "volumes": [
            "${MODEL_DIR:?set MODEL_DIR to the checkpoint directory on this host}:"
            f"{_dollar(plan.model.checkpoint)}:ro"
        ],
        "expose": [str(port), str(METRICS_PORT)],
        "deploy": {"replicas": replicas, "resources": {"limits": size, "reservations": reserved}},
        "healthcheck": _compose_healthcheck(plan, port, start_period),
        "depends_on": {name: {"condition": "service_healthy"} for name in ["consul", *depends_on]},
        "restart": "unless-stopped",
        "stop_grace_period": "20s",  # services drain in-flight calls for up to 10 s after SIGTERM
    }
    if secrets.secure(plan):
        service["secrets"] = [
            {"source": _secret_name(name, f), "target": f} for f in secrets.files(plan, name)
        ]
    return service


def _secret_name(component: str, file: str) -> str:
    """A compose secret per file; certificates and keys per kind of component."""
    if file in (secrets.CERT, secrets.KEY):
        return f"{secrets.kind(component)}-{file.removesuffix('.pem')}"
    return file.removesuffix(".pem")


def _compose_secrets(plan: Plan, components: list[str]) -> dict[str, Any]:
    """Top-level `secrets`: each one a file under ./secrets, named as `moe-mesh certs` names it."""
    out = {}
    for component in components:
        for f in secrets.files(plan, component):
            written = secrets.CERTS_OUTPUT.get(f, f).format(kind=secrets.kind(component))
            out[_secret_name(component, f)] = {"file": f"./secrets/{written}"}
    return dict(sorted(out.items()))


def expert_command(plan: Plan, g: ExpertGroup, port: str, extra: list[str]) -> list[str]:
    cmd = [
        "serve-expert",
        "--checkpoint",
        plan.model.checkpoint,
        "--model-id",
        plan.model.model_id,
        "--experts",
        g.experts,
        "--registry",
        "consul",
        "--host",
        "0.0.0.0",
        "--port",
        port,
        *extra,
    ]
    if g.region:
        cmd += ["--region", g.region]
    if g.compute_threads:
        cmd += ["--compute-threads", str(g.compute_threads)]
    if g.quantize != "none":
        cmd += ["--quantize", g.quantize, "--quantize-group-size", str(g.quantize_group_size)]
    return cmd + device_flags(plan, g.device) + g.args


def router_command(plan: Plan, port: str, extra: list[str]) -> list[str]:
    return [
        "serve-router",
        "--checkpoint",
        plan.model.checkpoint,
        "--model-id",
        plan.model.model_id,
        "--registry",
        "consul",
        "--host",
        "0.0.0.0",
        "--port",
        port,
        *router_settings(plan),
        *extra,
        *plan.router.args,
    ]


def router_settings(plan: Plan) -> list[str]:
    """The router flags the plan carries as fields (set ones only, so older plans render as before)."""
    r = plan.router
    out = ["--colocate-budget", r.colocate_budget] if r.colocate_budget else []
    if r.max_num_seqs is not None:
        out += ["--max-num-seqs", str(r.max_num_seqs)]
    if r.micro_batches is not None:
        out += ["--micro-batches", str(r.micro_batches)]
    return out + device_flags(plan, r.device)


def gateway_command(plan: Plan, extra: Sequence[str] = ()) -> list[str]:
    gw = plan.gateway
    return [
        "serve-gateway",
        "--checkpoint",
        plan.model.checkpoint,
        "--registry",
        "consul",
        "--host",
        "0.0.0.0",
        "--grpc-port",
        str(gw.grpc_port),
        "--http-port",
        str(gw.http_port),
        *extra,
        *gw.args,
    ]


def render_compose(plan: Plan) -> dict[str, str]:
    """docker-compose.yml, .env.example and prometheus.yml (the image: deploy/compose/Dockerfile)."""
    groups = [f"{EXPERT_SERVICE_PREFIX}{g.name}" for g in plan.expert_groups]
    services: dict[str, Any] = {
        "consul": {
            "image": "${CONSUL_IMAGE:-" + _dollar(plan.compose.consul_image) + "}",
            "command": ["agent", "-dev", "-client", "0.0.0.0"],
            # UI and API for the operator, on the Docker host's loopback only
            "ports": ["127.0.0.1:8500:8500"],
            "healthcheck": {
                "test": ["CMD", "consul", "members"],
                "interval": "2s",
                "timeout": "3s",
                "retries": 30,
            },
            "restart": "unless-stopped",
        },
    }
    for g, name in zip(plan.expert_groups, groups):
        services[name] = _compose_service(
            plan,
            name,
            expert_command(plan, g, str(g.port), []),
            g.port,
            g.replicas,
            [],
            "60s",
            g.resources,
            g.device,
        )
    r = plan.router
    services["router"] = _compose_service(
        plan,
        "router",
        router_command(plan, str(r.port), []),
        r.port,
        r.replicas,
        groups,
        "120s",
        r.resources,
        r.device,
    )
    gw = plan.gateway
    gateway = _compose_service(
        plan,
        "gateway",
        gateway_command(plan),
        gw.grpc_port,
        gw.replicas,
        ["router"],
        "60s",
        gw.resources,
    )
    # One replica publishes fixed host ports; several would collide, so Docker picks host ports for them.
    gateway["ports"] = [
        f"{p}:{p}" if gw.replicas == 1 else str(p) for p in (gw.grpc_port, gw.http_port)
    ]
    services["gateway"] = gateway
    services["prometheus"] = {
        "image": "${PROMETHEUS_IMAGE:-" + _dollar(plan.compose.prometheus_image) + "}",
        "command": ["--config.file=/etc/prometheus/prometheus.yml"],
        "volumes": ["./prometheus.yml:/etc/prometheus/prometheus.yml:ro"],
        "ports": ["127.0.0.1:9090:9090"],  # the UI and PromQL API, on the Docker host's loopback
        "restart": "unless-stopped",
    }
    head = "".join(f"# {line}\n" for line in wrap(HEADER.format(target="compose")))
    document: dict[str, Any] = {"services": services}
    if secrets.secure(plan):
        document["secrets"] = _compose_secrets(plan, [*groups, "router", "gateway"])
    dumped = yaml.safe_dump(document, sort_keys=True, default_flow_style=False, width=1000)
    compose = head + _autoscale_note(plan) + dumped
    # Docker's DNS answers a service name with every replica's address.
    scrape = [dns_job(name, name) for name in [*groups, "router", "gateway"]]
    return {
        "docker-compose.yml": compose,
        ".env.example": _env_example(plan),
        "prometheus.yml": head + prometheus_yml(scrape),
    }


def _autoscale_note(plan: Plan) -> str:
    """Compose has no autoscaler of its own: groups with `autoscale` are scaled by the local
    controller, which runs `docker compose up --scale` on the load Prometheus measures."""
    groups = [f"{EXPERT_SERVICE_PREFIX}{g.name}" for g in plan.expert_groups if g.autoscale]
    if not groups:
        return ""
    text = (
        f"Autoscaled groups ({', '.join(groups)}; `deploy.replicas` is their starting count): "
        "run `moe-mesh autoscale --compose-file docker-compose.yml --prometheus "
        "http://127.0.0.1:9090 --plan <this plan>` beside the project "
        "(docs/operating/autoscaling.md)."
    )
    return "#\n" + "".join(f"# {line}\n" for line in wrap(text))


def wrap(text: str, width: int = 100) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def _token_or_secrets(plan: Plan) -> str:
    if not secrets.secure(plan):
        return "CONSUL_HTTP_TOKEN=\n"
    made = []
    if plan.security.tls:
        made.append(
            f"#   moe-mesh certs --out secrets --host {plan.security.server_name}   "
            "(CA, and a certificate per kind of service)"
        )
    if plan.security.api_keys:
        made.append("#   secrets/api-keys   one key per line (docs/operating/security.md)")
    return "\n".join(
        [
            "# Secrets are files under ./secrets (docker-compose mounts each where its service",
            "# reads it; nothing secret goes in this file). Create them next to docker-compose.yml:",
            *made,
            "#   secrets/consul-token   the Consul ACL token (may be empty)",
            "# and make them readable by the image's user (uid 10001).",
            "",
        ]
    )


def _env_example(plan: Plan) -> str:
    return f"""\
{"".join(f"# {line}{chr(10)}" for line in wrap(HEADER.format(target="compose")))}\
# Copy it to .env next to docker-compose.yml and edit the copy; docker-compose reads .env by itself.

# Checkpoint directory on the Docker host (HuggingFace layout: config.json, *.safetensors, tokenizer.json).
# Every moe-mesh container mounts it read-only at {plan.model.checkpoint}.
MODEL_DIR=/srv/models/{plan.model.model_id.replace("/", "-")}

# The moe-mesh image: docker build -f deploy/compose/Dockerfile -t {plan.image} .
MOE_MESH_IMAGE={plan.image}

# Consul: the compose file runs a dev agent (no ACLs). To register with your own Consul instead,
# point CONSUL_HTTP_ADDR at its agent and put an ACL token allowed to register services here.
CONSUL_IMAGE={plan.compose.consul_image}
CONSUL_HTTP_ADDR=consul:8500
{_token_or_secrets(plan)}
# Traces: every service exports spans over OTLP once this names a collector (e.g. http://otel:4317),
# sampling this share of new requests. Metrics: Prometheus (service `prometheus`, prometheus.yml)
# scrapes every replica on port {METRICS_PORT}; its UI is on this host's 127.0.0.1:9090.
OTEL_EXPORTER_OTLP_ENDPOINT=
OTEL_TRACES_SAMPLER_ARG=0.01
PROMETHEUS_IMAGE={plan.compose.prometheus_image}
"""
