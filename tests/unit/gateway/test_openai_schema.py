"""The OpenAI request bodies: strict JSON types, null as absent, the prompt's four forms, and this
gateway's limits in the schema."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.openai_schema import bounded_bodies
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


def test_types_are_strict_null_is_absent_and_unknown_fields_pass() -> None:
    body = Completion.model_validate(
        {"prompt": "x", "max_tokens": None, "stop": "end", "user": "someone"}
    )
    assert body.max_tokens is None and body.stop == ["end"]  # one string is a list of one
    assert body.model_extra == {"user": "someone"}
    assert refusal(Completion, {"prompt": "x", "max_tokens": "10"}) == (("max_tokens",), "int_type")
    assert refusal(Completion, {"prompt": "x", "ignore_eos": 1}) == (("ignore_eos",), "bool_type")
    assert refusal(Completion, {"prompt": "x", "seed": -1}) == (("seed",), "greater_than_equal")


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
