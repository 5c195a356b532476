"""Expert service settings: one pydantic model, built once (CLI flags or MOE_EXPERT_* variables) and passed down."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from common.device import HELP as DEVICE_HELP
from common.device import DeviceName
from common.fastpath import mesh_fast_path
from common.hub import CheckpointPath
from common.quant_settings import QuantizationSettings
from common.telemetry import TelemetrySettings
from common.tls import SecuritySettings


class ExpertSettings(QuantizationSettings, TelemetrySettings, SecuritySettings):
    """What one expert service serves, where it listens, and its batching and size limits."""

    model_config = SettingsConfigDict(env_prefix="MOE_EXPERT_", extra="forbid")

    checkpoint: CheckpointPath = Field(
        ..., description="HuggingFace-layout checkpoint directory, or a Hugging Face model id"
    )
    experts: str = Field(
        "*:*", description="(layer, expert) pairs to serve, e.g. '*:*' or '0-3:0,1; 5:7'"
    )
    host: str = Field(
        "127.0.0.1", description="address to bind; loopback unless exposed on purpose"
    )
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one")
    model_id: str | None = Field(
        None, description="model id routers must send; unset means the checkpoint directory's name"
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto",
        description="compute dtype; auto keeps the checkpoint's; requests must send activations "
        "of this dtype",
    )
    device: DeviceName = Field("auto", description=DEVICE_HELP)
    max_batch_tokens: int = Field(
        4096, ge=1, description="token rows per expert FFN execution at most"
    )
    max_queue_delay_us: int = Field(
        0,
        ge=0,
        description="how long a queued group waits for more groups of the "
        "same expert, in microseconds; 0 merges only what queued during compute",
    )
    max_request_tokens: int = Field(
        65536,
        ge=1,
        description="token rows per Forward call at most; larger calls are INVALID_ARGUMENT",
    )
    max_message_bytes: int = Field(
        256 * 1024 * 1024,
        ge=4 * 1024 * 1024,
        description="gRPC send/receive message size limit, in bytes",
    )
    compute_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch intra-op threads; unset keeps "
        "torch's default (all cores). Set it when several services share a "
        "host: oversubscribed OpenMP threads spin and slow everyone down",
    )
    registry: Literal["none", "consul", "kubernetes"] = Field(
        "none",
        description="where to register: 'consul' (an agent, "
        "or the embedded registry of `moe-mesh up`), 'kubernetes' (its readiness probe puts "
        "this Pod in its Service's EndpointSlices: nothing to register) or 'none'",
    )
    registry_address: str | None = Field(
        None,
        description="Consul HTTP address (default CONSUL_HTTP_ADDR), or with 'kubernetes' the "
        "API server's URL (default in-cluster)",
    )
    advertise_host: str | None = Field(
        None,
        description="address registered for routers to dial; default "
        "the bind host, or the hostname when binding all interfaces",
    )
    region: str = Field(
        "", description="region reported to routers (which prefer same-region experts)"
    )
    grace_s: float = Field(
        10.0,
        ge=0.0,
        description="on stop, how long deregistering, the quiet period (drain_quiet_s) and "
        "in-flight calls may take together, in seconds",
    )
    drain_quiet_s: float = Field(
        0.5,
        ge=0.0,
        le=60.0,
        description="on stop, after deregistering (a registry): keep accepting calls until "
        "none has arrived for this long, in seconds, so routers stop choosing this replica before "
        "it refuses calls; at most half of grace_s; 0 refuses new calls at once",
    )
    fast_path: Literal["auto", "ucx", "off"] = Field(
        default_factory=mesh_fast_path,
        validate_default=True,
        description="activations over UCX next to gRPC: 'auto' when ucxx imports (the fastpath "
        "extra), 'ucx' (required), 'off'; unset: MOE_MESH_FAST_PATH, else auto",
    )
