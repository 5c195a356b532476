"""Gateway settings: one pydantic model, built once (CLI flags or MOE_GATEWAY_* variables) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from common.hub import CheckpointPath
from common.telemetry import TelemetrySettings
from common.tls import SecuritySettings


class GatewaySettings(TelemetrySettings, SecuritySettings):
    """The public edge: where it listens, which routers it balances over, admission and request limits."""

    model_config = SettingsConfigDict(env_prefix="MOE_GATEWAY_", extra="forbid")

    checkpoint: CheckpointPath = Field(
        ...,
        description="checkpoint directory or Hugging Face model id (the gateway reads only its "
        "tokenizer files)",
    )
    skip_tokenizer_init: bool = Field(
        False,
        description="serve token ids only, without loading a tokenizer: text prompts, chat and stop "
        "strings are refused, and responses carry token ids with empty text",
    )
    served_model_name: list[str] = Field(
        default_factory=list,
        description="names the model is listed and accepted under (the first is "
        "the one responses carry); default the model id the routers report",
    )
    routers: list[str] = Field(
        default_factory=list, description="host:port of router replicas (with registry='none')"
    )
    registry: Literal["none", "consul", "kubernetes"] = Field(
        "none",
        description="'consul': follow router replicas live "
        "through Consul or `moe-mesh up`'s embedded registry; 'kubernetes': through the "
        "EndpointSlices of the routers' headless Service",
    )
    registry_address: str | None = Field(
        None,
        description="Consul HTTP address (default CONSUL_HTTP_ADDR), or with 'kubernetes' the "
        "API server's URL (default in-cluster)",
    )
    host: str = Field("127.0.0.1", description="address both APIs bind")
    api_key_file: Path | None = Field(
        None,
        description="API keys, one per line with optional name=, rpm= and max_priority= "
        "(docs/operating/security.md); re-read when it changes. Keys may also come from "
        "MOE_GATEWAY_API_KEY (comma-separated). With neither, the API is open",
    )
    public_tls_cert: Path | None = Field(
        None,
        description="PEM certificate of the public gRPC and HTTP endpoints (default tls_cert); "
        "with public_tls_key both endpoints speak TLS",
    )
    public_tls_key: Path | None = Field(
        None, description="PEM private key of public_tls_cert (default tls_key)"
    )
    reflection: bool = Field(
        True, description="serve gRPC server reflection on the public gRPC endpoint"
    )
    grpc_port: int = Field(0, ge=0, le=65535, description="public gRPC port; 0 picks a free one")
    http_port: int = Field(
        0, ge=0, le=65535, description="OpenAI-compatible HTTP port; 0 picks a free one"
    )
    max_in_flight: int = Field(64, ge=1, description="requests streaming from routers at once")
    max_queued: int = Field(
        64,
        ge=0,
        description="admitted requests waiting for an in-flight place; beyond "
        "this, requests get RESOURCE_EXHAUSTED / HTTP 429 at once",
    )
    retry_after_s: float = Field(
        1.0, gt=0, description="retry hint sent with RESOURCE_EXHAUSTED / 429"
    )
    max_tokens_limit: int = Field(
        4096, ge=1, description="largest max_tokens a request may ask for"
    )
    default_max_tokens: int = Field(
        16,
        ge=1,
        description="max_tokens when a completion request gives none (chat runs to the end of the context)",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="deadline of a request that brings none"
    )
    connect_timeout_s: float = Field(
        30.0, gt=0, description="how long to wait for routers at start-up"
    )
    max_message_bytes: int = Field(
        64 * 2**20, ge=2**20, description="gRPC message size limit towards routers"
    )
    # Public input bounds, checked before any heavy work (parsing lists, tokenizing).
    max_body_bytes: int = Field(
        4 * 2**20,
        ge=2**10,
        description="largest HTTP request body (else 413) and public "
        "gRPC message (else RESOURCE_EXHAUSTED)",
    )
    max_choices: int = Field(16, ge=1, description="largest `n` (choices per request)")
    max_prompts: int = Field(
        64,
        ge=1,
        description="prompts in one /v1/completions request at most (OpenAI's list of prompts); "
        "each runs as its own request, n times, and counts against admission and the key's rate",
    )
    max_messages: int = Field(2048, ge=1, description="chat messages per request at most")
    allow_unknown_fields: bool = Field(
        False,
        description="accept and ignore request fields neither OpenAI nor this gateway defines, "
        "instead of a 400 naming them (docs/reference/apis.md lists the fields)",
    )
    disable_fastapi_docs: bool = Field(
        False,
        description="serve no /openapi.json, /docs or /redoc (vLLM's flag); when served, they "
        "need the API key while keys are on",
    )
    max_stop_strings: int = Field(32, ge=0, description="stop strings per request at most")
    max_stop_chars: int = Field(256, ge=1, description="characters per stop string at most")
    max_id_chars: int = Field(256, ge=1, description="characters of request_id and model at most")
    inline_tokenize_chars: int = Field(
        8192,
        ge=0,
        description="prompts longer than this are tokenized on a worker "
        "thread, so the event loop keeps serving",
    )
    # Router choice: outlier ejection and retries (see common/resilience.py).
    router_attempts: int = Field(
        3,
        ge=1,
        le=16,
        description="router calls per request at most, the first included: "
        "a call refused before its first token, or a stream cut by a dying router, is "
        "continued on another router",
    )
    router_ejection_s: float = Field(
        1.0,
        gt=0,
        description="a router that failed is skipped this long, doubling "
        "with each further failure (at most 30 s)",
    )
    router_probe_interval_s: float = Field(
        0.5,
        ge=0,
        description="an ejected router is checked this often (gRPC health SERVING, then Status "
        "with this gateway's model) and back in use once a check passes, e.g. restarted; "
        "0: it waits out its ejection",
    )
    retry_budget_ratio: float = Field(
        0.2, ge=0, le=1, description="retries may add at most this share of requests"
    )
    grace_s: float = Field(
        10.0,
        ge=0,
        description="on shutdown, how long in-flight requests may finish; those still running "
        "then end with UNAVAILABLE",
    )

    @model_validator(mode="after")
    def _public_pair(self) -> GatewaySettings:
        if (self.public_tls_cert is None) != (self.public_tls_key is None):
            given = "public_tls_cert" if self.public_tls_cert else "public_tls_key"
            raise ValueError(f"{given} needs its pair (public_tls_cert and public_tls_key)")
        return self

    def public_tls_files(self) -> tuple[Path, Path] | None:
        """(certificate, key) of the public endpoints, or None when they are plaintext."""
        if self.public_tls_cert is not None and self.public_tls_key is not None:
            return self.public_tls_cert, self.public_tls_key
        if self.tls_cert is not None and self.tls_key is not None:
            return self.tls_cert, self.tls_key
        return None
