"""The benchmark's figures from per-request timings: percentiles, TPOT, throughput, goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_mesh.benchmark.stats import RequestResult, Slo, percentile, summarize


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([1, 2, 3, 4, 5], 50, 3),
        ([1, 2, 3, 4], 50, 2.5),
        ([10, 20, 30, 40, 50], 90, 46),  # rank 3.6: 40 + 0.6 * 10
        ([10, 20, 30, 40, 50], 99, 49.6),
        ([5, 1, 4], 0, 1),
        ([5, 1, 4], 100, 5),
        ([7], 99, 7),
    ],
)
def test_percentile_interpolates_between_closest_ranks(values, q, want) -> None:
    assert percentile(values, q) == pytest.approx(want)


def test_percentile_agrees_with_numpy_and_handles_empty_and_bad_input() -> None:
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="not in"):
        percentile([1], 101)


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    r = RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft_s=0.5, latency_s=1.5)
    assert r.tpot_s == pytest.approx(0.1)
    assert RequestResult(ok=True, prompt_tokens=1, output_tokens=1, latency_s=1).tpot_s is None
    assert RequestResult(ok=False, prompt_tokens=1, output_tokens=5).tpot_s is None


def _result(ttft_ms: float, tpot_ms: float, out: int = 11, start_s: float = 0.0) -> RequestResult:
    latency = (ttft_ms + tpot_ms * (out - 1)) / 1000
    gaps = [tpot_ms / 1000] * (out - 1)
    return RequestResult(True, 100, out, start_s, ttft_ms / 1000, latency, gaps)


def test_summarize_counts_throughput_percentiles_and_goodput() -> None:
    results = [
        _result(100, 20),  # meets both SLOs
        _result(200, 40),  # meets both
        _result(1500, 20),  # TTFT too slow
        _result(300, 150),  # TPOT too slow
        RequestResult(False, 100, error="HTTP 503: draining"),
    ]
    s = summarize(
        results, duration_s=2.0, slo=Slo(ttft_ms=1000, tpot_ms=100), requested_output_tokens=55
    )
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["output_tokens"] == 44 and s["input_tokens"] == 400
    assert s["requested_output_tokens"] == 55
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(22.0)
    assert s["total_token_throughput"] == pytest.approx(222.0)
    assert s["goodput"] == pytest.approx(1.0)  # 2 requests meeting both SLOs in 2 s
    assert s["ttft_ms"]["p50"] == pytest.approx(250)  # of 100, 200, 300, 1500
    assert s["ttft_ms"]["p99"] == pytest.approx(300 + 0.97 * 1200)
    assert s["tpot_ms"]["p50"] == pytest.approx(30) and s["tpot_ms"]["mean"] == pytest.approx(57.5)
    assert s["itl_ms"]["p50"] == pytest.approx(30)  # ten gaps of each request, pooled
    assert s["errors"] == ["HTTP 503: draining"]


def test_summarize_with_nothing_completed_reports_nulls_not_nan() -> None:
    s = summarize([RequestResult(False, 10, error="x")], duration_s=1.0, slo=Slo())
    assert s["completed"] == 0 and s["output_throughput"] == 0
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert s["goodput"] == 0


def test_a_one_token_request_has_no_tpot_and_meets_that_slo() -> None:
    r = RequestResult(True, 5, 1, 0.0, 0.2, 0.2, [])
    assert Slo(ttft_ms=500, tpot_ms=1).met(r)
    assert not Slo(ttft_ms=100, tpot_ms=1).met(r)
