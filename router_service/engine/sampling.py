"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, with an optional per-request seed.

Filters run in transformers' order and with its arithmetic (`filtered_logits`, checked against its
logits warpers in tests/unit/router_service/engine/test_sampling.py): temperature, top-k, top-p over
the top-k survivors, then min-p. vLLM runs min-p before top-k/top-p, which can keep fewer tokens: its
top-p then counts mass on a distribution min-p already cut. Run last, min-p keeps exactly what it
would alone (its cut is relative to the most likely token, which every filter keeps), and top-p
counts the model's own mass.

Randomness is a function of (seed, absolute position) only: the token at position p is drawn from
a generator seeded with mix(seed, p). A sequence resumed elsewhere from its prompt plus the tokens
generated so far (gateway failover) therefore continues with exactly the tokens it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TokenLogprobs:
    """A produced token's logprob under the model's own distribution, and the most likely tokens'."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def penalized_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """`logits` [vocab] with the penalties applied, before temperature and the filters (vLLM's order).

    repetition_penalty (CTRL, as transformers' RepetitionPenaltyLogitsProcessor): a token seen in the
    prompt or the output has its logit divided by the penalty when positive, multiplied when negative.
    presence / frequency (OpenAI): logit -= frequency x count in the output + presence x (count > 0).
    Costs O(prompt + output) per token, and only for requests that set a penalty.
    """
    x = logits.float().clone()
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt).union(output)), dtype=torch.long)
        v = x[seen]
        p = params.repetition_penalty
        x[seen] = torch.where(v > 0, v / p, v * p)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).float()
        x -= counts * params.frequency_penalty + (counts > 0).float() * params.presence_penalty
    return x


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The logprob of `token` and the `top` most likely tokens under log_softmax of the raw logits
    (before penalties, temperature and filters: what the model says, as vLLM reports by default)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(lp, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprobs(float(lp[token]), pairs)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for the token at absolute `position` of a sequence seeded `seed`.

    Pure integer mixing (splitmix64), so it is the same in every process (unlike hash()).
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 logits [vocab] `sample` draws from: temperature-scaled, filtered tokens at -inf.

    softmax of the result is the sampling distribution. Greedy params leave only the argmax finite.
    Each filter is transformers' warper of the same name, operation for operation (so surviving
    sets agree exactly, ties at the top-p boundary included): TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, in the order generate() applies them.
    """
    if params.greedy:
        keep = torch.full_like(logits, float("-inf"), dtype=torch.float32)
        top = greedy(logits)
        keep[top] = logits[top].float()
        return keep
    scaled = logits.float() / params.temperature  # [vocab]
    if 0 < params.top_k < scaled.numel():
        # Every token tied with the k-th stays, as in transformers.
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        # Ascending order: a token goes when the mass of it and every less likely token is at most
        # 1 - top_p, i.e. the tokens above it already hold top_p. The most likely token always stays.
        ascending, order = torch.sort(scaled)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[-1] = False
        scaled = scaled.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        drop = probs < params.min_p * probs.amax()
        # The argmax always stays, whatever a NaN made of the comparison (transformers' min_tokens_to_keep).
        drop[torch.argmax(probs)] = False
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [vocab]; never raises on non-finite or degenerate distributions."""
    if params.greedy:
        return greedy(logits)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    # NaN logits, or an inf left by a temperature just above GREEDY_BELOW (common/sampling.py):
    # multinomial would raise.
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return greedy(logits)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy(logits: torch.Tensor) -> int:
    """The most probable token (the first of equals); NaN never wins."""
    return int(torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf"))))
