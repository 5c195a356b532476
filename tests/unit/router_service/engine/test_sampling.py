"""Sampling against a reference: the filtered distribution equals transformers' logits warpers on the
same logits, and seeded draws follow it (a chi-square goodness-of-fit test). Penalties, min_tokens and
logprobs against formulas written out here, transformers' RepetitionPenaltyLogitsProcessor, and the
engine end to end."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common import bf16
from common.errors import InvalidArgumentError
from common.sampling import SamplingParams
from router_service.build import build_local_engine
from router_service.engine.engine import Engine, FinishReason
from router_service.engine.sampling import (
    filtered_logits,
    greedy,
    penalized_logits,
    position_seed,
    sample,
    token_logprobs,
)
from router_service.settings import RouterSettings


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' filtered logits [vocab]: its warpers in the order generate() builds them
    (transformers/generation/utils.py, _get_logits_processor: temperature, top-k, top-p, min-p)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits.float()[None])[0]


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor, what: object) -> None:
    """The same surviving tokens and renormalised probabilities within 1e-7 (measured: bit-equal;
    both run the same float32 operations, this only leaves room for a kernel change)."""
    kept, ref_kept = torch.isfinite(ours), torch.isfinite(ref)
    assert torch.equal(kept, ref_kept), (what, kept.nonzero().tolist(), ref_kept.nonzero().tolist())
    diff = (ours.softmax(-1).double() - ref.softmax(-1).double()).abs().max().item()
    assert diff <= 1e-7, (what, diff)


def random_logits(rng: random.Random, gen: torch.Generator) -> tuple[str, torch.Tensor]:
    """Logits of one of several shapes: smooth, many exact ties, one dominant token, all equal,
    masked (-inf) tokens; at vocabulary sizes from 2 to 512 and scales from flat to peaked."""
    vocab = rng.choice([2, 5, 17, 64, 512])
    kind = rng.choice(["normal", "ties", "peaked", "flat", "masked"])
    scale = rng.choice([0.05, 1.0, 4.0, 15.0])
    if kind == "ties":  # 6 distinct values: ties at the top-k cut and across the top-p boundary
        return kind, torch.randint(-3, 3, (vocab,), generator=gen).float() * scale
    if kind == "flat":
        return kind, torch.zeros(vocab)
    x = torch.randn(vocab, generator=gen) * scale
    if kind == "peaked":
        x[rng.randrange(vocab)] += 30.0
    if kind == "masked":
        x[torch.rand(vocab, generator=gen) < 0.3] = float("-inf")
        x[rng.randrange(vocab)] = 0.0  # at least one finite logit
    return kind, x


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5, 3.0]),
        # top_k = 1 is greedy here (argmax, one token) where transformers keeps every tied top token.
        top_k=rng.choice([0, 0, 2, 3, 5, 40, 1000]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.75, 0.5, 0.1, 1e-3]),
        min_p=rng.choice([0.0, 0.0, 0.01, 0.1, 0.5, 1.0]),
    )


@pytest.mark.parametrize("seed", range(4))
def test_filtered_distribution_equals_transformers_warpers_on_random_logits(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(500):
        kind, logits = random_logits(rng, gen)
        params = random_params(rng)
        what = (seed, case, kind, logits.numel(), params)
        assert_same_distribution(filtered_logits(logits, params), reference(logits, params), what)


@pytest.mark.parametrize(
    ("logits", "params", "survivors"),
    [
        # top-k keeps every token tied with the k-th.
        ([3.0, 1.0, 1.0, 1.0, 0.0], SamplingParams(top_k=2), [0, 1, 2, 3]),
        ([3.0, 2.0, 1.0], SamplingParams(top_k=5), [0, 1, 2]),  # k beyond the vocabulary
        # top-p: a token stays while the tokens above it hold less than top_p.
        ([math.log(0.5), math.log(0.3), math.log(0.2)], SamplingParams(top_p=0.6), [0, 1]),
        ([math.log(0.5), math.log(0.3), math.log(0.2)], SamplingParams(top_p=0.4), [0]),
        # min-p is relative to the most likely token, after temperature.
        ([math.log(0.5), math.log(0.3), math.log(0.2)], SamplingParams(min_p=0.5), [0, 1]),
        (
            [math.log(0.5), math.log(0.3), math.log(0.2)],
            SamplingParams(temperature=0.25, min_p=0.5),
            [0],
        ),
        ([2.0, 2.0, 1.0], SamplingParams(min_p=1.0), [0, 1]),  # ties with the top stay
        ([2.0, 1.0, 0.0], SamplingParams(min_p=0.0), [0, 1, 2]),  # 0 is off
        # The order decides: transformers (and we) cut top-p on the model's distribution, then
        # min-p: 0.5 and 0.3 both stay. vLLM's min-p first renormalises {0.5, 0.3} to
        # {0.625, 0.375}, and its top-p 0.6 then keeps only the first.
        (
            [math.log(0.5), math.log(0.3), math.log(0.1), math.log(0.1)],
            SamplingParams(top_p=0.6, min_p=0.3),
            [0, 1],
        ),
    ],
)
def test_each_filter_and_their_order(logits, params, survivors) -> None:
    x = torch.tensor(logits)
    ours = filtered_logits(x, params)
    assert torch.isfinite(ours).nonzero().flatten().tolist() == survivors
    assert_same_distribution(ours, reference(x, params), params)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1)]
)
def test_greedy_params_leave_only_the_argmax(params: SamplingParams) -> None:
    x = torch.tensor([0.5, 2.0, 2.0, float("nan"), -1.0])
    assert torch.isfinite(filtered_logits(x, params)).nonzero().flatten().tolist() == [1]


# -- seeded draws against the reference distribution ---------------------------------------------

DRAWS = 10_000
# A correct sampler fails with probability ALPHA per case. The seeds are fixed, so that is the
# chance, taken once, that the seeds chosen here are unlucky. Power at 10,000 draws: at 20 degrees
# of freedom the statistic's critical value is 65 and its mean for a correct sampler 20; a token of
# probability 0.1 drawn with probability 0.1 + δ adds about N·δ²/0.1, which passes 45 at δ = 0.021.
# Any draw of a filtered token fails outright.
ALPHA = 1e-6


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; tokens expected < 5 times are pooled in one bin
    (the chi-square approximation needs about 5 per bin), which joins the smallest bin if still < 5."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0 or rest_obs > 0:
        i = min(range(len(exp)), key=exp.__getitem__)
        obs[i] += rest_obs
        exp[i] += rest_exp
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), len(obs) - 1


def p_value(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper incomplete gamma function."""
    half = torch.tensor([df / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def draw(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    """Counts per token of DRAWS tokens drawn as the engine draws them: token i from a generator
    seeded with position_seed(seed, i)."""
    gen = torch.Generator()
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    for position in range(DRAWS):
        gen.manual_seed(position_seed(seed, position))
        counts[sample(logits, params, gen)] += 1
    return counts


def _logits(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    if kind == "smooth":
        return torch.randn(512, generator=gen) * 2.0
    if kind == "ties":
        return torch.randint(-3, 3, (64,), generator=gen).float()
    if kind == "flat":
        return torch.randn(64, generator=gen) * 0.3
    # Peaked: one token holds 86% at temperature 1.2; min-p 0.002 keeps 20 rare ones (and cuts 7.5%).
    x = torch.randn(128, generator=gen)
    x[5] += 10.0
    return x


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("smooth", SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1)),
        ("ties", SamplingParams(temperature=1.3, top_k=6, seed=2)),
        ("flat", SamplingParams(temperature=1.0, top_p=0.5, seed=3)),
        ("peaked", SamplingParams(temperature=1.2, min_p=0.002, seed=4)),
    ],
)
def test_seeded_draws_follow_the_reference_distribution(kind: str, params: SamplingParams) -> None:
    logits = _logits(kind)
    ref = reference(logits, params)
    probs = ref.double().softmax(-1)
    counts = draw(logits, params, params.seed)
    assert counts[~torch.isfinite(ref)].sum() == 0, "drew a token the reference filters out"
    statistic, df = chi_square(counts, probs)
    assert df >= 3 and p_value(statistic, df) > ALPHA, (statistic, df)
    # The test has teeth: the same draws are far from the unfiltered (temperature-only) distribution.
    unfiltered = (logits.double() / params.temperature).softmax(-1)
    assert p_value(*chi_square(counts, unfiltered)) < ALPHA


# -- penalties, min_tokens, logprobs --------------------------------------------------------------

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
        (replace(GREEDY, logprobs=21), "logprobs"),
    ],
)
def test_bad_values_name_the_field(engine, params, field) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        engine.add_request("bad", PROMPT, params)
    assert e.value.field == field
    assert run(engine, GREEDY)[2] is FinishReason.LENGTH


@pytest.mark.parametrize("special", ["none", "nan", "inf", "ties", "all nan", "-inf"])
def test_the_c_argmax_of_bursts_picks_greedys_token(special: str) -> None:
    run = bf16.kernel("moe_argmax_bf16")
    if run is None:
        pytest.skip("no C compiler: the kernels are not built")
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        v = torch.randn(1000, generator=g).to(torch.bfloat16)
        where = torch.randint(0, 1000, (5,), generator=g)
        if special == "nan":
            v[where] = float("nan")
        elif special == "inf":
            v[where[:2]] = float("inf")  # two: the first wins
        elif special == "ties":
            v[where] = v.max()
        elif special == "all nan":
            v[:] = float("nan")
        elif special == "-inf":
            v[:] = float("-inf")
            v[where[0]] = float("nan")
        assert run(v.data_ptr(), v.numel()) == greedy(v.float())
