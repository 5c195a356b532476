"""n choices of one response (seeds, ids, admitted together, merged, the first failure answers)
and the completions API's logprobs: each token's offset is where it starts in the choice's text."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from common.errors import InvalidArgumentError, UnavailableError
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from gateway.choices import (
    Choices,
    complete_all,
    completion_logprobs,
    requests_for,
    with_sampled,
)
from gateway.core import TextRequest
from tests.support.fakes import FakeRouter, ScriptedRouter, core


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


def request(max_tokens: int, **kwargs) -> TextRequest:
    return TextRequest(
        prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=max_tokens), **kwargs
    )


def test_choice_i_draws_from_seed_plus_i_under_its_own_request_id() -> None:
    base = TextRequest(prompt_token_ids=[1], params=SamplingParams(seed=2**64 - 1), request_id="r")
    assert [(r.params.seed, r.request_id) for r in requests_for([base], 3)] == [
        (2**64 - 1, "r"),
        (0, "r-1"),
        (1, "r-2"),
    ]
    assert requests_for([base], 1) == [base]


def test_choice_p_n_plus_i_is_prompt_ps_ith_drawing_as_it_would_alone() -> None:
    """OpenAI's order for a list of prompts; each prompt's seeds are those it gets alone."""
    a = TextRequest(prompt_token_ids=[1], params=SamplingParams(seed=5), request_id="r")
    b = replace(a, prompt_token_ids=[2])
    got = [(r.prompt_token_ids, r.params.seed, r.request_id) for r in requests_for([a, b], 2)]
    assert got == [([1], 5, "r"), ([1], 6, "r-1"), ([2], 5, "r-2"), ([2], 6, "r-3")]
    unnamed = [r.request_id for r in requests_for([replace(a, request_id=""), b], 1)]
    assert unnamed == ["", "r-1"]


def test_the_legacy_top_logprobs_hold_the_sampled_token_as_openais_do(checkpoint) -> None:
    """Up to logprobs + 1 entries: the sampled token is added when it is not among the top."""
    tokenizer = Tokenizer(checkpoint("mixtral"))
    top = ((7, -0.1), (8, -2.0))
    lp = completion_logprobs([(-3.0, top), (-0.1, top)], tokenizer, [9, 7], 0)
    assert [list(t.values()) for t in lp["top_logprobs"]] == [[-0.1, -2.0, -3.0], [-0.1, -2.0]]
    assert list(lp["top_logprobs"][0])[-1] == tokenizer.token_text(9)
    assert with_sampled(9, -3.0, ()) == [(9, -3.0)]


async def test_open_waits_for_the_first_delta_then_merges_every_choice(checkpoint) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1")])
    choices = await Choices.open(gw, [request(2), request(3)])
    try:
        got = [(i, d.completion_tokens) async for i, d in choices.deltas()]
    finally:
        await choices.aclose()
    assert sorted(got) == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    assert gw.admission.in_flight == 0


async def test_a_failure_before_the_first_delta_raises_from_open_and_frees_every_place(
    checkpoint,
) -> None:
    gw = core(checkpoint("mixtral"), [ScriptedRouter("a:1", refuses=True)], router_attempts=1)
    with pytest.raises(UnavailableError, match="no router replica could serve it"):
        await Choices.open(gw, [request(2), request(2)])
    assert gw.admission.in_flight == 0


async def test_complete_all_answers_with_the_first_failure_and_cancels_the_rest(checkpoint) -> None:
    gate = asyncio.Event()  # never opens: the healthy choice would wait forever
    gw = core(checkpoint("mixtral"), [FakeRouter("a:1", gate)])
    bad = request(10**6)
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        await asyncio.wait_for(complete_all(gw, [request(2), bad]), 5)
    assert gw.admission.in_flight == 0
    gate.set()
    [done] = await complete_all(gw, [request(2)])
    assert done.token_ids == [5, 6] and done.finish_reason == "length"
