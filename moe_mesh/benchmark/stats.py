"""From per-request timings to one load point's figures: throughput, latency percentiles, goodput.

TTFT is send → first streamed token; TPOT is a request's decode time per token after the first,
(latency − TTFT) / (output tokens − 1); ITL is every gap between streamed chunks, pooled over the
requests. Goodput counts completed requests meeting both SLOs per second of the point's duration
(DistServe's definition); a one-token request has no TPOT and meets that SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_SLO_TTFT_MS = 1000.0  # an interactive chat service: the first token within a second,
DEFAULT_SLO_TPOT_MS = 100.0  # then at least 10 tokens/s, faster than people read


@dataclass
class RequestResult:
    """What one streamed request measured. Times are seconds; `start_s` is from the load point's start."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    start_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = DEFAULT_SLO_TTFT_MS
    tpot_ms: float = DEFAULT_SLO_TPOT_MS

    def met(self, r: RequestResult) -> bool:
        tpot = r.tpot_s
        return (
            r.ok
            and r.ttft_s * 1000 <= self.ttft_ms
            and (tpot is None or tpot * 1000 <= self.tpot_ms)
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between closest ranks (numpy's default);
    NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    if not values:
        return math.nan
    s = sorted(values)
    rank = (len(s) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def _ms(values: Sequence[float], quantiles: Sequence[int]) -> dict[str, float | None]:
    """{"mean": ..., "p50": ...} in milliseconds; None (JSON null) where there are no values."""

    def ms(v: float) -> float | None:
        return None if math.isnan(v) else round(v * 1000, 3)

    mean = sum(values) / len(values) if values else math.nan
    return {"mean": ms(mean), **{f"p{q}": ms(percentile(values, q)) for q in quantiles}}


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo: Slo,
    requested_output_tokens: int | None = None,
) -> dict:
    """One load point's figures, JSON-ready. `duration_s` is the point's wall time (first send to
    last answer) and divides every rate."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else math.nan

    def rate(x: float) -> float | None:
        return None if math.isnan(x * per_s) else round(x * per_s, 4)

    errors = sorted({r.error for r in results if not r.ok})
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration_s, 4),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requested_output_tokens": requested_output_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "goodput": rate(sum(slo.met(r) for r in done)),
        "ttft_ms": _ms([r.ttft_s for r in done], (50, 90, 99)),
        "tpot_ms": _ms([t for r in done if (t := r.tpot_s) is not None], (50, 90, 99)),
        "itl_ms": _ms([g for r in done for g in r.itl_s], (50, 99)),
        "e2e_latency_ms": _ms([r.latency_s for r in done], (50, 99)),
        "errors": errors[:5],  # the first few distinct messages: enough to see what went wrong
    }
