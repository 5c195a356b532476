"""Deploy plans: the pydantic models of a plan file, `load_plan`, and expert spec parsing."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common import device
from common.errors import InvalidArgumentError, MoeMeshError
from common.placement import ModelShape, Pair, format_experts, parse_experts
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.planning.deploy.kubernetes_plan import KubernetesPlan

_MAX_INDEX = 65535  # an expert spec index beyond this is a typo, not a model

Name = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$",
        description="lower-case letters, digits and '-', at most 40 characters",
    ),
]
Port = Annotated[int, Field(ge=1, le=65535)]
Region = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]*$", max_length=64)]
Datacenters = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
PLAN_DEVICES = "cpu, cuda or cuda:N"


def _plan_device(text: str) -> str:
    """A device a scheduler can reserve: the services' own names (common/device.py) but `auto`,
    which would leave the scheduler not knowing whether the group needs a GPU."""
    try:
        value = device.check(text)
    except ValueError:
        raise ValueError(f"must be {PLAN_DEVICES}, got {text!r}") from None
    if value == "auto":
        raise ValueError(
            f"auto is not allowed in a plan: a scheduler must know whether to reserve a GPU for "
            f"these services; say {PLAN_DEVICES}"
        )
    return value


PlanDevice = Annotated[str, AfterValidator(_plan_device)]


def _device_field(services: str) -> Any:
    return Field(
        "cpu",
        description=f"where the {services} compute: cpu, cuda or cuda:N (auto is refused: a "
        "scheduler must know whether to reserve a GPU). On CUDA each replica runs with "
        "`--device cuda` and reserves one NVIDIA GPU (compose: `deploy.resources.reservations."
        'devices`, GPU N for cuda:N; Nomad: `device "nvidia/gpu"`; Kubernetes: the '
        "`nvidia.com/gpu` limit), which it sees as its only device; on the CPU in a plan that "
        "reserves GPUs, `--device cpu`",
    )


def _no_device_flag(args: list[str], field: str) -> list[str]:
    # The renderers reserve a GPU from the field: a flag would run on one nobody reserved.
    if _has_flag(args, "--device"):
        raise ValueError(f"set {field} instead of --device in args")
    return args


class PlanError(MoeMeshError):
    """A plan file cannot be read or is invalid; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """A replica's resources: Nomad's task resources, compose's limits and reservations, Kubernetes'
    requests and limits (1000 MHz counted as one core)."""

    cpu_mhz: int = Field(ge=100, description="CPU share in MHz")
    memory_mb: int = Field(ge=64, description="memory limit in MiB")


class Constraint(_Strict):
    """A Nomad placement constraint, e.g. {attribute: "${node.class}", value: "expert"}."""

    attribute: str = Field(min_length=1)
    operator: str = "="
    value: str = ""


class ModelPlan(_Strict):
    checkpoint: str = Field(
        description="absolute path of the checkpoint directory inside every container; "
        "compose mounts $MODEL_DIR there, Nomad the host volume `nomad.model_volume`"
    )
    model_id: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="model id routers and experts share",
    )
    num_layers: int | None = Field(
        None,
        ge=1,
        le=_MAX_INDEX,
        description="decoder layers; with num_experts, "
        "render checks that the expert groups cover every (layer, expert)",
    )
    num_experts: int | None = Field(
        None, ge=1, le=_MAX_INDEX, description="routed experts per layer"
    )
    moe_layers: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="layers with routed experts (Qwen2-MoE can have dense ones); default every layer",
    )

    @field_validator("checkpoint")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(
                f"must be an absolute directory path inside the container, e.g. /models/mixtral, "
                f"not {v!r}"
            )
        return v.rstrip("/")

    @model_validator(mode="after")
    def _both_sizes(self) -> ModelPlan:
        if (self.num_layers is None) != (self.num_experts is None):
            raise ValueError(
                "give both num_layers and num_experts (for the coverage check) or neither"
            )
        if self.moe_layers is not None and (
            self.num_layers is None or not all(layer < self.num_layers for layer in self.moe_layers)
        ):
            raise ValueError("moe_layers needs num_layers and every layer below it")
        return self


class GatewayPlan(_Strict):
    replicas: int = Field(1, ge=1, le=64)
    grpc_port: Port = Field(
        50050, description="public gRPC port (container port; compose also publishes it)"
    )
    http_port: Port = Field(8000, description="OpenAI-compatible HTTP port")
    constraints: list[Constraint] = Field(
        default_factory=list, description="Nomad placement of the gateway group"
    )
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
    colocate_budget: str | None = Field(
        None,
        description="bytes of expert weights each router colocates by measured load ('512MiB', "
        "'25%'); `moe-mesh plan` sets it from its proposal",
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="serve-router --max-num-seqs (sequences in the running batch at most); "
        "`moe-mesh plan --search` sets it to the batch size it predicted for; unset: the router's default",
    )
    micro_batches: Literal["auto"] | Annotated[int, Field(ge=1, le=8)] | None = Field(
        None,
        description="serve-router --micro-batches: 'auto' or 1..8 micro-batches per decode step "
        "(MegaScale-Infer's ping-pong); `moe-mesh plan --search` sets it; unset: the router's default",
    )
    device: PlanDevice = _device_field("routers")
    args: list[str] = Field(default_factory=list, description="extra serve-router flags")

    @field_validator("args")
    @classmethod
    def _budget_is_a_field(cls, args: list[str]) -> list[str]:
        # Declared once: a flag here would fight the field (and the planner, which edits the field).
        if _has_flag(args, "--colocate-budget"):
            raise ValueError(
                "set router.colocate_budget instead of --colocate-budget in router.args"
            )
        return _no_device_flag(args, "router.device")

    @model_validator(mode="after")
    def _batching_set_once(self) -> RouterPlan:
        # Older plans pass these in args, which stays valid; both at once would be two answers.
        for field, flag in (
            ("max_num_seqs", "--max-num-seqs"),
            ("micro_batches", "--micro-batches"),
        ):
            if getattr(self, field) is not None and _has_flag(self.args, flag):
                raise ValueError(f"router.{field} is set and router.args has {flag}: keep one")
        return self


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


def gpu_index(name: str) -> int | None:
    """N for a plan's cuda:N; None for cuda (any GPU) and cpu."""
    return int(name.split(":")[1]) if ":" in name else None


class ExpertGroup(_Strict):
    name: Name
    experts: str = Field(description="expert spec, e.g. '*:0-3' (grammar in common/placement.py)")
    replicas: int = Field(1, ge=1, le=256)
    region: Region = Field(
        "",
        description="serve-expert --region (routers prefer their own region) and the "
        "Nomad job's region; empty: neither",
    )
    datacenters: Datacenters | None = None
    constraints: list[Constraint] = Field(default_factory=list)
    port: Port = Field(50061, description="gRPC port in the container (Nomad picks a host port)")
    compute_threads: int | None = Field(
        None, ge=1, le=1024, description="serve-expert --compute-threads"
    )
    quantize: Literal["none", "int8", "int4"] = Field(
        "none", description="serve-expert --quantize: the group's precision (a cold group in int4)"
    )
    quantize_group_size: Literal[32, 64, 128] = Field(
        64, description="serve-expert --quantize-group-size (with quantize int4)"
    )
    device: PlanDevice = _device_field("group's expert services")
    resources: Resources = Resources(cpu_mhz=2000, memory_mb=4096)
    args: list[str] = Field(default_factory=list, description="extra serve-expert flags")
    autoscale: Autoscale | None = Field(
        None,
        description="scale the group between bounds on its measured load (moe_mesh/autoscale): "
        "rendered as a HorizontalPodAutoscaler, a Nomad scaling policy, or run by "
        "`moe-mesh autoscale`; `replicas` is then the starting count",
    )

    @field_validator("experts")
    @classmethod
    def _spec_syntax(cls, v: str) -> str:
        expert_pairs(v)
        return v

    @field_validator("args")
    @classmethod
    def _device_is_a_field(cls, args: list[str]) -> list[str]:
        return _no_device_flag(args, "the group's device")

    @model_validator(mode="after")
    def _starts_within_bounds(self) -> ExpertGroup:
        a = self.autoscale
        if a is not None and (problem := a.problem()):
            raise ValueError(f"autoscale.{problem}")
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(
                f"replicas {self.replicas} is outside autoscale's [{a.min_replicas}, "
                f"{a.max_replicas}]"
            )
        return self


class ComposePlan(_Strict):
    consul_image: str = Field(
        "hashicorp/consul:1.20", min_length=1, description="image of the Consul dev agent"
    )
    prometheus_image: str = Field(
        "prom/prometheus:v2.53.0", min_length=1, description="image of the Prometheus server"
    )


class NomadPlan(_Strict):
    datacenters: Datacenters = Field(
        default_factory=lambda: ["dc1"], description="default datacenters of every job"
    )
    model_volume: Name = Field(
        "moe-mesh-model", description="Nomad client host_volume holding the checkpoint"
    )
    consul_http_addr: str = Field(
        "127.0.0.1:8500",
        min_length=1,
        description="the node's Consul agent as tasks on host networking see it",
    )
    otlp_endpoint: str = Field(
        "", description="OTLP collector for traces (OTEL_EXPORTER_OTLP_ENDPOINT); empty: none"
    )
    nomad_addr: str = Field(
        "http://127.0.0.1:4646",
        min_length=1,
        description="Nomad's HTTP API as the Nomad Autoscaler reaches it (nomad-autoscaler.hcl)",
    )
    prometheus_addr: str = Field(
        "http://127.0.0.1:9090",
        min_length=1,
        description="the Prometheus that scrapes the mesh (prometheus.yml), as the Nomad "
        "Autoscaler reaches it: the groups' `autoscale` checks query it",
    )


class SecurityPlan(_Strict):
    """What the renders protect; every secret is a file mounted from the target's secret store
    (docs/operating/security.md; deploy/secrets.py)."""

    tls: bool = Field(
        False,
        description="mutual TLS between the services and TLS on the gateway's public ports, "
        "from certificates `moe-mesh certs --host <server_name>` writes",
    )
    api_keys: bool = Field(False, description="the gateway requires API keys (a key file)")
    server_name: Name = Field(
        "moe-mesh",
        description="name every service certificate carries and every service checks, instead "
        "of the address it dials (a pod IP, a container id)",
    )


class Plan(_Strict):
    """Everything `deploy render` needs; unknown keys are errors (typos fail loudly)."""

    name: Name = Field(
        "moe-mesh", description="prefix of Nomad job names and of their Consul service names"
    )
    image: str = Field(min_length=1, description="the moe-mesh image, e.g. moe-mesh:0.1.0")
    model: ModelPlan
    gateway: GatewayPlan = GatewayPlan()
    router: RouterPlan = RouterPlan()
    expert_groups: list[ExpertGroup] = Field(min_length=1)
    compose: ComposePlan = ComposePlan()
    nomad: NomadPlan = NomadPlan()
    kubernetes: KubernetesPlan = KubernetesPlan()
    security: SecurityPlan = SecurityPlan()

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
            layers = tuple(model.moe_layers) if model.moe_layers is not None else None
            _check_coverage(groups, ModelShape(model.num_layers, model.num_experts, layers))
        return groups


def _check_coverage(groups: list[ExpertGroup], bounds: ModelShape) -> None:
    num_layers, num_experts = bounds.num_layers, bounds.num_experts
    served: set[Pair] = set()
    for g in groups:
        try:
            served.update(_parse(g.experts, bounds))
        except ValueError as e:
            raise ValueError(f"group {g.name!r} experts {g.experts!r}: {e}") from None
    missing = sorted({(la, e) for la in bounds.moe_layer_ids for e in range(num_experts)} - served)
    if missing:
        raise ValueError(
            f"no group serves {format_experts(missing)!r} (LAYERS:EXPERTS) of the "
            f"{num_layers} layers x {num_experts} experts in `model`"
        )


def expert_pairs(
    spec: str, num_layers: int | None = None, num_experts: int | None = None
) -> list[Pair]:
    """The pairs an expert spec names, parsed by the same code the services use.

    Without the model's sizes only the syntax is checked: the bounds are then the largest index in the text.
    Raises ValueError with the parser's message.
    """
    if num_layers is None or num_experts is None:
        biggest = max((int(n) for n in re.findall(r"\d+", spec)), default=0)
        if biggest > _MAX_INDEX:
            raise ValueError(f"index {biggest} in {spec!r} is larger than {_MAX_INDEX}")
        num_layers = num_experts = biggest + 1
    return _parse(spec, ModelShape(num_layers, num_experts))


def _parse(spec: str, bounds: ModelShape) -> list[Pair]:
    try:
        return parse_experts(spec, bounds)
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
        raise invalid(path, e) from None


def invalid(path: Path, e: ValidationError) -> PlanError:
    """A PlanError for a file that failed validation: 'FILE: field.path: message' per problem."""
    lines = [
        f"{_loc(err['loc'])}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors()
    ]
    return PlanError(f"{path}: " + "\n  ".join(lines))


def write_output(text: str, out: Path | None) -> None:
    """A planning command's result: to `out`, or to stdout without one; PlanError names `--out`."""
    if out is None:
        sys.stdout.write(text)
        return
    try:
        out.write_text(text)
    except OSError as e:
        raise PlanError(f"--out {out}: {e.strerror}") from None
