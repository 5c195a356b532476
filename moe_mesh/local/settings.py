"""`moe-mesh up` and `moe-mesh scale` settings: pydantic models whose fields are the commands' own
flags (common/cli.py). The gateway's and routers' flags `up` passes through are declared by their
services' settings models (moe_mesh/local/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.device import CHOICES as DEVICES
from common.device import DeviceName
from common.quant_settings import QuantizationSettings

# common/telemetry.py's DEFAULT_SAMPLE_RATIO (a test holds them equal), not imported: the settings
# of a command stay free of OpenTelemetry's imports.
TRACE_SAMPLE = 0.01


class UpSettings(QuantizationSettings):
    """A whole mesh on this machine: how many of each service, where its files go. --quantize
    sets the precision of the expert services' experts (with --expert-services 0, of the
    routers', which then hold every expert); routers keep their hot colocated experts in the
    checkpoint's dtype unless --router-arg='--quantize ...' says otherwise."""

    model_config = SettingsConfigDict(env_prefix="MOE_MESH_UP_", extra="forbid")

    checkpoint: Path | None = Field(
        None,
        description="HuggingFace-layout checkpoint directory, or a Hugging Face model id "
        "(org/name[@rev])",
    )
    device: DeviceName = Field(
        "auto",
        description=f"where the routers and expert services compute ({DEVICES}): their "
        "--device; a GPU torch cannot see here is refused before any process starts. auto: a GPU "
        "where torch sees one, else the CPU",
    )
    expert_device: DeviceName | None = Field(
        None,
        description="the expert services' --device where it differs from --device: "
        "--device cuda --expert-device cpu puts the routers on the GPU and the experts on the "
        "CPU (a heterogeneous mesh), --device cpu --expert-device cuda the reverse; unset: "
        "--device, where auto is the CPU with --quantize (quantized experts compute there only)",
    )
    expert_services: int = Field(
        4,
        ge=0,
        description="expert groups, each its own service; 0 runs no expert service and "
        "colocates every expert in the routers (the monolithic mesh)",
    )
    replicas: int = Field(1, ge=1, description="replicas of every expert group")
    routers: int = Field(1, ge=1, description="router replicas")
    ready_file: Path | None = Field(
        None,
        description="write the endpoints (gateway_grpc, gateway_http, routers, experts) as JSON here",
    )
    run_dir: Path | None = Field(
        None, description="where child logs go; default .cache/mesh-<time>"
    )
    router_arg: list[str] = Field(
        [],
        description="more `serve-router` flags for every router, split like a shell does, e.g. "
        "--router-arg='--fast-path off' (repeatable)",
    )
    tls: bool = Field(
        False,
        description="mutual TLS on every connection of the mesh (and TLS on the gateway's public "
        "endpoints), with a CA and certificates `moe-mesh certs` writes into --certs-dir",
    )
    certs_dir: Path | None = Field(
        None,
        description="with --tls: the certificates to use, created there when missing; "
        "default RUN_DIR/certs",
    )
    autoscale: bool = Field(
        False,
        description="scale every expert group on its measured load, within the bounds "
        "--autoscale-arg gives (default 1 to 4 replicas; `moe-mesh autoscale`'s loop inside `up`, "
        "decisions in RUN_DIR/autoscale.jsonl); --replicas is the starting count",
    )
    autoscale_arg: list[str] = Field(
        [],
        description="more `moe-mesh autoscale` policy flags, split like a shell does, e.g. "
        "--autoscale-arg='--metric token_rows --target 600 --max-replicas 3' (repeatable)",
    )
    trace_sample: float = Field(
        TRACE_SAMPLE,
        ge=0,
        le=1,
        description="trace this share of requests (0-1) into RUN_DIR/<service>.spans.jsonl, for "
        "`moe-mesh trace show --ready-file`; 0: no span files. The default, as the services', is "
        "1%: a traced request writes spans per decode step, layer and expert call (a 32-token "
        "reply of the 3-layer tiny checkpoint: 431 spans, 327 kB), so tracing every request "
        "would grow the files with the load; 1 traces every request (OTLP export follows the "
        "OTEL_* variables)",
    )


class ScaleSettings(BaseSettings):
    """One expert group's replica count in a running local mesh."""

    model_config = SettingsConfigDict(env_prefix="MOE_MESH_SCALE_", extra="forbid")

    ready_file: Path | None = Field(None, description="the file `moe-mesh up --ready-file` wrote")
    experts: str | None = Field(None, description="expert spec of the group, e.g. '*:0-1'")
    replicas: int | None = Field(None, ge=0, description="processes that should serve it (>= 0)")
    force: bool = Field(
        False,
        description="scale down even when the replicas stopped are the only copy of some expert "
        "(refused otherwise, exit 2); streams that need it pause until a replica returns, up to "
        "the routers' --missing-expert-wait-s, and the gateway reports not-ready meanwhile",
    )


class GenerateSettings(BaseSettings):
    """`moe-mesh generate`'s own flags; the sampling flags come from common.sampling's
    SamplingParams (moe_mesh/local/generate_cli.py), the prompt and the target are alternatives."""

    model_config = SettingsConfigDict(env_prefix="MOE_MESH_GENERATE_", extra="forbid")

    checkpoint: str | None = Field(
        None, description="HuggingFace-layout checkpoint directory (with --local)"
    )
    tls_ca: Path | None = Field(
        None,
        description="the gateway speaks TLS: check its certificate against this CA (a ready file "
        "of `up --tls` names it itself). An API key goes in MOE_MESH_API_KEY",
    )
    priority: int = Field(0, description="higher is served first (with --gateway)")
    stop: list[str] = Field([], description="stop string (repeatable)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="compute dtype (with --local); auto: the checkpoint's"
    )
    device: DeviceName = Field(
        "auto",
        description=f"where to compute (with --local): {DEVICES}; auto: a GPU where torch sees "
        "one, else the CPU",
    )
    json_output: bool = Field(False, description="print one JSON object instead of streaming text")
