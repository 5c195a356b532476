"""The benchmark's workload: trace-shaped lengths, scaling, clipping to the model, seeds, arrivals."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from moe_mesh.benchmark.workload import (
    MEDIAN_INPUT_TOKENS,
    MEDIAN_OUTPUT_TOKENS,
    build_workload,
    clip_lengths,
    poisson_arrivals,
    sample_lengths,
)


def test_default_lengths_have_the_traces_medians_at_scale_1() -> None:
    lengths = sample_lengths(4000, random.Random(1), max_model_len=100_000, scale=1.0)
    inputs, outputs = zip(*lengths)
    assert statistics.median(inputs) == pytest.approx(MEDIAN_INPUT_TOKENS, rel=0.05)
    assert statistics.median(outputs) == pytest.approx(MEDIAN_OUTPUT_TOKENS, rel=0.05)
    # a spread, not a constant: the lognormal's middle 80% spans about 0.46x..2.2x the median
    q = statistics.quantiles(inputs, n=10)
    assert q[0] < 0.6 * MEDIAN_INPUT_TOKENS and q[-1] > 1.8 * MEDIAN_INPUT_TOKENS


def test_scale_multiplies_the_medians() -> None:
    lengths = sample_lengths(4000, random.Random(2), max_model_len=100_000, scale=0.1)
    inputs, outputs = zip(*lengths)
    assert statistics.median(inputs) == pytest.approx(57, abs=3)
    assert statistics.median(outputs) == pytest.approx(16, abs=1)
    assert min(inputs) >= 1 and min(outputs) >= 1


def test_fixed_lengths_are_not_scaled_nor_sampled() -> None:
    lengths = sample_lengths(
        50, random.Random(3), max_model_len=4096, scale=0.1, input_len=300, output_len=7
    )
    assert set(lengths) == {(300, 7)}


@pytest.mark.parametrize(
    ("lengths", "max_len", "want"),
    [
        ((100, 20), 512, (100, 20)),  # fits: untouched
        ((600, 20), 512, (492, 20)),  # the prompt gives way first
        ((600, 700), 512, (1, 511)),  # an output longer than the model leaves one prompt token
        ((0, 0), 512, (1, 1)),
    ],
)
def test_clipping_keeps_prompt_plus_output_within_max_model_len(lengths, max_len, want) -> None:
    assert clip_lengths(*lengths, max_len) == want


def test_sampled_lengths_never_exceed_the_model() -> None:
    lengths = sample_lengths(2000, random.Random(4), max_model_len=256, scale=1.0)
    assert max(i + o for i, o in lengths) <= 256
    assert any(i + o == 256 for i, o in lengths)  # the tail was clipped, not resampled


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    a = build_workload(20, 7, vocab_size=512, max_model_len=512)
    b = build_workload(20, 7, vocab_size=512, max_model_len=512)
    c = build_workload(20, 8, vocab_size=512, max_model_len=512)
    assert a == b and a != c
    assert all(0 <= t < 512 for r in a for t in r.prompt_token_ids)
    assert all(r.input_len + r.output_len <= 512 for r in a)


def test_poisson_arrivals_come_at_the_rate() -> None:
    rate, n = 20.0, 5000
    times = poisson_arrivals(n, rate, random.Random(5))
    assert times[0] == 0 and times == sorted(times)
    # n arrivals take about n / rate seconds; the count in any second is about `rate`
    assert times[-1] == pytest.approx(n / rate, rel=0.05)
    per_second = [sum(1 for t in times if s <= t < s + 1) for s in range(int(times[-1]))]
    assert statistics.mean(per_second) == pytest.approx(rate, rel=0.05)
    # Poisson: the variance of the count equals its mean (a fixed interval would give 0)
    assert statistics.variance(per_second) == pytest.approx(rate, rel=0.25)
    assert poisson_arrivals(n, rate, random.Random(5)) == times


def test_an_infinite_rate_sends_everything_at_once_and_a_rate_must_be_positive() -> None:
    assert poisson_arrivals(4, math.inf, random.Random(0)) == [0.0] * 4
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(4, 0, random.Random(0))
