"""What `moe-mesh bench` sends: prompt and output lengths, random-token prompts, arrival times.

Default lengths are shaped like MegaScale-Infer's production trace (median input 571 tokens, median
output 159): each length is drawn from a lognormal with that median and `SIGMA` = 0.6 in log space
(the middle 80% then spans 0.46x-2.2x the median), times `scale`, rounded, at least 1. Lengths are
then clipped to the model: the output first (at most max_model_len - 1), the prompt to what is left,
so a sampled request never exceeds max_model_len. Everything comes from one `random.Random(seed)`:
the same seed gives the same requests, for every set-up and every load level.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MEDIAN_INPUT_TOKENS = 571  # MegaScale-Infer, production trace
MEDIAN_OUTPUT_TOKENS = 159
SIGMA = 0.6  # lognormal sigma of both lengths, in log space
DEFAULT_SCALE = (
    0.1  # ~57 prompt and ~16 output tokens: minutes, not hours, on a tiny CPU checkpoint
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: the prompt's token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def lognormal_length(rng: random.Random, median: float, sigma: float, scale: float) -> int:
    """A length whose median is `median * scale`; at least 1."""
    return max(1, round(rng.lognormvariate(math.log(median), sigma) * scale))


def clip_lengths(input_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """(prompt, output) with prompt + output <= max_model_len, the output kept whole when it fits."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    output_len = max(1, min(output_len, max_model_len - 1))
    return max(1, min(input_len, max_model_len - output_len)), output_len


def sample_lengths(
    n: int,
    rng: random.Random,
    max_model_len: int,
    *,
    scale: float = DEFAULT_SCALE,
    input_len: int | None = None,
    output_len: int | None = None,
    sigma: float = SIGMA,
) -> list[tuple[int, int]]:
    """`n` (prompt, output) lengths: fixed where given (not scaled), else trace-shaped; clipped."""
    out = []
    for _ in range(n):
        i = input_len or lognormal_length(rng, MEDIAN_INPUT_TOKENS, sigma, scale)
        o = output_len or lognormal_length(rng, MEDIAN_OUTPUT_TOKENS, sigma, scale)
        out.append(clip_lengths(i, o, max_model_len))
    return out


def build_workload(
    n: int,
    seed: int,
    vocab_size: int,
    max_model_len: int,
    *,
    scale: float = DEFAULT_SCALE,
    input_len: int | None = None,
    output_len: int | None = None,
    sigma: float = SIGMA,
) -> list[BenchRequest]:
    """`n` requests whose prompts are uniformly random token ids in [0, vocab_size)."""
    rng = random.Random(seed)
    lengths = sample_lengths(
        n,
        rng,
        max_model_len,
        scale=scale,
        input_len=input_len,
        output_len=output_len,
        sigma=sigma,
    )
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(i)], o) for i, o in lengths]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of `n` requests arriving as a Poisson process of `rate`
    per second: exponential gaps, the first request at 0. An infinite rate sends all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return times
