"""`moe-mesh deploy render` and `moe-mesh probe`: real deployments rendered from a plan, and their health probe.

A plan (YAML, see deploy/plan.example.yaml) names the image, the checkpoint, the gateway and router
replicas and the expert groups (an expert spec each, see common/placement.py). `render` turns it into
  compose: one docker-compose.yml (a Consul dev agent, gateway, router, one service per expert group,
           `deploy.replicas` each), a Dockerfile and a .env.example;
  nomad:   one job per expert group, and one job with the router and gateway groups.
Every service runs with `--registry consul`: routers find expert services and gateways find routers
there, so the rendered files list no addresses. Output is deterministic (sorted keys, fixed order),
so committed examples can be compared byte for byte with a fresh render.

Imports neither torch nor grpc at import time: `probe` runs as a container health check every few seconds.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from common.errors import InvalidArgumentError, MoeMeshError
from common.placement import Pair, format_experts, parse_experts

TARGETS = ("compose", "nomad")
HEADER = ("Rendered by `moe-mesh deploy render --target {target}` from a deploy plan. "
          "Do not edit: change the plan and render again.")
EXPERT_SERVICE_PREFIX = "expert-"  # compose service of group G: expert-G
_MAX_INDEX = 65535  # an expert spec index beyond this is a typo, not a model

Name = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$",
                            description="lower-case letters, digits and '-', at most 40 characters")]
Port = Annotated[int, Field(ge=1, le=65535)]
Region = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]*$", max_length=64)]
Datacenters = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class PlanError(MoeMeshError):
    """A plan file cannot be read or is invalid; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """Nomad task resources (compose leaves sizing to the host)."""

    cpu_mhz: int = Field(ge=100, description="CPU share in MHz")
    memory_mb: int = Field(ge=64, description="memory limit in MiB")


class Constraint(_Strict):
    """A Nomad placement constraint, e.g. {attribute: "${node.class}", value: "expert"}."""

    attribute: str = Field(min_length=1)
    operator: str = "="
    value: str = ""


class ModelPlan(_Strict):
    checkpoint: str = Field(description="absolute path of the checkpoint directory inside every container; "
                                        "compose mounts $MODEL_DIR there, Nomad the host volume `nomad.model_volume`")
    model_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._/-]+$", description="model id routers and experts share")
    num_layers: int | None = Field(None, ge=1, le=_MAX_INDEX, description="decoder layers; with num_experts, "
                                   "render checks that the expert groups cover every (layer, expert)")
    num_experts: int | None = Field(None, ge=1, le=_MAX_INDEX, description="routed experts per layer")

    @field_validator("checkpoint")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(f"must be an absolute directory path inside the container, e.g. /models/mixtral, "
                             f"not {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _both_sizes(self) -> ModelPlan:
        if (self.num_layers is None) != (self.num_experts is None):
            raise ValueError("give both num_layers and num_experts (for the coverage check) or neither")
        return self


class GatewayPlan(_Strict):
    replicas: int = Field(1, ge=1, le=64)
    grpc_port: Port = Field(50050, description="public gRPC port (container port; compose also publishes it)")
    http_port: Port = Field(8000, description="OpenAI-compatible HTTP port")
    constraints: list[Constraint] = Field(default_factory=list, description="Nomad placement of the gateway group")
    resources: Resources = Resources(cpu_mhz=500, memory_mb=1024)
    args: list[str] = Field(default_factory=list, description="extra serve-gateway flags")

    @model_validator(mode="after")
    def _distinct_ports(self) -> GatewayPlan:
        if self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port and http_port are both {self.grpc_port}")
        return self


class RouterPlan(_Strict):
    replicas: int = Field(1, ge=1, le=64)
    port: Port = Field(50051, description="gRPC port in the container (Nomad picks a host port)")
    region: Region = Field("", description="Nomad region of the router + gateway job")
    datacenters: Datacenters | None = None
    constraints: list[Constraint] = Field(default_factory=list)
    resources: Resources = Resources(cpu_mhz=2000, memory_mb=4096)
    args: list[str] = Field(default_factory=list, description="extra serve-router flags")


class ExpertGroup(_Strict):
    name: Name
    experts: str = Field(description="expert spec, e.g. '*:0-3' (grammar in common/placement.py)")
    replicas: int = Field(1, ge=1, le=256)
    region: Region = Field("", description="serve-expert --region (routers prefer their own region) and the "
                                           "Nomad job's region; empty: neither")
    datacenters: Datacenters | None = None
    constraints: list[Constraint] = Field(default_factory=list)
    port: Port = Field(50061, description="gRPC port in the container (Nomad picks a host port)")
    compute_threads: int | None = Field(None, ge=1, le=1024, description="serve-expert --compute-threads")
    resources: Resources = Resources(cpu_mhz=2000, memory_mb=4096)
    args: list[str] = Field(default_factory=list, description="extra serve-expert flags")

    @field_validator("experts")
    @classmethod
    def _spec_syntax(cls, v: str) -> str:
        expert_pairs(v)
        return v


class ComposePlan(_Strict):
    consul_image: str = Field("hashicorp/consul:1.20", min_length=1, description="image of the Consul dev agent")


class NomadPlan(_Strict):
    datacenters: Datacenters = Field(default_factory=lambda: ["dc1"], description="default datacenters of every job")
    model_volume: Name = Field("moe-mesh-model", description="Nomad client host_volume holding the checkpoint")
    consul_http_addr: str = Field("127.0.0.1:8500", min_length=1,
                                  description="the node's Consul agent as tasks on host networking see it")


class Plan(_Strict):
    """Everything `deploy render` needs; unknown keys are errors (typos fail loudly)."""

    name: Name = Field("moe-mesh", description="prefix of Nomad job names and of their Consul service names")
    image: str = Field(min_length=1, description="the moe-mesh image, e.g. moe-mesh:0.1.0")
    model: ModelPlan
    gateway: GatewayPlan = GatewayPlan()
    router: RouterPlan = RouterPlan()
    expert_groups: list[ExpertGroup] = Field(min_length=1)
    compose: ComposePlan = ComposePlan()
    nomad: NomadPlan = NomadPlan()

    @field_validator("expert_groups")
    @classmethod
    def _groups(cls, groups: list[ExpertGroup], info: ValidationInfo) -> list[ExpertGroup]:
        seen: set[str] = set()
        for g in groups:
            if g.name in seen:
                raise ValueError(f"duplicate group name {g.name!r}; names must be unique")
            seen.add(g.name)
        model = info.data.get("model")
        if model is not None and model.num_layers is not None:
            _check_coverage(groups, model.num_layers, model.num_experts)
        return groups


def _check_coverage(groups: list[ExpertGroup], num_layers: int, num_experts: int) -> None:
    served: set[Pair] = set()
    for g in groups:
        try:
            served.update(expert_pairs(g.experts, num_layers, num_experts))
        except ValueError as e:
            raise ValueError(f"group {g.name!r} experts {g.experts!r}: {e}") from None
    missing = sorted({(la, e) for la in range(num_layers) for e in range(num_experts)} - served)
    if missing:
        raise ValueError(f"no group serves {format_experts(missing)!r} (LAYERS:EXPERTS) of the "
                         f"{num_layers} layers x {num_experts} experts in `model`")


@dataclass(frozen=True)
class _Bounds:
    """The two sizes parse_experts reads from a ModelSpec; every layer counts as a MoE layer."""

    num_layers: int
    num_experts: int

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return (True,) * self.num_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.num_layers))


def expert_pairs(spec: str, num_layers: int | None = None, num_experts: int | None = None) -> list[Pair]:
    """The pairs an expert spec names, parsed by the same code the services use.

    Without the model's sizes only the syntax is checked: the bounds are then the largest index in the text.
    Raises ValueError with the parser's message.
    """
    if num_layers is None or num_experts is None:
        biggest = max((int(n) for n in re.findall(r"\d+", spec)), default=0)
        if biggest > _MAX_INDEX:
            raise ValueError(f"index {biggest} in {spec!r} is larger than {_MAX_INDEX}")
        num_layers = num_experts = biggest + 1
    try:
        return parse_experts(spec, _Bounds(num_layers, num_experts))  # type: ignore[arg-type]
    except InvalidArgumentError as e:
        raise ValueError(str(e).removeprefix(f"{e.field}: ")) from None


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(plan)"


def load_plan(path: Path) -> Plan:
    """Read and validate a plan file; every problem is reported as 'FILE: field.path: message'."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read the plan ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a mapping with image, model, expert_groups, ...")
    try:
        return Plan.model_validate(raw)
    except ValidationError as e:
        lines = [f"{_loc(err['loc'])}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors()]
        raise PlanError(f"{path}: " + "\n  ".join(lines)) from None


# ---------------------------------------------------------------------------------------------- compose

def _dollar(s: str) -> str:
    """A plan value as compose text: '$' would start an interpolation."""
    return s.replace("$", "$$")


def _compose_healthcheck(port: int, start_period: str) -> dict[str, Any]:
    return {"test": ["CMD", "moe-mesh", "probe", f"127.0.0.1:{port}"], "interval": "10s", "timeout": "5s",
            "retries": 3, "start_period": start_period}


def _compose_service(plan: Plan, command: list[str], port: int, replicas: int,
                     depends_on: Iterable[str], start_period: str) -> dict[str, Any]:
    return {
        "image": "${MOE_MESH_IMAGE:-" + _dollar(plan.image) + "}",
        "command": [_dollar(c) for c in command],
        "environment": {"CONSUL_HTTP_ADDR": "${CONSUL_HTTP_ADDR:-consul:8500}",
                        "CONSUL_HTTP_TOKEN": "${CONSUL_HTTP_TOKEN:-}"},
        "volumes": ["${MODEL_DIR:?set MODEL_DIR to the checkpoint directory on this host}:"
                    f"{_dollar(plan.model.checkpoint)}:ro"],
        "expose": [str(port)],
        "deploy": {"replicas": replicas},
        "healthcheck": _compose_healthcheck(port, start_period),
        "depends_on": {name: {"condition": "service_healthy"} for name in ["consul", *depends_on]},
        "restart": "unless-stopped",
        "stop_grace_period": "20s",  # services drain in-flight calls for up to 10 s after SIGTERM
    }


def _expert_command(plan: Plan, g: ExpertGroup, port: str, extra: list[str]) -> list[str]:
    cmd = ["serve-expert", "--checkpoint", plan.model.checkpoint, "--model-id", plan.model.model_id,
           "--experts", g.experts, "--registry", "consul", "--host", "0.0.0.0", "--port", port, *extra]
    if g.region:
        cmd += ["--region", g.region]
    if g.compute_threads:
        cmd += ["--compute-threads", str(g.compute_threads)]
    return cmd + g.args


def _router_command(plan: Plan, port: str, extra: list[str]) -> list[str]:
    return ["serve-router", "--checkpoint", plan.model.checkpoint, "--model-id", plan.model.model_id,
            "--registry", "consul", "--host", "0.0.0.0", "--port", port, *extra, *plan.router.args]


def _gateway_command(plan: Plan) -> list[str]:
    gw = plan.gateway
    return ["serve-gateway", "--checkpoint", plan.model.checkpoint, "--registry", "consul", "--host", "0.0.0.0",
            "--grpc-port", str(gw.grpc_port), "--http-port", str(gw.http_port), *gw.args]


def render_compose(plan: Plan) -> dict[str, str]:
    """docker-compose.yml, Dockerfile and .env.example."""
    groups = [f"{EXPERT_SERVICE_PREFIX}{g.name}" for g in plan.expert_groups]
    services: dict[str, Any] = {
        "consul": {
            "image": "${CONSUL_IMAGE:-" + _dollar(plan.compose.consul_image) + "}",
            "command": ["agent", "-dev", "-client", "0.0.0.0"],
            "ports": ["127.0.0.1:8500:8500"],  # UI and API for the operator, on the Docker host's loopback only
            "healthcheck": {"test": ["CMD", "consul", "members"], "interval": "2s", "timeout": "3s", "retries": 30},
            "restart": "unless-stopped",
        },
    }
    for g, name in zip(plan.expert_groups, groups):
        services[name] = _compose_service(plan, _expert_command(plan, g, str(g.port), []), g.port, g.replicas,
                                          [], "60s")
    r = plan.router
    services["router"] = _compose_service(plan, _router_command(plan, str(r.port), []), r.port, r.replicas,
                                          groups, "120s")
    gw = plan.gateway
    gateway = _compose_service(plan, _gateway_command(plan), gw.grpc_port, gw.replicas, ["router"], "60s")
    # One replica publishes fixed host ports; several would collide, so Docker picks host ports for them.
    gateway["ports"] = [f"{p}:{p}" if gw.replicas == 1 else str(p) for p in (gw.grpc_port, gw.http_port)]
    services["gateway"] = gateway
    head = "".join(f"# {line}\n" for line in _wrap(HEADER.format(target="compose")))
    compose = head + yaml.safe_dump({"services": services}, sort_keys=True, default_flow_style=False, width=1000)
    return {"docker-compose.yml": compose, "Dockerfile": DOCKERFILE, ".env.example": _env_example(plan)}


def _wrap(text: str, width: int = 100) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


DOCKERFILE = """\
# The moe-mesh image every compose service and Nomad task runs. Build from the repository root:
#   docker build -f deploy/compose/Dockerfile -t moe-mesh:0.1.0 .
# Dependencies install pinned by constraints.txt. Which torch wheel the image gets is a deployment
# choice: PyPI's Linux torch wheel bundles CUDA (several GB); for a CPU-only image, pass PyTorch's
# CPU wheel index as a build argument: --build-arg TORCH_INDEX_URL=<index url>.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \\
    PYTHONUNBUFFERED=1 \\
    PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/moe-mesh
COPY pyproject.toml constraints.txt README.md ./
COPY common ./common
COPY protos ./protos
COPY expert_service ./expert_service
COPY router_service ./router_service
COPY gateway ./gateway
COPY moe_mesh ./moe_mesh
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -c constraints.txt . \\
    && rm -rf /root/.cache

# The checkpoint is mounted read-only (compose: $MODEL_DIR; Nomad: a host volume).
RUN useradd --system --uid 10001 --no-create-home moe
USER 10001
ENTRYPOINT ["moe-mesh"]
CMD ["--help"]
"""


def _env_example(plan: Plan) -> str:
    return f"""\
{"".join(f"# {line}{chr(10)}" for line in _wrap(HEADER.format(target="compose")))}\
# Copy it to .env next to docker-compose.yml and edit the copy; docker-compose reads .env by itself.

# Checkpoint directory on the Docker host (HuggingFace layout: config.json, *.safetensors, tokenizer.json).
# Every moe-mesh container mounts it read-only at {plan.model.checkpoint}.
MODEL_DIR=/srv/models/{plan.model.model_id.replace('/', '-')}

# The moe-mesh image: docker build -f deploy/compose/Dockerfile -t {plan.image} .
MOE_MESH_IMAGE={plan.image}

# Consul: the compose file runs a dev agent (no ACLs). To register with your own Consul instead,
# point CONSUL_HTTP_ADDR at its agent and put an ACL token allowed to register services here.
CONSUL_IMAGE={plan.compose.consul_image}
CONSUL_HTTP_ADDR=consul:8500
CONSUL_HTTP_TOKEN=
"""


# ---------------------------------------------------------------------------------------------- nomad

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
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _hcl_str(v)
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
    head = "".join(f"# {line}\n" for line in _wrap(HEADER.format(target="nomad")))
    return head + "\n".join(_hcl_block(job)) + "\n"


_UPDATE = Block("update", body=[("max_parallel", 1), ("health_check", "checks"), ("min_healthy_time", "10s"),
                                ("healthy_deadline", "5m"), ("progress_deadline", "10m"), ("auto_revert", True)])


def _job(plan: Plan, name: str, region: str, datacenters: list[str] | None, groups: list[Block]) -> Block:
    body: list = [("type", "service"), ("datacenters", datacenters or plan.nomad.datacenters)]
    if region:
        body.insert(0, ("region", region))
    return Block("job", (name,), [*body, _UPDATE, *groups])


def _check(name: str, port: str, kind: str = "grpc", path: str = "") -> Block:
    body: list = [("name", name), ("type", kind), ("port", port), ("interval", "10s"), ("timeout", "3s")]
    if path:
        body.append(("path", path))
    return Block("check", body=body)


def _service(name: str, port: str, tags: list[str], meta: dict[str, str], check: Block) -> Block:
    body: list = [("name", name), ("port", port), ("provider", "consul"), ("tags", tags)]
    if meta:
        body.append(Block("meta", body=sorted(meta.items())))
    return Block("service", body=[*body, check])


def _group(plan: Plan, name: str, count: int, constraints: list[Constraint], ports: list[Block],
           services: list[Block], task: Block) -> Block:
    body: list = [("count", count)]
    body += [Block("constraint", body=[("attribute", Interp(c.attribute)), ("operator", c.operator),
                                       ("value", Interp(c.value))]) for c in constraints]
    body.append(Block("network", body=ports))
    body.append(Block("volume", ("model",), [("type", "host"), ("source", plan.nomad.model_volume),
                                             ("read_only", True)]))
    body += services
    body.append(Block("restart", body=[("attempts", 3), ("interval", "5m"), ("delay", "15s"), ("mode", "delay")]))
    body.append(task)
    return Block("group", (name,), body)


def _task(plan: Plan, name: str, args: list[str], resources: Resources) -> Block:
    config = Block("config", body=[("image", plan.image), ("network_mode", "host"), ("args", args)])
    mount = Block("volume_mount", body=[("volume", "model"), ("destination", plan.model.checkpoint),
                                        ("read_only", True)])
    env = Block("env", body=[("CONSUL_HTTP_ADDR", plan.nomad.consul_http_addr)])
    res = Block("resources", body=[("cpu", resources.cpu_mhz), ("memory", resources.memory_mb)])
    return Block("task", (name,), [("driver", "docker"), ("kill_signal", "SIGTERM"), ("kill_timeout", "20s"),
                                   config, mount, env, res])


# Host networking: the process binds the port Nomad allocated and registers the node's address in
# Consul itself, so the address other nodes dial is the one it advertises.
_DYNAMIC = ["--advertise-host", Interp("${NOMAD_IP_grpc}")]


def _expert_job(plan: Plan, g: ExpertGroup) -> Block:
    args = _expert_command(plan, g, Interp("${NOMAD_PORT_grpc}"), _DYNAMIC)
    meta = {"experts": g.experts, "model_id": plan.model.model_id, "expert_group": g.name}
    if g.region:
        meta["region"] = g.region
    # Named after the job: never mixed up with the instances the process registers itself (with the
    # weights checksum and served experts in their metadata), which are what routers discover.
    job = f"{plan.name}-experts-{g.name}"
    service = _service(job, "grpc", ["moe-mesh", f"expert-group:{g.name}"], meta,
                       _check("grpc health", "grpc"))
    group = _group(plan, "experts", g.replicas, g.constraints, [Block("port", ("grpc",))], [service],
                   _task(plan, "serve-expert", args, g.resources))
    return _job(plan, job, g.region, g.datacenters, [group])


def _frontend_job(plan: Plan) -> Block:
    r, gw = plan.router, plan.gateway
    router = _group(plan, "router", r.replicas, r.constraints, [Block("port", ("grpc",))],
                    [_service(f"{plan.name}-routers", "grpc", ["moe-mesh"], {}, _check("grpc health", "grpc"))],
                    _task(plan, "serve-router", _router_command(plan, Interp("${NOMAD_PORT_grpc}"), _DYNAMIC),
                          r.resources))
    ports = [Block("port", ("grpc",), [("static", gw.grpc_port)]), Block("port", ("http",), [("static", gw.http_port)])]
    services = [_service(f"{plan.name}-gateway", "grpc", ["moe-mesh"], {}, _check("grpc health", "grpc")),
                _service(f"{plan.name}-gateway-http", "http", ["moe-mesh", "openai"], {},
                         _check("http ready", "http", "http", "/health/ready"))]
    gateway = _group(plan, "gateway", gw.replicas, gw.constraints, ports, services,
                     _task(plan, "serve-gateway", _gateway_command(plan), gw.resources))
    return _job(plan, f"{plan.name}-frontend", r.region, r.datacenters, [router, gateway])


def render_nomad(plan: Plan) -> dict[str, str]:
    """One <name>-experts-<group>.nomad.hcl per expert group and <name>-frontend.nomad.hcl (routers + gateway)."""
    files = {f"{plan.name}-experts-{g.name}.nomad.hcl": _hcl_file(_expert_job(plan, g)) for g in plan.expert_groups}
    files[f"{plan.name}-frontend.nomad.hcl"] = _hcl_file(_frontend_job(plan))
    return dict(sorted(files.items()))


def render(plan: Plan, target: str) -> dict[str, str]:
    """File name -> content for `target` ('compose' or 'nomad')."""
    if target == "compose":
        return render_compose(plan)
    if target == "nomad":
        return render_nomad(plan)
    raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")


def _rendered_by_us(path: Path) -> bool:
    try:
        with path.open() as f:
            return f.readline().startswith("# Rendered by `moe-mesh deploy render")
    except OSError:
        return False


def write_rendered(files: dict[str, str], out: Path, target: str) -> list[Path]:
    """Write the files; for nomad also remove job files an earlier render wrote for groups now gone."""
    out.mkdir(parents=True, exist_ok=True)
    if target == "nomad":
        for stale in sorted(out.glob("*.nomad.hcl")):
            if stale.name not in files and _rendered_by_us(stale):
                stale.unlink()
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def drifted(files: dict[str, str], out: Path, target: str) -> list[str]:
    """Files in `out` that differ from a fresh render (missing, changed, or stale job files)."""
    bad = [name for name, text in files.items()
           if not (out / name).is_file() or (out / name).read_text() != text]
    if target == "nomad":
        bad += [p.name for p in sorted(out.glob("*.nomad.hcl")) if p.name not in files]
    return bad


# ---------------------------------------------------------------------------------------------- CLI

def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `deploy render` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser("deploy", help="render docker-compose / Nomad deployments from a plan",
                              description="Deployments rendered from a plan file (see deploy/plan.example.yaml).")
    sub = p.add_subparsers(dest="deploy_command", required=True, metavar="COMMAND")
    r = sub.add_parser("render", help="render a plan for a target",
                       description="Render a plan into docker-compose files or Nomad jobs. Every service "
                                   "discovers the others through Consul; output is deterministic.")
    r.add_argument("--plan", type=Path, required=True, help="plan file (YAML)")
    r.add_argument("--target", choices=TARGETS, required=True, help="compose: docker-compose.yml + Dockerfile + "
                   ".env.example; nomad: one job per expert group + one for router and gateway")
    r.add_argument("--out", type=Path, required=True, help="directory to write into (created if missing)")
    r.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the files in --out differ from a fresh render")
    r.set_defaults(func=run_render)


def run_render(args: argparse.Namespace) -> int:
    prog = "moe-mesh deploy render"
    try:
        files = render(load_plan(args.plan), args.target)
    except PlanError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        bad = drifted(files, args.out, args.target)
        for name in bad:
            print(f"{prog}: {args.out / name} differs from the render of {args.plan}", file=sys.stderr)
        return 1 if bad else 0
    for path in write_rendered(files, args.out, args.target):
        print(path)
    return 0


def probe(target: str, service: str = "", timeout_s: float = 2.0) -> tuple[bool, str]:
    """One standard gRPC health Check: (serving, status name or error)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def add_probe_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `probe` on the moe-mesh CLI: exit 0 when the gRPC health check says SERVING, else 1."""
    p = subparsers.add_parser("probe", help="gRPC health check of one service (exit 0 when SERVING)",
                              description="Ask a service's standard gRPC health service; exit 0 when it "
                                          "answers SERVING, 1 otherwise (container health checks use it).")
    p.add_argument("address", metavar="HOST:PORT", help="the service's gRPC address")
    p.add_argument("--service", default="", help="service name to check (default '': the whole server)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="give up after this many seconds (default 2)")
    p.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    serving, status = probe(args.address, args.service, args.timeout_s)
    print(f"{args.address}{' ' + args.service if args.service else ''}: {status}",
          file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m moe_mesh.deploy {deploy,probe} ...`: the two subcommands without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="moe-mesh")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommand(subparsers)
    add_probe_subcommand(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
