"""One expert group's autoscaling: its bounds and behaviour (`Autoscale`, a plan's `autoscale:`
block and `up --autoscale`'s flags) and the decision, Kubernetes' HorizontalPodAutoscaler algorithm
without I/O, so the local controller and the rendered HPA and Nomad policies mean the same thing.

A decision, each `interval` (HPA: kube-controller-manager's sync period, 15 s):
  ratio    = load per replica / target; within 1 ± tolerance nothing changes (the hysteresis that
             keeps a steady load from flapping)
  raw      = ceil(replicas × load per replica / target), the replicas that would hold the target
  stable   = at least the smallest raw of the last scale_up_window_s, at most the largest of the
             last scale_down_window_s (HPA's stabilization windows: a dip or a spike shorter than
             the window moves nothing)
  limited  = at most max_step_up more / max_step_down fewer replicas per step_period_s (HPA's
             Pods policies), then within [min_replicas, max_replicas]
and a guard: while the gateway's p99 time per output token is over `tpot_slo_ms`, nothing scales down.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# What each metric counts, as every expert service exports it (common/telemetry.py): counters whose
# rate per replica is the load. The rendered HPA and Nomad policies query the same series.
SERIES = {
    "token_rows": "moe_expert_batch_tokens_sum",  # token rows computed: rows/s per replica
    "busy": "moe_expert_compute_duration_seconds_sum",  # seconds computing: a busy fraction
}
UNITS = {"token_rows": "token rows/s", "busy": "busy fraction"}
DEFAULT_BUSY_TARGET = (
    0.6  # HPA users' usual CPU target: headroom for a spike while a replica starts
)


class Autoscale(BaseModel):
    """Bounds and behaviour of one group's autoscaling; defaults are HPA's where it has one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1, le=256, description="never fewer replicas")
    max_replicas: int = Field(4, ge=1, le=256, description="never more replicas")
    metric: Literal["busy", "token_rows"] = Field(
        "busy",
        description="load per replica: token_rows (rows the replica computed per second, from "
        "moe_expert_batch_tokens) or busy (the share of time it computed, from "
        "moe_expert_compute_duration_seconds)",
    )
    target: float | None = Field(
        None,
        gt=0,
        validate_default=True,  # token_rows has no default target: say so when none is given
        description=f"the load per replica to hold: a fraction 0-1 for busy (default "
        f"{DEFAULT_BUSY_TARGET}), rows/s for token_rows (required: what a replica computes at "
        "your TPOT SLO, measured with `moe-mesh bench`)",
    )
    tolerance: float = Field(
        0.1, ge=0, lt=1, description="no change while load / target is within 1 ± this"
    )
    scale_up_window_s: float = Field(
        0, ge=0, le=3600, description="scale up to the smallest recommendation of this window"
    )
    scale_down_window_s: float = Field(
        300, ge=0, le=3600, description="scale down to the largest recommendation of this window"
    )
    max_step_up: int = Field(4, ge=1, le=256, description="replicas added per step period at most")
    max_step_down: int = Field(
        1, ge=1, le=256, description="replicas removed per step period at most"
    )
    step_period_s: float = Field(
        15, gt=0, le=3600, description="the period of the step limits; also the cool-down after "
        "a change, during which the group is not changed again"
    )  # fmt: skip
    interval_s: float = Field(15, gt=0, le=600, description="seconds between decisions")
    tpot_slo_ms: float | None = Field(
        None,
        gt=0,
        description="guard: no scale-down while the p99 time per output token is over this",
    )

    @field_validator("max_replicas")
    @classmethod
    def _bounds(cls, v: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas", 1)
        if v < low:
            raise ValueError(f"{v} is below min_replicas {low}")
        return v

    @field_validator("target")
    @classmethod
    def _target_of_metric(cls, v: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("metric") == "token_rows" and v is None:
            raise ValueError(
                "metric token_rows needs a target: the token rows/s one replica computes at your "
                "TPOT SLO (`moe-mesh bench` against one replica)"
            )
        return v

    def problem(self) -> str | None:
        """What the fields cannot say one at a time (flags are checked before --metric is known)."""
        if self.metric == "busy" and self.target is not None and self.target > 1:
            return f"target: a busy target is a fraction of time, 0-1, not {self.target:g}"
        return None

    @property
    def rate_window_s(self) -> float:
        """The window load rates are taken over: several samples, so one scrape's noise moves nothing."""
        return 4 * self.interval_s

    @property
    def level(self) -> float:
        """The target, with busy's default filled in."""
        return DEFAULT_BUSY_TARGET if self.target is None else self.target


@dataclass(frozen=True)
class Decision:
    """What one evaluation saw and chose: logged as a JSON line and exported as metrics."""

    time_s: float
    group: str
    metric: str
    load: float | None  # per replica; None: no measurement yet (nothing changes)
    target: float
    current: int
    raw: int  # what the load alone asks for
    desired: int  # after windows, step limits, bounds, guard and cool-down
    reason: str

    @property
    def action(self) -> str:
        if self.desired == self.current:
            return "hold"
        return "up" if self.desired > self.current else "down"


class Recommender:
    """One group's decisions over time: the windows' recommendations and the recent changes."""

    def __init__(self, group: str, policy: Autoscale) -> None:
        self.group, self.policy = group, policy
        self._recommendations: deque[tuple[float, int]] = deque()
        self._changed_at = -math.inf
        self._start: tuple[float, int] | None = None  # (time, replicas) of the first decision

    def decide(
        self, now: float, current: int, load: float | None, tpot_p99_ms: float | None = None
    ) -> Decision:
        """`load`: the group's load per replica now (its metric's unit); `current`: replicas serving."""
        p = self.policy
        if load is None:
            return self._decision(now, current, load, current, current, "no measurement yet")
        if self._start is None:
            self._start = (now, current)
        within = abs(load / p.level - 1) <= p.tolerance
        raw = current if within else math.ceil(load * current / p.level)  # 0: none needed
        self._recommendations.append((now, raw))
        horizon = max(p.scale_up_window_s, p.scale_down_window_s)
        while self._recommendations and self._recommendations[0][0] < now - horizon:
            self._recommendations.popleft()
        up = min(r for t, r in self._recommendations if t >= now - p.scale_up_window_s)
        down = max(r for t, r in self._recommendations if t >= now - p.scale_down_window_s)
        if now < self._start[0] + p.scale_down_window_s:  # the count found counts as recommended:
            down = max(down, self._start[1])  # a (re)started loop waits a window to scale down
        desired = current
        reason = (
            f"load within ±{p.tolerance:g} of the target" if within else "the load asks for as many"
        )
        if up > current:
            desired, reason = up, "over the target for the scale-up window"
        elif down < current:
            desired, reason = down, "under the target for the scale-down window"
        elif raw > current:
            reason = "over the target, not yet for the scale-up window"
        elif raw < current:
            reason = "under the target, not yet for the scale-down window"
        desired, reason = self._limited(now, current, desired, reason, tpot_p99_ms)
        if desired != current:
            self._changed_at = now
        return self._decision(now, current, load, raw, desired, reason)

    def _limited(
        self, now: float, current: int, desired: int, reason: str, tpot_p99_ms: float | None
    ) -> tuple[int, str]:
        p = self.policy
        if desired < current and p.tpot_slo_ms is not None and (tpot_p99_ms or 0) > p.tpot_slo_ms:
            return current, f"TPOT p99 {tpot_p99_ms:.0f} ms is over the {p.tpot_slo_ms:g} ms SLO"
        bounded = min(max(desired, p.min_replicas), p.max_replicas)
        if bounded != desired:
            desired, reason = bounded, f"{reason}; held within [{p.min_replicas}, {p.max_replicas}]"
        if desired != current and now < self._changed_at + p.step_period_s:
            return current, f"{reason}; cooling down after the change at {self._changed_at:.0f} s"
        if desired > current + p.max_step_up:
            desired, reason = current + p.max_step_up, f"{reason}; at most +{p.max_step_up} a step"
        if desired < current - p.max_step_down:
            desired = current - p.max_step_down
            reason = f"{reason}; at most -{p.max_step_down} a step"
        return desired, reason

    def _decision(
        self, now: float, current: int, load: float | None, raw: int, desired: int, reason: str
    ) -> Decision:
        p = self.policy
        return Decision(now, self.group, p.metric, load, p.level, current, raw, desired, reason)
