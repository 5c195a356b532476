"""Incremental detokenization never splits a character; stop strings end text before they appear."""

from __future__ import annotations

import pytest

from common.tokenizer import TextStream, Tokenizer

TEXT = "héllo wörld — 你好 👋 done. The end is near; stop here please."


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer(checkpoint("mixtral"))


def test_token_by_token_stream_reassembles_text_without_broken_characters(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode(TEXT)
    stream = TextStream(tokenizer)
    deltas = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(deltas) == TEXT == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert (
        len(ids) > len(TEXT.encode()) // 4
    )  # multi-byte characters really span several tokens here


@pytest.mark.parametrize("stop", ["stop", "end is", "👋"])
def test_stop_string_truncates_and_is_never_emitted(tokenizer: Tokenizer, stop: str) -> None:
    stream = TextStream(tokenizer, stop=[stop, "never-occurs"])
    deltas = []
    for t in tokenizer.encode(TEXT):
        deltas.append(stream.push([t]))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    assert stream.stopped
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    assert all(stop not in d for d in deltas)


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["wörlds"])
    out = "".join(stream.push([t]) for t in tokenizer.encode(TEXT)) + stream.finish()
    assert out == TEXT and not stream.stopped


def test_take_pushes_a_burst_token_by_token_and_ends_it_at_a_stop_string(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode(TEXT)
    stream = TextStream(tokenizer, stop=["end is"])
    text, taken = stream.take(ids)
    # The stop string is complete at the token `taken` names, not before and not after.
    assert stream.stopped and text == TEXT[: TEXT.index("end is")]
    assert "end is" in tokenizer.decode(ids[:taken]) and "end is" not in tokenizer.decode(
        ids[: taken - 1]
    )
    whole = TextStream(tokenizer)
    text, taken = whole.take(ids)
    assert taken == len(ids) and text + whole.finish() == TEXT
