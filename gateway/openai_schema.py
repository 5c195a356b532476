"""The OpenAI request bodies the HTTP API accepts, as pydantic models: strict JSON types, this
gateway's limits in the schema (so an oversized list is refused before its items are validated and
the OpenAPI document states the limits), and every field OpenAI defines declared, so that a field
nobody defines is refused with a 400 naming it (unless `allow_unknown_fields`).

OpenAI's fields this server does not implement are of two kinds: those that cannot change the tokens
(`IGNORED`: accepted and ignored) and those that would (`REFUSED`: a 400 naming the field unless
absent or set to a value that asks for nothing)."""

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

from common.errors import InvalidArgumentError
from common.sampling import MAX_LOGPROBS
from gateway.settings import GatewaySettings

_StrList = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]


class _Json(BaseModel):
    """Strict: JSON types must match exactly ("10" is not an int, true is not 1). Unknown fields
    pass here, inside nested objects (a message's `name` reaches the chat template); bounded_bodies
    decides for the top level."""

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

    # OpenAI's, accepted and ignored: they cannot change the tokens (IGNORED).
    user: Any = None
    # OpenAI's, refused unless they ask for nothing (REFUSED).
    logit_bias: Any = None


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Any = None
    suffix: Any = None


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
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


# OpenAI's fields that cannot change the tokens this server generates: accepted, ignored. (Who the
# user is, what to store or bill, a caching or speculation hint, tool-call parallelism without tools.)
IGNORED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "parallel_tool_calls",
    "prediction",
)
# OpenAI's fields that would change the result and that this server does not implement, with the
# values that ask for nothing (besides absent, null, false, "", [] and {}): anything else is a 400.
REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": (),
    "logit_bias": (),
    "tools": (),
    "tool_choice": ("none", "auto"),  # without tools, both mean no tool call
    "functions": (),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}


def refuse_unsupported(body: BaseModel) -> None:
    """InvalidArgumentError naming the first REFUSED field `body` sets to a value that asks for
    something this server cannot do."""
    for name, no_ops in REFUSED.items():
        value = getattr(body, name, None)
        if value not in (None, False, "", [], {}) and value not in no_ops:
            raise InvalidArgumentError(name, "is not supported by this server")


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
    prompts = Field(min_length=1, max_length=s.max_prompts)
    # Picked by the value's shape, so a refusal names the one form that was sent (a plain union
    # would list why the value is none of the four).
    prompt = Annotated[
        Annotated[str, Tag("str")]
        | Annotated[ids, Tag("list[int]")]
        | Annotated[list[str], prompts, Tag("list[str]")]
        | Annotated[list[ids], prompts, Tag("list[list[int]]")],
        Discriminator(
            _prompt_form,
            custom_error_type="prompt_form",
            custom_error_message="must be a string, a list of token ids, or a list of either",
        ),
    ]
    # Pydantic's own refusal of an unknown field ("extra_forbidden") is worded by http_edge.
    closed = {} if s.allow_unknown_fields else {"extra": "forbid"}
    completion = create_model(
        "CompletionBody",
        __base__=CompletionBody,
        __cls_kwargs__=closed,
        prompt=(prompt, ...),
        **shared,
    )
    chat = create_model(
        "ChatBody",
        __base__=ChatBody,
        __cls_kwargs__=closed,
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
