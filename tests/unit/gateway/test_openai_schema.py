"""The OpenAI request bodies: strict JSON types, null as absent, the prompt's four forms, unknown
fields refused (unless allowed), OpenAI's unimplemented fields ignored or refused, and this gateway's
limits in the schema."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.errors import InvalidArgumentError
from gateway.openai_schema import IGNORED, REFUSED, bounded_bodies, refuse_unsupported
from gateway.settings import GatewaySettings

SETTINGS = GatewaySettings(
    checkpoint="unused", routers=["a:1"], max_stop_strings=2, max_stop_chars=4, max_messages=3
)
Completion, Chat = bounded_bodies(SETTINGS, max_model_len=8)


def refusal(body_type, data: dict) -> tuple[tuple, str]:
    """(where, error type) of the first problem pydantic finds in `data`."""
    with pytest.raises(ValidationError) as e:
        body_type.model_validate(data)
    first = e.value.errors()[0]
    return first["loc"], first["type"]


def test_the_prompt_is_one_of_four_forms_named_by_its_shape() -> None:
    assert Completion.model_validate({"prompt": "hi"}).prompt == "hi"
    assert Completion.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    assert Completion.model_validate({"prompt": ["hi"]}).prompt == ["hi"]
    assert Completion.model_validate({"prompt": [[1]]}).prompt == [[1]]
    assert refusal(Completion, {"prompt": 5}) == (("prompt",), "prompt_form")
    # A list of ids is checked as ids only, and against the context length.
    assert refusal(Completion, {"prompt": [1, "x"]}) == (("prompt", "list[int]", 1), "int_type")
    assert refusal(Completion, {"prompt": list(range(9))})[1] == "too_long"


def test_types_are_strict_and_null_is_absent() -> None:
    body = Completion.model_validate(
        {"prompt": "x", "max_tokens": None, "stop": "end", "user": "someone", "nobody": None}
    )
    assert body.max_tokens is None and body.stop == ["end"]  # one string is a list of one
    assert body.user == "someone" and not body.model_extra
    assert refusal(Completion, {"prompt": "x", "max_tokens": "10"}) == (("max_tokens",), "int_type")
    assert refusal(Completion, {"prompt": "x", "ignore_eos": 1}) == (("ignore_eos",), "bool_type")
    assert refusal(Completion, {"prompt": "x", "seed": -1}) == (("seed",), "greater_than_equal")


def test_a_field_nobody_defines_is_refused_unless_allowed() -> None:
    assert refusal(Completion, {"prompt": "x", "temprature": 0}) == (
        ("temprature",),
        "extra_forbidden",
    )
    # A chat-only field is unknown to completions.
    assert refusal(Completion, {"prompt": "x", "tools": []}) == (("tools",), "extra_forbidden")
    assert refusal(Chat, {"messages": [], "guided_json": {}}) == (
        ("guided_json",),
        "extra_forbidden",
    )
    # Inside a message, extra fields still reach the template.
    message = {"role": "user", "content": "x", "name": "bob"}
    assert Chat.model_validate({"messages": [message]}).messages[0].model_extra == {"name": "bob"}
    allowing = SETTINGS.model_copy(update={"allow_unknown_fields": True})
    lenient, _ = bounded_bodies(allowing, max_model_len=8)
    body = lenient.model_validate({"prompt": "x", "temprature": 0})
    assert body.model_extra == {"temprature": 0}
    # The OpenAPI document says so (schemathesis generates from it).
    assert Completion.model_json_schema()["additionalProperties"] is False
    assert lenient.model_json_schema()["additionalProperties"] is True


def test_openais_fields_are_ignored_when_harmless_and_refused_when_they_ask_for_something() -> None:
    for name in IGNORED:
        assert name in Chat.model_fields, name
    chat = {
        "messages": [],
        "user": "u",
        "store": True,
        "metadata": {"k": "v"},
        "tool_choice": "auto",
    }
    refuse_unsupported(Chat.model_validate(chat))  # harmless, and no-op values
    refuse_unsupported(Completion.model_validate({"prompt": "x", "best_of": 1, "logit_bias": {}}))
    for body_type, data, name in [
        (Completion, {"prompt": "x", "best_of": 2}, "best_of"),
        (Completion, {"prompt": "x", "suffix": "end"}, "suffix"),
        (Completion, {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
        (Chat, {"messages": [], "tool_choice": "required"}, "tool_choice"),
        (Chat, {"messages": [], "response_format": {"type": "json_object"}}, "response_format"),
        (Chat, {"messages": [], "modalities": ["text", "audio"]}, "modalities"),
        (Chat, {"messages": [], "reasoning_effort": "low"}, "reasoning_effort"),
    ]:
        with pytest.raises(InvalidArgumentError) as e:
            refuse_unsupported(body_type.model_validate(data))
        assert e.value.field == name
    assert set(REFUSED) <= set(Chat.model_fields) | set(Completion.model_fields)


def test_a_list_of_prompts_is_bounded_by_max_prompts_and_must_not_be_empty() -> None:
    few, _ = bounded_bodies(SETTINGS.model_copy(update={"max_prompts": 2}), max_model_len=8)
    assert few.model_validate({"prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert few.model_validate({"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]
    assert refusal(few, {"prompt": ["a", "b", "c"]}) == (("prompt", "list[str]"), "too_long")
    assert refusal(few, {"prompt": [[1], [2], [3]]}) == (("prompt", "list[list[int]]"), "too_long")
    # An empty list is read as no token ids, which the core refuses naming `prompt`.
    assert few.model_validate({"prompt": []}).prompt == []


def test_the_settings_limits_are_in_the_schema() -> None:
    assert refusal(Completion, {"prompt": "x", "stop": ["a", "b", "c"]}) == (("stop",), "too_long")
    assert refusal(Chat, {"messages": [], "stop": ["12345"]}) == (("stop", 0), "string_too_long")
    messages = [{"role": "user", "content": "x"}] * 4
    assert refusal(Chat, {"messages": messages}) == (("messages",), "too_long")
    assert refusal(Completion, {"prompt": "x", "model": "m" * 300}) == (
        ("model",),
        "string_too_long",
    )
    schema = Chat.model_json_schema()
    assert schema["properties"]["messages"]["maxItems"] == 3


def test_chat_roles_and_logprobs_bounds() -> None:
    assert refusal(Chat, {"messages": [{"role": "robot", "content": "x"}]})[1] == "literal_error"
    assert refusal(Chat, {"messages": [], "top_logprobs": 21}) == (
        ("top_logprobs",),
        "less_than_equal",
    )
    assert refusal(Completion, {"prompt": "x", "logprobs": 21}) == (
        ("logprobs",),
        "less_than_equal",
    )
