"""Answering in OpenAI's shapes: usage counts every prompt once and every choice's tokens, and the
SSE framing a client parses. (Whole responses and streams end to end: test_http_api.py.)"""

from __future__ import annotations

import json

from gateway.openai_answer import sse, token_ids, usage
from gateway.stream import Delta


def final(prompt_tokens: int, completion_tokens: int) -> Delta:
    return Delta("r", [], "", "length", prompt_tokens, completion_tokens)


def test_usage_counts_each_prompt_once_and_every_choices_tokens() -> None:
    # Two prompts (3 and 5 tokens), n=2: choices 0, 1 continue the first, 2, 3 the second.
    finals = {0: final(3, 4), 1: final(3, 2), 2: final(5, 4), 3: final(5, 1)}
    assert usage(finals, 2) == {"prompt_tokens": 8, "completion_tokens": 11, "total_tokens": 19}
    assert usage({0: final(3, 4)}, 1)["prompt_tokens"] == 3
    # Streamed choices arrive in any order; the first of each prompt is found by its index.
    shuffled = {3: final(5, 1), 0: final(3, 4), 2: final(5, 4), 1: final(3, 2)}
    assert usage(shuffled, 2) == usage(finals, 2)


def test_events_are_compact_utf8_json_and_token_ids_only_when_asked() -> None:
    event = sse({"text": "naïve"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"text": "naïve"} and "ï".encode() in event
    assert token_ids(True, [1]) == {"token_ids": [1]} and token_ids(False, [1]) == {}


def test_events_stay_one_line_for_clients_that_split_like_str_splitlines() -> None:
    # httpx's aiter_lines and requests' iter_lines also end lines at these; a token can decode to one.
    text = "a\x85b\u2028c\u2029d\ne\x1cf"
    event = sse({"text": text})
    assert event[:-2].decode().splitlines() == [event[:-2].decode()]
    assert json.loads(event[6:]) == {"text": text}
