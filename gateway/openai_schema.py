"""The OpenAI request bodies the HTTP API accepts, as pydantic models: strict JSON types, unknown
fields allowed (OpenAI clients send some), and this gateway's limits in the schema, so an oversized
list is refused before its items are validated and the OpenAPI document states the limits."""

# No `from __future__ import annotations`: pydantic's create_model and FastAPI read these
# annotations as objects.

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)

from common.sampling import MAX_LOGPROBS
from gateway.settings import GatewaySettings

_StrList = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]


class _Json(BaseModel):
    """Strict: JSON types must match exactly ("10" is not an int, true is not 1); unknown fields pass."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # OpenAI's API reads `"field": null` as an omitted field, and some clients send it.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Json):
    include_usage: bool = False


class Body(_Json):
    """Fields both endpoints share."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # The bounds below are the ranges of the wire types behind the core (the gRPC API gets them from
    # its proto types); values inside them are validated by the core.
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: _StrList = []
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: Annotated[int, Field(lt=2**31)] | None = None
    min_p: float | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None  # None: the key's (auth)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    return_token_ids: bool = False
    request_id: str = ""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0, lt=2**31)] = 0


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ContentPart(_Json):
    type: str
    text: str | None = None


class ChatMessage(_Json):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatBody(Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # vLLM's extensions: variables for the template (e.g. enable_thinking), and whether to end the
    # prompt with the assistant's header.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def bounded_bodies(
    s: GatewaySettings, max_model_len: int
) -> tuple[type[CompletionBody], type[ChatBody]]:
    """The request bodies with this gateway's limits in their schema (and so in its OpenAPI document)."""
    ident = Annotated[str, Field(max_length=s.max_id_chars)]
    stop = Annotated[
        list[Annotated[str, Field(max_length=s.max_stop_chars)]],
        BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
        Field(max_length=s.max_stop_strings),
    ]
    shared = {
        "model": (ident, ""),
        "request_id": (ident, ""),
        "stop": (stop, []),
        "stop_token_ids": (Annotated[list[int], Field(max_length=s.max_stop_strings)], []),
    }
    ids = Annotated[list[int], Field(max_length=max_model_len)]
    # Picked by the value's shape, so a refusal names the one form that was sent (a plain union
    # would list why the value is none of the four).
    prompt = Annotated[
        Annotated[str, Tag("str")]
        | Annotated[ids, Tag("list[int]")]
        | Annotated[list[str], Field(max_length=64), Tag("list[str]")]
        | Annotated[list[ids], Field(max_length=64), Tag("list[list[int]]")],
        Discriminator(
            _prompt_form,
            custom_error_type="prompt_form",
            custom_error_message="must be a string, a list of token ids, or a list holding one "
            "of those",
        ),
    ]
    completion = create_model(
        "CompletionBody", __base__=CompletionBody, prompt=(prompt, ...), **shared
    )
    chat = create_model(
        "ChatBody",
        __base__=ChatBody,
        **shared,
        messages=(Annotated[list[ChatMessage], Field(max_length=s.max_messages)], ...),
    )
    return completion, chat


def _prompt_form(value: Any) -> str | None:
    """Which form of `prompt` a value is meant as (its first element decides for a list)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return {str: "list[str]", list: "list[list[int]]"}.get(type(first), "list[int]")
