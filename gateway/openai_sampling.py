"""The OpenAI request body's sampling parameters, for both endpoints: a body field named as a
SamplingParams field maps to it; the two that OpenAI spells otherwise are mapped here, with the
body's names for them, so that an error names the field the client sent."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from pydantic import BaseModel

from common.errors import InvalidArgumentError
from common.sampling import SamplingParams

# The body's fields that are not SamplingParams fields of the same meaning.
_MAPPED_HERE = ("max_tokens", "logprobs")


def sampling_params(body: BaseModel) -> tuple[SamplingParams, dict[str, str]]:
    """(the params, the body's name for each field it names otherwise); max_tokens None when the
    body leaves it to the server. Limits are checked later, once, by SamplingParams.validate."""
    declared = type(body).model_fields
    given: dict[str, Any] = {}
    for f in fields(SamplingParams):
        value = getattr(body, f.name, None) if f.name in declared else None
        if value is not None and f.name not in _MAPPED_HERE:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    names: dict[str, str] = {}
    max_tokens = getattr(body, "max_tokens", None)
    if getattr(body, "max_completion_tokens", None) is not None:  # chat's newer name wins
        max_tokens = body.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    logprobs = getattr(body, "logprobs", None)  # completions: alternatives per token, or None
    if "top_logprobs" in declared:  # chat: a flag, and how many alternatives
        top = getattr(body, "top_logprobs", None)
        if top is not None and not logprobs:
            raise InvalidArgumentError("top_logprobs", "needs logprobs: true")
        logprobs, names["logprobs"] = (top or 0) if logprobs else None, "top_logprobs"
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given), names
