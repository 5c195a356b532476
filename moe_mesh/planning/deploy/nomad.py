"""The nomad target: one HCL job file per expert group and one for routers and gateways; a group
with `autoscale` gets a `scaling` block, and the Nomad Autoscaler its agent configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.device import is_cuda
from moe_mesh.autoscale import queries
from moe_mesh.autoscale.queries import number
from moe_mesh.planning.deploy import secrets
from moe_mesh.planning.deploy.compose import (
    HEADER,
    expert_command,
    gateway_command,
    router_command,
    wrap,
)
from moe_mesh.planning.deploy.plan import Constraint, ExpertGroup, Plan, Resources
from moe_mesh.planning.deploy.prometheus import consul_job, prometheus_yml


class Interp(str):
    """An HCL string whose ${...} is a Nomad interpolation on purpose (plain strings get it escaped)."""


@dataclass
class Block:
    type: str
    labels: tuple[str, ...] = ()
    body: list[tuple[str, Any] | Block] = field(default_factory=list)


def _hcl_str(s: str) -> str:
    text = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    if not isinstance(s, Interp):
        text = text.replace("${", "$${").replace("%{", "%%{")
    return f'"{text}"'


def _hcl_value(v: Any, indent: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return number(v)
    if isinstance(v, str):
        return _hcl_str(v)
    if isinstance(v, dict):  # an object (the autoscaler's plugin `config = {...}`)
        return "{\n" + "\n".join(_hcl_body(list(v.items()), indent + "  ")) + f"\n{indent}}}"
    items = [_hcl_value(x, indent + "  ") for x in v]
    inline = "[" + ", ".join(items) + "]"
    if len(inline) <= 60:
        return inline
    return "[\n" + "".join(f"{indent}  {x},\n" for x in items) + f"{indent}]"


def _hcl_body(body: list, indent: str) -> list[str]:
    """Attributes first (consecutive one-liners aligned on '=', like `nomad fmt`), then blocks, blank-separated."""
    attrs = [(k, _hcl_value(v, indent)) for k, v in (x for x in body if not isinstance(x, Block))]
    blocks = [x for x in body if isinstance(x, Block)]
    width = max((len(k) for k, v in attrs if "\n" not in v), default=0)
    lines = [f"{indent}{k.ljust(width) if chr(10) not in v else k} = {v}" for k, v in attrs]
    for b in blocks:
        if lines:
            lines.append("")
        lines += _hcl_block(b, indent)
    return lines


def _hcl_block(b: Block, indent: str = "") -> list[str]:
    head = " ".join([b.type, *(_hcl_str(label) for label in b.labels)])
    if not b.body:
        return [f"{indent}{head} {{}}"]
    return [f"{indent}{head} {{", *_hcl_body(b.body, indent + "  "), f"{indent}}}"]


def _hcl_file(job: Block) -> str:
    head = "".join(f"# {line}\n" for line in wrap(HEADER.format(target="nomad")))
    return head + "\n".join(_hcl_block(job)) + "\n"


_UPDATE = Block(
    "update",
    body=[
        ("max_parallel", 1),
        ("health_check", "checks"),
        ("min_healthy_time", "10s"),
        ("healthy_deadline", "5m"),
        ("progress_deadline", "10m"),
        ("auto_revert", True),
    ],
)


def _job(
    plan: Plan, name: str, region: str, datacenters: list[str] | None, groups: list[Block]
) -> Block:
    body: list = [("type", "service"), ("datacenters", datacenters or plan.nomad.datacenters)]
    if region:
        body.insert(0, ("region", region))
    return Block("job", (name,), [*body, _UPDATE, *groups])


def _check(name: str, port: str, kind: str = "grpc", path: str = "") -> Block:
    body: list = [
        ("name", name),
        ("type", kind),
        ("port", port),
        ("interval", "10s"),
        ("timeout", "3s"),
    ]
    if path:
        body.append(("path", path))
    return Block("check", body=body)


def _service(name: str, port: str, tags: list[str], meta: dict[str, str], check: Block) -> Block:
    body: list = [("name", name), ("port", port), ("provider", "consul"), ("tags", tags)]
    if meta:
        body.append(Block("meta", body=sorted(meta.items())))
    return Block("service", body=[*body, check])


def _group(
    plan: Plan,
    name: str,
    count: int,
    constraints: list[Constraint],
    ports: list[Block],
    services: list[Block],
    task: Block,
    metrics_service: str,
) -> Block:
    """A task group; every one also gets a `metrics` port, registered in Consul as `metrics_service`
    (tagged prometheus) for the scrape configuration's consul_sd."""
    ports = [*ports, Block("port", ("metrics",))]
    services = [
        *services,
        _service(
            metrics_service,
            "metrics",
            ["moe-mesh", "prometheus"],
            {},
            _check("metrics", "metrics", "http", "/metrics"),
        ),
    ]
    body: list = [("count", count)]
    body += [
        Block(
            "constraint",
            body=[
                ("attribute", Interp(c.attribute)),
                ("operator", c.operator),
                ("value", Interp(c.value)),
            ],
        )
        for c in constraints
    ]
    body.append(Block("network", body=ports))
    body.append(
        Block(
            "volume",
            ("model",),
            [("type", "host"), ("source", plan.nomad.model_volume), ("read_only", True)],
        )
    )
    body += services
    body.append(
        Block(
            "restart",
            body=[("attempts", 3), ("interval", "5m"), ("delay", "15s"), ("mode", "delay")],
        )
    )
    body.append(task)
    return Block("group", (name,), body)


# The Nomad Autoscaler agent's configuration, rendered when a group autoscales.
AUTOSCALER_CONFIG = "nomad-autoscaler.hcl"
SECRETS = "${NOMAD_SECRETS_DIR}"  # the task's private directory, where templates render secrets


def _interp(words: list[str]) -> list[str]:
    """Words that name a Nomad variable on purpose keep their ${...}."""
    return [Interp(w) if "${NOMAD_" in w else w for w in words]


def _variable_item(component: str, file: str) -> str:
    """The item of the job's Nomad Variable (nomad/jobs/<job>) a secret file comes from:
    tls_ca, <kind>_tls_cert, <kind>_tls_key, api_keys, consul_token."""
    item = file.removesuffix(".pem").replace("-", "_")
    return f"{secrets.kind(component)}_{item}" if file in (secrets.CERT, secrets.KEY) else item


def _templates(plan: Plan, job: str, component: str) -> list[Block]:
    """Each secret file, rendered from the job's Nomad Variable into the task's secrets dir,
    readable by the image's user only; a changed secret restarts the task."""
    return [
        Block(
            "template",
            body=[
                (
                    "data",
                    f'{{{{ with nomadVar "nomad/jobs/{job}" }}}}'
                    f"{{{{ .{_variable_item(component, f)} }}}}{{{{ end }}}}",
                ),
                ("destination", f"secrets/{f}"),
                ("perms", "0400"),
                ("uid", 10001),
                ("gid", 10001),
                ("change_mode", "restart"),
            ],
        )
        for f in secrets.files(plan, component)
    ]


def _health_check(plan: Plan, task: str) -> Block:
    """Consul's gRPC check speaks plaintext unless its agent has the mesh's certificate: under TLS
    the check is `moe-mesh probe` inside the task, presenting the task's own certificate."""
    if not plan.security.tls:
        return _check("grpc health", "grpc")
    probe = _interp(secrets.probe(plan, "${NOMAD_PORT_grpc}", SECRETS))
    return Block(
        "check",
        body=[
            ("name", "grpc health"),
            ("type", "script"),
            ("task", task),
            ("command", probe[0]),
            ("args", probe[1:]),
            ("interval", "10s"),
            ("timeout", "5s"),
        ],
    )


def _ready_check(plan: Plan) -> Block:
    check = _check("http ready", "http", "http", "/health/ready")
    if plan.security.tls:  # HTTPS from the mesh's private CA, which Consul's agent does not know;
        # the check reads a status and sends nothing secret
        check.body += [("protocol", "https"), ("tls_skip_verify", True)]
    return check


def _resources(resources: Resources, device: str) -> Block:
    """The task's CPU and memory, and on CUDA one NVIDIA GPU from the client's device plugin. Nomad
    picks which (cuda:N's index means nothing to it); the task sees that one as its device 0,
    which `--device cuda` (compose.device_flags) uses."""
    body: list = [("cpu", resources.cpu_mhz), ("memory", resources.memory_mb)]
    if is_cuda(device):
        body.append(Block("device", ("nvidia/gpu",), [("count", 1)]))
    return Block("resources", body=body)


def _task(
    plan: Plan,
    name: str,
    args: list[str],
    resources: Resources,
    component: str,
    job: str,
    device: str = "cpu",
) -> Block:
    args = [
        *args,
        *_interp(secrets.flags(plan, component, SECRETS)),
        "--metrics-port",
        Interp("${NOMAD_PORT_metrics}"),
    ]
    config = Block("config", body=[("image", plan.image), ("network_mode", "host"), ("args", args)])
    mount = Block(
        "volume_mount",
        body=[("volume", "model"), ("destination", plan.model.checkpoint), ("read_only", True)],
    )
    env = Block(
        "env",
        body=[
            ("CONSUL_HTTP_ADDR", plan.nomad.consul_http_addr),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", plan.nomad.otlp_endpoint),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                f"service.namespace={plan.name},moe_mesh.component={component}",
            ),
            ("OTEL_TRACES_SAMPLER_ARG", "0.01"),
            *(
                [("CONSUL_HTTP_TOKEN_FILE", Interp(f"{SECRETS}/{secrets.CONSUL_TOKEN}"))]
                if secrets.secure(plan)
                else []
            ),
        ],
    )
    res = _resources(resources, device)
    return Block(
        "task",
        (name,),
        [
            ("driver", "docker"),
            ("kill_signal", "SIGTERM"),
            ("kill_timeout", "20s"),
            config,
            mount,
            env,
            res,
            *_templates(plan, job, component),
        ],
    )


# Host networking: the process binds the port Nomad allocated and registers the node's address in
# Consul itself, so the address other nodes dial is the one it advertises.
_DYNAMIC = ["--advertise-host", Interp("${NOMAD_IP_grpc}")]


def _expert_job(plan: Plan, g: ExpertGroup) -> Block:
    args = expert_command(plan, g, Interp("${NOMAD_PORT_grpc}"), _DYNAMIC)
    meta = {"experts": g.experts, "model_id": plan.model.model_id, "expert_group": g.name}
    if g.region:
        meta["region"] = g.region
    # Named after the job: never mixed up with the instances the process registers itself (with the
    # weights checksum and served experts in their metadata), which are what routers discover.
    job = f"{plan.name}-experts-{g.name}"
    service = _service(
        job,
        "grpc",
        ["moe-mesh", f"expert-group:{g.name}"],
        meta,
        _health_check(plan, "serve-expert"),
    )
    group = _group(
        plan,
        "experts",
        g.replicas,
        g.constraints,
        [Block("port", ("grpc",))],
        [service],
        _task(plan, "serve-expert", args, g.resources, f"expert-{g.name}", job, g.device),
        f"{job}-metrics",
    )
    if g.autoscale is not None:
        group.body.insert(1, _scaling(g))
    return _job(plan, job, g.region, g.datacenters, [group])


def _scaling(g: ExpertGroup) -> Block:
    """The group's policy for the Nomad Autoscaler, through its Prometheus APM: HPA's algorithm as
    two checks of one check group. Within a group the autoscaler ignores `none` votes and prefers
    up over down, so the scale-up check (clamped at the target: it never asks for fewer) wins when
    the load is over the target for the scale-up window, else the scale-down check (clamped the
    other way, held by the TPOT guard) may remove replicas once the scale-down window is under."""
    a = g.autoscale
    assert a is not None
    job = f"experts-{g.name}"  # the rendered Prometheus job (render_nomad)

    def check(name: str, query: str) -> Block:
        # target-value takes only these: no step limits (max_step_up/down are HPA's and ours)
        limits = [("target", a.level), ("threshold", a.tolerance)]
        body = [("source", "prometheus"), ("query", query), ("group", a.metric)]
        return Block("check", (name,), [*body, Block("strategy", ("target-value",), limits)])

    policy = [
        ("evaluation_interval", f"{number(a.interval_s)}s"),
        # A step period per change, either way (policy.py's cool-down).
        ("cooldown", f"{number(a.step_period_s)}s"),
        ("cooldown_on_scale_up", f"{number(a.step_period_s)}s"),
        check(f"{a.metric}_up", queries.scale_up_query(a, job)),
        check(f"{a.metric}_down", queries.scale_down_query(a, job, "gateway")),
    ]
    limits = [("enabled", True), ("min", a.min_replicas), ("max", a.max_replicas)]
    return Block("scaling", body=[*limits, Block("policy", body=policy)])


def autoscaler_config(plan: Plan) -> str:
    """nomad-autoscaler.hcl: the agent that applies every group's `scaling` policy, reading
    Prometheus (the rendered prometheus.yml's jobs) and changing counts through Nomad's API."""
    blocks = [
        Block("nomad", body=[("address", plan.nomad.nomad_addr)]),
        Block(
            "apm",
            ("prometheus",),
            [("driver", "prometheus"), ("config", {"address": plan.nomad.prometheus_addr})],
        ),
        Block("strategy", ("target-value",), [("driver", "target-value")]),
    ]
    head = "".join(f"# {line}\n" for line in wrap(HEADER.format(target="nomad")))
    return head + "\n\n".join("\n".join(_hcl_block(b)) for b in blocks) + "\n"


def _frontend_job(plan: Plan) -> Block:
    r, gw = plan.router, plan.gateway
    job = f"{plan.name}-frontend"
    router = _group(
        plan,
        "router",
        r.replicas,
        r.constraints,
        [Block("port", ("grpc",))],
        [
            _service(
                f"{plan.name}-routers",
                "grpc",
                ["moe-mesh"],
                {},
                _health_check(plan, "serve-router"),
            )
        ],
        _task(
            plan,
            "serve-router",
            router_command(plan, Interp("${NOMAD_PORT_grpc}"), _DYNAMIC),
            r.resources,
            "router",
            job,
            r.device,
        ),
        f"{plan.name}-routers-metrics",
    )
    ports = [
        Block("port", ("grpc",), [("static", gw.grpc_port)]),
        Block("port", ("http",), [("static", gw.http_port)]),
    ]
    services = [
        _service(
            f"{plan.name}-gateway", "grpc", ["moe-mesh"], {}, _health_check(plan, "serve-gateway")
        ),
        _service(
            f"{plan.name}-gateway-http",
            "http",
            ["moe-mesh", "openai"],
            {},
            _ready_check(plan),
        ),
    ]
    gateway = _group(
        plan,
        "gateway",
        gw.replicas,
        gw.constraints,
        ports,
        services,
        _task(plan, "serve-gateway", gateway_command(plan), gw.resources, "gateway", job),
        f"{plan.name}-gateway-metrics",
    )
    return _job(plan, job, r.region, r.datacenters, [router, gateway])


def render_nomad(plan: Plan) -> dict[str, str]:
    """One <name>-experts-<group>.nomad.hcl per expert group and <name>-frontend.nomad.hcl (routers + gateway)."""
    files = {
        f"{plan.name}-experts-{g.name}.nomad.hcl": _hcl_file(_expert_job(plan, g))
        for g in plan.expert_groups
    }
    files[f"{plan.name}-frontend.nomad.hcl"] = _hcl_file(_frontend_job(plan))
    components = [f"experts-{g.name}" for g in plan.expert_groups] + ["routers", "gateway"]
    scrape = [
        consul_job(c, f"{plan.name}-{c}-metrics", plan.nomad.consul_http_addr) for c in components
    ]
    head = "".join(f"# {line}\n" for line in wrap(HEADER.format(target="nomad")))
    files["prometheus.yml"] = head + prometheus_yml(scrape)
    if any(g.autoscale is not None for g in plan.expert_groups):
        files[AUTOSCALER_CONFIG] = autoscaler_config(plan)
    return dict(sorted(files.items()))
