"""The OpenAI bodies' sampling parameters: every field by name, chat's renamed ones with their names."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from common.errors import InvalidArgumentError
from common.sampling import SamplingParams
from gateway.openai_sampling import sampling_params
from gateway.openai_schema import ChatBody, CompletionBody

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SENT = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 3,
    "min_p": 0.25,
    "seed": 11,
    "stop_token_ids": [4, 9],
    "ignore_eos": True,
    "presence_penalty": -1.5,
    "frequency_penalty": 1.25,
    "repetition_penalty": 1.5,
    "min_tokens": 2,
}
EXPECTED = SamplingParams(**{**SENT, "stop_token_ids": (4, 9)})


def test_a_completion_body_maps_every_field_by_name() -> None:
    body = CompletionBody.model_validate({"prompt": "hi", **SENT, "logprobs": 3})
    assert sampling_params(body) == (
        replace(EXPECTED, logprobs=3),
        {},
    )


def test_what_a_body_leaves_out_is_the_default_and_max_tokens_the_servers() -> None:
    for body in (CompletionBody.model_validate({"prompt": "hi"}), ChatBody.model_validate(CHAT)):
        assert sampling_params(body)[0] == SamplingParams(max_tokens=None)


def test_chat_names_its_own_fields() -> None:
    body = ChatBody.model_validate(
        {**CHAT, **SENT, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2}
    )
    params, names = sampling_params(body)
    assert params == replace(EXPECTED, max_tokens=5, logprobs=2)
    assert names == {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    params, names = sampling_params(ChatBody.model_validate({**CHAT, "max_tokens": 4}))
    assert params.max_tokens == 4 and params.logprobs is None and "max_tokens" not in names
    params, _ = sampling_params(ChatBody.model_validate({**CHAT, "logprobs": True}))
    assert params.logprobs == 0  # the chosen tokens' logprobs, no alternatives


def test_chat_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(InvalidArgumentError, match="^top_logprobs: needs logprobs: true$"):
        sampling_params(ChatBody.model_validate({**CHAT, "top_logprobs": 2}))


def test_the_names_reach_validation() -> None:
    params, names = sampling_params(ChatBody.model_validate({**CHAT, "max_completion_tokens": 0}))
    with pytest.raises(InvalidArgumentError) as e:
        params.validate(names=names)
    assert e.value.field == "max_completion_tokens"


def test_both_bodies_declare_every_sampling_field() -> None:
    """A knob added to SamplingParams and not to the bodies fails here."""
    for body in (CompletionBody, ChatBody):
        missing = [f.name for f in fields(SamplingParams) if f.name not in body.model_fields]
        assert missing == [], body.__name__
