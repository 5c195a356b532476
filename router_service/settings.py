"""Router settings: one pydantic model, built once (CLI flags or MOE_ROUTER_* variables) and passed down."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from common.device import HELP as DEVICE_HELP
from common.device import DeviceName
from common.fastpath import mesh_fast_path
from common.hub import CheckpointPath
from common.quant_settings import QuantizationSettings
from common.telemetry import TelemetrySettings
from common.tls import SecuritySettings
from common.units import parse_size

MAX_DECODE_BURST = 64  # steps of one burst at most


class RouterSettings(QuantizationSettings, TelemetrySettings, SecuritySettings):
    """Everything one router process needs: model, batching limits, expert placement, serving."""

    model_config = SettingsConfigDict(env_prefix="MOE_ROUTER_", extra="forbid")

    checkpoint: CheckpointPath | None = Field(
        None, description="HuggingFace-layout checkpoint directory, or a Hugging Face model id"
    )
    model_id: str | None = Field(
        None, description="model id shared with expert services; default: checkpoint dir name"
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="compute dtype; auto keeps the checkpoint's dtype"
    )
    device: DeviceName = Field("auto", description=DEVICE_HELP)
    quantize_dense: bool = Field(
        False,
        description="with --quantize: hold attention, dense and shared MLPs and the LM head in "
        "that format too (not the gate, norms or embeddings); fewer bytes a token, more error",
    )
    # continuous batching
    max_num_seqs: int = Field(
        32, ge=1, le=4096, description="sequences in the running batch at most"
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="prompt + output tokens per sequence at most; "
        "default min(max_position_embeddings, 4096)",
    )
    max_prefill_tokens: int = Field(
        512,
        ge=1,
        description="prompt tokens one step computes at most: with chunked prefill a longer "
        "prompt is split over several steps; without, it still runs alone in one step",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="split long prompts into chunks of max_prefill_tokens so decoding "
        "sequences keep stepping meanwhile (--no-chunked-prefill: a prompt runs whole in one step)",
    )
    # KV cache
    kv_cache_bytes: str = Field(
        "auto",
        description="bytes of KV cache, allocated at start-up: '4GiB', '2GB', '1073741824', a "
        "share of the memory available at start-up like '30%', or 'auto': 30% of it, at most "
        "what max_num_seqs sequences of max_model_len need, at least one such sequence",
    )
    kv_block_size: int = Field(
        16, ge=1, le=1024, description="tokens per KV-cache block (the unit of allocation)"
    )
    enable_prefix_caching: bool = Field(
        True,
        description="share the KV blocks of identical prompt prefixes between sequences "
        "(--no-prefix-caching: every prompt computed in full)",
    )
    micro_batches: Literal["auto", "1", "2", "3", "4", "5", "6", "7", "8"] = Field(
        "auto",
        description="split each step into this many micro-batches (1-8) that take turns between "
        "the router's compute and remote experts; 'auto' picks 1-4 from measured compute and "
        "transfer times (1 when every expert is colocated)",
    )
    decode_burst: int = Field(
        8,
        ge=1,
        le=MAX_DECODE_BURST,
        description="decode steps one engine step runs back to back for a sequence that runs "
        "alone, asks for no logprobs or penalties and takes the one-call step "
        "(bfloat16, int8, int4 or float32 on a CPU, every expert colocated): its tokens stream in "
        "bursts of up to this many (more where --decode-burst-ms allows); a request arriving, a "
        "cancellation or the deadline ends a burst at the next token. 1: one step per engine step",
    )
    decode_burst_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        description=f"a burst runs more than --decode-burst steps, up to {MAX_DECODE_BURST}, "
        "where that many of the last burst's steps fit in this many milliseconds: fast steps "
        "stream in bursts about this long, and the work between bursts is paid less often. 0: "
        "--decode-burst steps",
    )
    serial_max_tokens: int | None = Field(
        None,
        ge=0,
        le=1 << 20,
        description="forward passes of at most this many tokens (decode steps, small batches) "
        "compute on one thread, leaving the other cores asleep through their hundreds of small "
        "ops; unset: measured at start-up (common/linear.py): the largest of 1, 4, 16 and 32 rows "
        "whose products all threads run less than 1.3x faster than one, else 0: always every "
        "compute thread",
    )
    compute_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch intra-op threads; unset keeps torch's default (all cores)",
    )
    # expert placement
    expert_endpoints: list[str] = Field(
        default_factory=list,
        description="host:port of expert services; what "
        "each serves is learned from its Describe RPC",
    )
    registry: Literal["none", "consul", "kubernetes"] = Field(
        "none",
        description="'consul': discover expert services live "
        "(and register this router) through Consul or `moe-mesh up`'s "
        "embedded registry; 'kubernetes': through the EndpointSlices of their headless "
        "Services (Kubernetes registers); 'none': use expert_endpoints",
    )
    registry_address: str | None = Field(
        None,
        description="Consul HTTP address (default CONSUL_HTTP_ADDR), or with 'kubernetes' the "
        "API server's URL (default in-cluster)",
    )
    advertise_host: str | None = Field(None, description="address registered for gateways to dial")
    colocate: str = Field(
        "",
        description="expert spec always computed in the router process (e.g. '*:0,1'); "
        "with no expert_endpoints and no registry every expert is colocated",
    )
    # tiering: the hottest experts move into the router up to a byte budget, live
    colocate_budget: str = Field(
        "0",
        description="bytes of expert weights the router may colocate by "
        "utilization: '512MiB', '2GB', '1048576' or a share of all routed experts "
        "like '25%'; '0' turns tiering off",
    )

    @field_validator("colocate_budget")
    @classmethod
    def _a_size(cls, v: str) -> str:
        parse_size(v, whole=1)  # the whole is known only once the checkpoint is read: format only
        return v

    pin_remote: str = Field("", description="expert spec never colocated by tiering")
    tier_interval_s: float = Field(5.0, gt=0, description="seconds between tiering decisions")
    tier_window_s: float = Field(60.0, gt=0, description="utilization window the policy reads")
    tier_min_dwell_s: float = Field(
        30.0, ge=0, description="an expert stays at least this long in a new tier"
    )
    tier_hysteresis: float = Field(
        0.2, ge=0, description="an incumbent's load counts this much more when ranking"
    )
    tier_hot_factor: float = Field(
        1.5, gt=0, description="hot: at least this multiple of its layer's mean load"
    )
    region: str = Field(
        "",
        pattern=r"^[A-Za-z0-9._-]*$",
        max_length=64,
        description="this router's region: it prefers expert services of the same region",
    )
    region_penalty: float = Field(
        8.0,
        ge=0,
        description="a replica in another region is chosen as if it had "
        "this many more calls in flight",
    )
    expert_timeout_s: float = Field(
        30.0,
        gt=0,
        description="upper bound of one expert call when the request has no earlier deadline",
    )
    # A hung or dying replica must not stall the batch: see router_service/experts/replicas.py, DispatchPolicy.
    expert_call_timeout_factor: float = Field(
        8.0,
        ge=1,
        description="an expert call gives up after this multiple of its replica's p99 latency "
        "(once measured, scaled to the call's rows), and goes elsewhere",
    )
    expert_call_timeout_min_s: float = Field(
        1.0, gt=0, description="the learned per-call timeout is at least this"
    )
    hedge_quantile: float = Field(
        0.95,
        gt=0,
        le=1,
        description="an expert call not answered by this latency "
        "quantile of its replica is also sent to another replica; the first answer wins",
    )
    hedge_min_delay_s: float = Field(
        0.05, ge=0, description="hedge no earlier than this after the first call"
    )
    expert_ejection_s: float = Field(
        1.0,
        gt=0,
        description="a replica that failed a call (or lost a hedge race) is "
        "skipped this long, doubling with each further failure (at most 30 s)",
    )
    expert_probe_interval_s: float = Field(
        0.5,
        ge=0,
        description="an ejected replica is checked this often (Describe, same model and weights) "
        "and back in use once a check passes after it was seen down, e.g. restarted; "
        "0: it waits out its ejection",
    )
    missing_expert_wait_s: float = Field(
        30.0,
        ge=0,
        description="a layer call that needs an expert no replica serves (its group scaled to 0, "
        "its only replica restarting) waits this long for one to register before it fails, "
        "within the request's deadline; the gateway reports not-ready meanwhile; 0: fail at once",
    )
    retry_budget_ratio: float = Field(
        0.2,
        ge=0,
        le=1,
        description="expert-call retries and hedges may add at most this share of calls",
    )
    fast_path: Literal["auto", "ucx", "off"] = Field(
        default_factory=mesh_fast_path,
        validate_default=True,
        description="send activations over UCX to expert services that offer it: 'auto' when "
        "ucxx imports (the fastpath extra), 'ucx' (required), 'off' (gRPC only); unset: "
        "MOE_MESH_FAST_PATH, else auto",
    )
    fast_path_timeout_s: float = Field(
        0.5,
        gt=0,
        description="one UCX attempt gives up after this per 8 rows it carries (at most half the "
        "call's budget) and the call goes over gRPC",
    )
    fast_path_backoff_s: float = Field(
        1.0,
        gt=0,
        description="after a fast-path failure a replica is called over gRPC this long, doubling "
        "with each further failure (at most 30 s), then UCX is tried again",
    )
    connect_timeout_s: float = Field(
        30.0, gt=0, description="how long to wait for expert services at start-up"
    )
    # serving
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(0, ge=0, le=65535, description="port to bind; 0 picks a free one")
    max_message_bytes: int = Field(
        256 * 2**20, ge=2**20, description="gRPC message size limit, both directions"
    )
    grace_s: float = Field(
        10.0,
        ge=0,
        description="on shutdown, how long deregistering and in-flight requests may take together",
    )
    max_loop_deaths: int = Field(
        3,
        ge=1,
        le=1000,
        description="engine-loop deaths (bugs; each fails the requests "
        "in flight and restarts the loop) within loop_death_window_s after which the "
        "router stops serving and reports NOT_SERVING; a device error (CUDA) stops it at the first",
    )
    loop_death_window_s: float = Field(
        60.0, gt=0, description="window over which engine-loop deaths are counted"
    )
