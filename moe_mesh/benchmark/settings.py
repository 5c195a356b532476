"""`moe-mesh bench`'s settings: one pydantic model, each field a flag (common/cli.py) or a
MOE_MESH_BENCH_* variable. What to benchmark (--url / --ready-file / --setup) and the load levels
(--concurrency / --request-rate) are lists of alternatives, declared with the parser in cli.py."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from moe_mesh.benchmark.stats import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from moe_mesh.benchmark.workload import (
    DEFAULT_SCALE,
    MEDIAN_INPUT_TOKENS,
    MEDIAN_OUTPUT_TOKENS,
    SIGMA,
)


class BenchSettings(BaseSettings):
    """A benchmark run: the workload, its bounds, the goodput SLOs and where the report goes."""

    model_config = SettingsConfigDict(env_prefix="MOE_MESH_BENCH_", extra="forbid")

    checkpoint: Path | None = Field(None, description="checkpoint directory for --setup")
    name: str = Field("mesh", description="the set-up's name for --url / --ready-file")
    num_requests: int = Field(64, gt=0, description="requests per load level")
    max_duration_s: float = Field(
        300.0, gt=0, description="bound of each load level: requests unfinished by then fail"
    )
    scale: float = Field(
        DEFAULT_SCALE,
        gt=0,
        description=f"multiplies the trace-shaped lengths (median input {MEDIAN_INPUT_TOKENS}, "
        f"output {MEDIAN_OUTPUT_TOKENS}, lognormal sigma {SIGMA})",
    )
    input_len: int | None = Field(None, gt=0, description="every prompt this long (tokens)")
    output_len: int | None = Field(None, gt=0, description="every output this long (tokens)")
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="clip prompt + output to this; default: the gateway's, from /v1/models",
    )
    seed: int = Field(0, description="workload and arrivals seed")
    slo_ttft_ms: float = Field(
        DEFAULT_SLO_TTFT_MS, gt=0, description="goodput SLO on time to first token"
    )
    slo_tpot_ms: float = Field(
        DEFAULT_SLO_TPOT_MS, gt=0, description="goodput SLO on time per output token"
    )
    warmup_requests: int = Field(
        1, ge=0, description="requests sent before each set-up's first load level, not measured"
    )
    out: Path | None = Field(
        None, description="JSON report; default .cache/bench-<time>/bench.json"
    )
    png: Path | None = Field(None, description="throughput-vs-TPOT picture; default next to --out")
    quiet: bool = Field(False, description="no progress bar")
    tls_ca: Path | None = Field(
        None,
        description="check an https gateway against this CA (a ready file of `up --tls` names "
        "its own); an API key goes in MOE_MESH_API_KEY",
    )
