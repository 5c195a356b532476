"""Per-request sampling: greedy, temperature, top-k, top-p, with an optional per-request seed.

Randomness is a function of (seed, absolute position) only: the token at position p is drawn from
a generator seeded with mix(seed, p). A sequence resumed elsewhere from its prompt plus the tokens
generated so far (gateway failover) therefore continues with exactly the tokens it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature overflows to inf and softmax to NaN.
GREEDY_BELOW = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) is greedy
    top_p: float = 1.0  # 1 disables nucleus filtering
    top_k: int = 0  # 0 disables top-k filtering
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [vocab]; never raises on non-finite or degenerate distributions."""
    if params.greedy:
        return _argmax(logits)
    scaled = logits.float() / params.temperature  # [vocab]
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens before it already hold top_p of the mass; the first always stays.
        drop = (probs.cumsum(-1) - probs) > params.top_p
        scaled = scaled.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # NaN logits, or an inf left by a temperature just above GREEDY_BELOW: multinomial would raise.
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return _argmax(logits)
    return int(torch.multinomial(probs, 1, generator=generator))


def _argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf"))))
