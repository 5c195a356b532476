"""A request's sampling parameters: one type from the public APIs to the router's sampler, its one
check of every field's limits, and its conversion to and from protobuf messages.

A new knob is a field here (with its limit in the field's metadata), a field of the same name in
the protos, and a line in the OpenAI mapping (gateway/openai_sampling.py); the converters and the
check find it by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from google.protobuf.message import Message

from common.errors import InvalidArgumentError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature overflows to inf and softmax to NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Range:
    """An interval a field's value must lie in; NaN and infinities never do."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(x: float) -> str:
    """2^31 rather than 2147483648: the limits of wire types read better as powers of two."""
    if isinstance(x, int) and x >= 2**31 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounded(default: Any, limit: Range) -> Any:
    return field(default=default, metadata={"range": limit})


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled. `validate()` checks every field against its limit."""

    # None: the server's default (the gateway resolves it before routing).
    max_tokens: int | None = 16
    temperature: float = _bounded(1.0, Range(0))  # 0 (or anything below GREEDY_BELOW) is greedy
    top_p: float = _bounded(1.0, Range(0, 1, low_open=True))  # 1 disables nucleus filtering
    top_k: int = _bounded(0, Range(0, 2**31, high_open=True))  # 0 disables top-k filtering
    # 0 disables; keeps tokens with probability >= min_p x the most likely's.
    min_p: float = _bounded(0.0, Range(0, 1))
    seed: int | None = _bounded(None, Range(0, 2**64, high_open=True))  # None: the server picks one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties over the tokens generated so far; 0 disables.
    presence_penalty: float = _bounded(0.0, Range(-2, 2))
    frequency_penalty: float = _bounded(0.0, Range(-2, 2))
    # HF/vLLM's over prompt and generated tokens; 1 disables.
    repetition_penalty: float = _bounded(1.0, Range(0, low_open=True))
    min_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this many tokens
    # Return each token's logprob and this many top alternatives; None: no logprobs.
    logprobs: int | None = _bounded(None, Range(0, MAX_LOGPROBS))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1

    def validate(
        self,
        vocab_size: int | None = None,
        max_tokens_limit: int | None = None,
        names: Mapping[str, str] | None = None,
    ) -> SamplingParams:
        """These params, when every field is within its limit; else InvalidArgumentError naming the
        first field that is not, and its limit.

        `vocab_size` bounds stop_token_ids, `max_tokens_limit` max_tokens; `names` gives the API's
        name of a field where it differs (chat's max_completion_tokens), so errors use that name.
        """
        names = names or {}

        def invalid(name: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(names.get(name, name), why)

        if self.max_tokens is None:
            raise invalid("max_tokens", "must be set")
        for f in fields(self):
            value = getattr(self, f.name)
            limit = f.metadata.get("range")
            if f.name == "max_tokens":
                limit = Range(1, math.inf if max_tokens_limit is None else max_tokens_limit)
            if limit is not None and value is not None and value not in limit:
                raise invalid(f.name, f"must be {limit}, got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise invalid(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if vocab_size is not None:
            bad = next((t for t in self.stop_token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid(
                    "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
                )
        return self


def to_proto(params: SamplingParams, message: Message) -> Message:
    """`message` with every field of `params` it has set by name (None leaves a field unset)."""
    have = message.DESCRIPTOR.fields_by_name
    for f in fields(params):
        value = getattr(params, f.name)
        if f.name not in have or value is None:
            continue
        if have[f.name].is_repeated:
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)
    return message


def from_proto(
    message: Message, base: SamplingParams | None = None, **given: Any
) -> SamplingParams:
    """The params a message carries, by field name: a field it lacks, or an optional one it leaves
    unset, keeps `base`'s value (default SamplingParams()); `given` sets the fields whose wire form
    differs (the public API's logprobs flag and top_logprobs count), which are not read."""
    have = message.DESCRIPTOR.fields_by_name
    values: dict[str, Any] = {}
    for f in fields(SamplingParams):
        d = have.get(f.name)
        if f.name in given or d is None or (d.has_presence and not message.HasField(f.name)):
            continue
        value = getattr(message, f.name)
        values[f.name] = tuple(value) if d.is_repeated else value
    return replace(base or SamplingParams(), **values, **given)
