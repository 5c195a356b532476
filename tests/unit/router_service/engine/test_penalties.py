"""Penalties, min_tokens and logprobs: the sampler against formulas written out here and against
transformers' RepetitionPenaltyLogitsProcessor, then the engine end to end."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from moe_mesh.common.errors import InvalidArgumentError
from moe_mesh.router_service.build import build_local_engine
from moe_mesh.router_service.engine.engine import Engine, FinishReason
from moe_mesh.router_service.engine.sampling import (
    SamplingParams,
    penalized_logits,
    token_logprobs,
)
from moe_mesh.router_service.settings import RouterSettings

PROMPT = [11, 3, 250, 9, 31]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def openai_reference(logits: list[float], output: list[int], presence: float, frequency: float):
    """OpenAI's documented formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    return [
        mu - output.count(j) * frequency - (1.0 if output.count(j) else 0.0) * presence
        for j, mu in enumerate(logits)
    ]


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3), (-2.0, 2.0)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency) -> None:
    torch.manual_seed(0)
    logits = torch.randn(50)
    output = [3, 3, 7, 49, 3, 0]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = penalized_logits(logits, params, prompt=[5, 6], output=output)
    ref = openai_reference(logits.tolist(), output, presence, frequency)
    assert torch.allclose(ours, torch.tensor(ref), atol=1e-6)
    assert ours[5] == logits[5]  # prompt tokens do not count for these two


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64) * 3
    prompt, output = [1, 2, 2, 40], [7, 1, 63]
    ours = penalized_logits(logits, SamplingParams(repetition_penalty=penalty), prompt, output)
    ids = torch.tensor([prompt + output])
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[None].clone())[0]
    assert torch.equal(ours, ref)


def test_token_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    t = token_logprobs(logits, 2, 3)
    lp = torch.log_softmax(logits, -1)
    assert t.logprob == pytest.approx(float(lp[2]))
    assert [i for i, _ in t.top] == [3, 0, 2]
    assert [v for _, v in t.top] == pytest.approx([float(lp[3]), float(lp[0]), float(lp[2])])
    assert token_logprobs(logits, 1, 0).top == ()


@pytest.fixture
def engine(checkpoint) -> Engine:
    return build_local_engine(
        RouterSettings(checkpoint=checkpoint("qwen3_moe"), max_num_seqs=4, max_model_len=64)
    )


def run(engine: Engine, params: SamplingParams, prompt=PROMPT) -> tuple[list[int], list, object]:
    engine.add_request("r", list(prompt), params)
    ids, logprobs, reason = [], [], None

    async def drive() -> None:
        nonlocal reason
        while engine.has_unfinished():
            for o in await engine.step():
                assert o.error is None
                ids.extend(o.new_token_ids)
                logprobs.extend(o.logprobs or [])
                reason = o.finish_reason or reason

    asyncio.run(drive())
    return ids, logprobs, reason


def test_penalties_change_greedy_output_and_defaults_change_nothing(engine) -> None:
    plain, _, _ = run(engine, GREEDY)
    assert run(engine, replace(GREEDY, repetition_penalty=1.0, presence_penalty=0.0))[0] == plain
    # A strong presence penalty forbids repeats as long as unseen tokens are more likely.
    no_repeats, _, _ = run(engine, replace(GREEDY, presence_penalty=2.0, frequency_penalty=2.0))
    assert no_repeats != plain
    assert len(set(plain)) < len(plain), "the random model should repeat itself unpenalized"
    assert len(set(no_repeats)) > len(set(plain))


def test_min_tokens_holds_eos_and_stop_tokens_back(engine) -> None:
    plain, _, _ = run(engine, GREEDY)
    first = plain[0]
    stopped, _, reason = run(engine, replace(GREEDY, stop_token_ids=(first,)))
    assert (stopped, reason) == ([first], FinishReason.STOP)
    held, _, _ = run(engine, replace(GREEDY, stop_token_ids=(first,), min_tokens=4))
    assert len(held) >= 4 and first not in held[:4]
    engine.eos_ids = frozenset({first})
    held, _, _ = run(engine, replace(GREEDY, ignore_eos=False, min_tokens=3))
    assert len(held) >= 3 and first not in held[:3]


def test_logprobs_come_with_every_token_only_when_asked(engine) -> None:
    ids, none, _ = run(engine, GREEDY)
    assert none == []
    again, logprobs, _ = run(engine, replace(GREEDY, logprobs=5))
    assert again == ids and len(logprobs) == len(ids)
    for token, lp in zip(ids, logprobs):
        # greedy: the chosen token is the most likely one
        assert len(lp.top) == 5 and lp.top[0][0] == token and lp.top[0][1] == lp.logprob <= 0


@pytest.mark.parametrize(
    "params, field",
    [
        (replace(GREEDY, presence_penalty=2.5), "presence_penalty"),
        (replace(GREEDY, frequency_penalty=-3.0), "frequency_penalty"),
        (replace(GREEDY, repetition_penalty=0.0), "repetition_penalty"),
        (replace(GREEDY, repetition_penalty=float("nan")), "repetition_penalty"),
        (replace(GREEDY, min_tokens=13), "min_tokens"),
        (replace(GREEDY, logprobs=21), "top_logprobs"),
    ],
)
def test_bad_values_name_the_field(engine, params, field) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        engine.add_request("bad", PROMPT, params)
    assert e.value.field == field
    assert run(engine, GREEDY)[2] is FinishReason.LENGTH
