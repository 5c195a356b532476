"""The completions API's logprobs: each token's offset is where it starts in the choice's text."""

from __future__ import annotations

from common.tokenizer import Tokenizer
from gateway.choices import completion_logprobs


def test_offsets_point_into_the_text_past_special_tokens_and_split_characters(checkpoint) -> None:
    tokenizer = Tokenizer(checkpoint("mixtral"))
    end = 3  # <|im_end|>: special, so not in the text
    ids = tokenizer.encode("Once é", False) + [end] + tokenizer.encode(" naïve 日本 then", False)
    text = tokenizer.decode(ids)
    lp = completion_logprobs([(-1.0, [])] * len(ids), tokenizer, ids, 7)
    offsets = [o - 7 for o in lp["text_offset"]]
    assert lp["tokens"][ids.index(end)] == "<|im_end|>"
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    whole = [
        (o, t) for o, t in zip(offsets, lp["tokens"]) if "\ufffd" not in t and t != "<|im_end|>"
    ]
    assert len(whole) > 5 and all(text[o : o + len(t)] == t for o, t in whole)
    assert text.endswith("then") and offsets[-1] == len(text) - len(lp["tokens"][-1])
