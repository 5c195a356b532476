"""The context-length check, owned here and made by both the gateway (before routing) and the engine
(which any router client may call directly), with one error class and one message; and the
engine's check against its KV-cache size."""

from __future__ import annotations

from collections.abc import Mapping

from common.errors import CapacityError


def check_context_length(
    prompt_tokens: int, max_tokens: int, max_model_len: int, names: Mapping[str, str] | None = None
) -> None:
    """CapacityError naming `prompt` or `max_tokens` (or the API's `names` for them) when the
    sequence cannot fit `max_model_len`."""
    names = names or {}
    if prompt_tokens >= max_model_len:
        raise CapacityError(
            names.get("prompt", "prompt"),
            f"{prompt_tokens} tokens do not fit the context length "
            f"max_model_len={max_model_len} (at least one token must be generated)",
        )
    if prompt_tokens + max_tokens > max_model_len:
        raise CapacityError(
            names.get("max_tokens", "max_tokens"),
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the context length max_model_len={max_model_len}",
        )


def check_kv_capacity(prompt_tokens: int, max_tokens: int, capacity_tokens: int) -> None:
    """CapacityError naming `prompt` or `max_tokens` when the sequence could never fit the router's
    whole KV cache (`capacity_tokens`, from kv_cache_bytes), even running alone. The last token
    generated is never stored, hence the - 1."""
    if prompt_tokens > capacity_tokens:
        raise CapacityError(
            "prompt",
            f"{prompt_tokens} tokens do not fit the KV cache, which holds {capacity_tokens} "
            "tokens (kv_cache_bytes)",
        )
    if prompt_tokens + max_tokens - 1 > capacity_tokens:
        raise CapacityError(
            "max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the KV cache, "
            f"which holds {capacity_tokens} tokens (kv_cache_bytes)",
        )
