"""The file `moe-mesh profile` writes and `moe-mesh plan --search` reads: ProfileFile, checked by
`read_profile` (every problem a PlanError naming the file and the field); and ProfileSettings, what
a profile is measured with (the command's flags).

Format 2 adds each transport's per-call CPU at both ends (`service_call_cpu`, `router_call_cpu`);
format 3 the machine's memory read bandwidth (`memory_bandwidth`). Older files still read: the
planner then charges each end one Tc per call, and bounds nothing by bandwidth."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.perfmodel import Linear, Piecewise
from moe_mesh.planning.deploy.plan import PlanError, invalid

FORMAT = "moe-mesh-profile/3"
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fit(_Strict):
    """seconds = slope · x + intercept (x: sequences, tokens or bytes)."""

    slope: NonNeg
    intercept: NonNeg

    def linear(self) -> Linear:
        return Linear(self.slope, self.intercept)

    @classmethod
    def of(cls, xs: list[float], ys: list[float]) -> Fit:
        f = Linear.fit(xs, ys)
        return cls(slope=f.slope, intercept=f.intercept)


class Point(_Strict):
    x: NonNeg  # sequences (Ta, dense, head), tokens (Te)
    wall_s: NonNeg
    cpu_s: NonNeg


class Measured(_Strict):
    """A cost as a function of size: wall-clock and process CPU seconds, fitted and raw. The
    planner interpolates the raw points (`wall_cost`, `cpu_cost`); the fits are kept for readers
    and for a cost measured at one size."""

    wall: Fit
    cpu: Fit
    threads: int = Field(ge=1)
    points: list[Point] = Field(min_length=1)

    def wall_cost(self) -> Piecewise | Linear:
        """Wall seconds through the measured points (the fit when they are at one size)."""
        return self._through([p.wall_s for p in self.points], self.wall)

    def cpu_cost(self) -> Piecewise | Linear:
        """CPU seconds through the measured points (the fit when they are at one size)."""
        return self._through([p.cpu_s for p in self.points], self.cpu)

    def _through(self, ys: list[float], fit: Fit) -> Piecewise | Linear:
        xs = [p.x for p in self.points]
        return fit.linear() if len(set(xs)) < 2 else Piecewise.through(xs, ys)


class TransferPoint(_Strict):
    tokens: int = Field(ge=1)
    bytes: int = Field(ge=1)
    experts: int = Field(1, ge=1, description="experts the call's rows are split over")
    round_trip_s: NonNeg
    compute_s: NonNeg
    one_way_s: NonNeg
    # Per call, over `cpu_calls` calls (format 2; None when the service's CPU was not readable):
    cpu_calls: int | None = Field(None, ge=1)
    service_cpu_s: NonNeg | None = Field(None, description="the service process, all threads")
    ffn_cpu_s: NonNeg | None = Field(None, description="the same FFN on the same rows in-process")
    router_cpu_s: NonNeg | None = Field(None, description="the calling process, all threads")


class Transport(_Strict):
    """Tc(bytes), one way; or why it was not measured. Format 2 adds the CPU seconds a Forward
    call costs each end against its bytes and experts: the service beyond the FFN it runs
    (receive, decode, batcher, one hand-off to the compute thread, encode, send), and the
    caller (encode, send, receive, decode)."""

    fit: Fit | None = None
    points: list[TransferPoint] = Field(default_factory=list)
    skipped: str | None = None
    service_call_cpu: Fit | None = Field(None, description="one expert per call, vs bytes")
    router_call_cpu: Fit | None = Field(None, description="one expert per call, vs bytes")
    # Calls whose rows go to several experts (the service runs one batch per expert): each
    # expert beyond the first adds this much, the median over `spread_points`.
    spread_points: list[TransferPoint] = Field(default_factory=list)
    service_expert_cpu: NonNeg | None = None
    router_expert_cpu: NonNeg | None = None
    cpu_skipped: str | None = Field(None, description="why the per-call CPU was not measured")


class ProfileFile(_Strict):
    format: Literal["moe-mesh-profile/1", "moe-mesh-profile/2", "moe-mesh-profile/3"] = FORMAT
    checkpoint: str
    model_id: str = Field(min_length=1)
    family: str
    dtype: str
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    moe_layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    bytes_per_token: int = Field(ge=1, description="one token's activations on the wire")
    expert_bytes: int = Field(ge=1, description="weights of one routed expert")
    dense_bytes: int = Field(ge=0, description="weights the router holds")
    cores: int = Field(ge=1, description="cores of the machine profiled")
    memory_bandwidth: NonNeg | None = Field(
        None, description="bytes/s the machine profiled reads with all its cores (format 3)"
    )
    context: int = Field(ge=1, description="KV-cache tokens per sequence while timing attention")
    ta: Measured = Field(description="router side of one MoE layer against micro-batch sequences")
    te: Measured = Field(description="all experts of one MoE layer against its tokens")
    dense: Measured | None = Field(None, description="one non-MoE layer; None when there is none")
    head: Measured = Field(description="embedding, final norm, LM head: once per step")
    expert_load_shares: dict[str, list[NonNeg]] = Field(
        description="MoE layer -> each expert's share of its routed tokens on random input"
    )
    transports: dict[str, Transport]


def read_profile(path: Path) -> ProfileFile:
    """Read and check a profile; every problem is a PlanError 'FILE: field: message'."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read the profile ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a JSON object as `moe-mesh profile` writes")
    try:
        profile = ProfileFile.model_validate(raw)
    except ValidationError as e:
        raise invalid(path, e) from None
    if not any(t.fit is not None for t in profile.transports.values()):
        raise PlanError(f"{path}: transports: no transport was measured")
    return profile


def _sizes(text: Any) -> Any:
    """'1,4,16' -> (1, 4, 16): sorted, each once."""
    if not isinstance(text, str):
        return text
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"expected integers >= 1 separated by ',', got {text!r}")
    return tuple(sizes)


class ProfileSettings(BaseModel):
    """What `moe-mesh profile` measures, and how (its flags)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path = Field(
        description="HuggingFace-layout checkpoint directory", json_schema_extra={"metavar": "DIR"}
    )
    out: Path | None = Field(
        None,
        description="write the profile here instead of stdout",
        json_schema_extra={"metavar": "FILE"},
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype of router and experts (the services' default)"
    )
    model_id: str | None = Field(
        None, description="model id; unset: the checkpoint directory's name"
    )
    context: int = Field(128, ge=1, description="KV-cache tokens per sequence")
    sizes: tuple[int, ...] = Field(
        (1, 2, 4, 8, 16, 32, 64),
        description="micro-batch sizes for Ta and Te",
        json_schema_extra={"metavar": "B,B,..."},
    )
    transfer_tokens: tuple[int, ...] = Field(
        (1, 8, 32, 128, 512),
        description="tokens per Forward call for Tc",
        json_schema_extra={"metavar": "N,N,..."},
    )
    repeats: int = Field(20, ge=1, description="timed runs per point")
    cpu_window_s: float = Field(
        1.0,
        ge=0,
        le=600,
        description="back-to-back calls per transfer size for the per-call CPU of both ends, at "
        "least this long (/proc counts CPU in 10 ms ticks)",
    )
    router_threads: int = Field(
        default_factory=lambda: os.cpu_count() or 1,
        ge=1,
        description="torch threads for the router side; unset: every core, as the router",
    )
    expert_threads: int = Field(
        1,
        ge=1,
        description="torch threads for the expert side (as `moe-mesh up` gives its services)",
    )
    share_tokens: int = Field(
        4096, ge=1, description="random tokens routed to estimate each expert's load share"
    )
    experts: list[str] | None = Field(
        None,
        description="time transfers against this running expert service (the first one); unset: "
        "start one on loopback",
        json_schema_extra={"metavar": "HOST:PORT", "nargs": "+"},
    )
    ready_file: Path | None = Field(
        None,
        description="a running `moe-mesh up` mesh's ready file",
        json_schema_extra={"metavar": "FILE"},
    )
    connect_timeout_s: float = Field(30.0, gt=0, description="", json_schema_extra={"hidden": True})

    @field_validator("sizes", "transfer_tokens", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _sizes(value)
