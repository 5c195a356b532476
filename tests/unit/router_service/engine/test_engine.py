"""Engine behaviour: sampling, stopping, cancellation, priorities, limits and request validation."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch

from common.errors import (
    AlreadyExistsError,
    CapacityError,
    InternalError,
    InvalidArgumentError,
)
from common.sampling import SamplingParams
from router_service.build import build_local_engine
from router_service.engine import engine as engine_module
from router_service.engine import model as model_module
from router_service.engine.engine import Engine, FinishReason
from router_service.engine.sampling import sample
from router_service.settings import RouterSettings

PROMPT = [11, 3, 250, 9, 31]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(checkpoint) -> Engine:
    return build_local_engine(
        RouterSettings(checkpoint=checkpoint("qwen3_moe"), max_num_seqs=4, max_model_len=64)
    )


def collect(engine: Engine) -> dict[str, tuple[list[int], FinishReason | None]]:
    out: dict[str, tuple[list[int], FinishReason | None]] = {}

    async def drive() -> None:
        while engine.has_unfinished():
            for o in await engine.step():
                ids, _ = out.get(o.request_id, ([], None))
                out[o.request_id] = (ids + o.new_token_ids, o.finish_reason)

    asyncio.run(drive())
    return out


def generate(
    engine: Engine, params: SamplingParams, prompt: list[int] = PROMPT
) -> tuple[list[int], FinishReason]:
    engine.add_request("r", prompt, params)
    return collect(engine)["r"]


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: Engine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=1234, ignore_eos=True)
    first, _ = generate(engine, params)
    again, _ = generate(engine, params)
    other, _ = generate(engine, replace(params, seed=99))
    assert first == again
    assert first != other


def test_top_k_1_tiny_top_p_and_min_p_1_equal_greedy(engine: Engine) -> None:
    greedy, reason = generate(engine, GREEDY)
    assert reason is FinishReason.LENGTH and len(greedy) == GREEDY.max_tokens
    assert generate(engine, replace(GREEDY, temperature=2.0, top_k=1, seed=5))[0] == greedy
    assert generate(engine, replace(GREEDY, temperature=2.0, top_p=1e-6, seed=5))[0] == greedy
    # min_p = 1 keeps only tokens as likely as the top one: greedy unless two logits tie exactly.
    assert generate(engine, replace(GREEDY, temperature=2.0, min_p=1.0, seed=5))[0] == greedy


def test_stop_token_ids_and_eos_end_generation_with_stop(engine: Engine) -> None:
    greedy, _ = generate(engine, GREEDY)
    target = greedy[5]
    ids, reason = generate(engine, replace(GREEDY, stop_token_ids=(target,)))
    assert reason is FinishReason.STOP and ids == greedy[: greedy.index(target) + 1]
    engine.eos_ids = frozenset({target})
    assert generate(engine, replace(GREEDY, ignore_eos=False)) == (
        greedy[: greedy.index(target) + 1],
        FinishReason.STOP,
    )
    assert generate(engine, GREEDY) == (greedy, FinishReason.LENGTH)  # ignore_eos keeps going


def test_abort_frees_the_blocks_and_other_sequences_are_unaffected(engine: Engine) -> None:
    alone = {p: generate(engine, GREEDY, [p, p + 1, p + 2])[0] for p in (20, 30, 40)}
    for p in (20, 30, 40):
        engine.add_request(str(p), [p, p + 1, p + 2], GREEDY)
    seen: dict[str, list[int]] = {"20": [], "30": [], "40": []}
    cancelled = []

    async def drive() -> None:
        for step in range(GREEDY.max_tokens + 2):
            if step == 3:
                assert engine.abort("20")  # the first admitted: the others keep their blocks
                assert len(engine.running) == 2
            for o in await engine.step():
                seen[o.request_id] += o.new_token_ids
                if o.finish_reason is FinishReason.CANCELLED:
                    cancelled.append(o.request_id)

    asyncio.run(drive())
    assert cancelled == ["20"] and not engine.has_unfinished() and engine.running == []
    assert engine.scheduler.pool.num_used == 0
    assert seen["20"] == alone[20][:3]
    assert seen["30"] == alone[30] and seen["40"] == alone[40]
    assert not engine.abort("20")


def test_waiting_requests_are_admitted_by_priority_up_to_max_num_seqs(checkpoint) -> None:
    engine = build_local_engine(RouterSettings(checkpoint=checkpoint("qwen3_moe"), max_num_seqs=2))
    params = replace(GREEDY, max_tokens=3)
    for rid, prio in [("low", -1), ("normal", 0), ("high", 5), ("urgent", 9)]:
        engine.add_request(rid, PROMPT, params, priority=prio)
    order: list[str] = []

    async def drive() -> None:
        while engine.has_unfinished():
            assert len(engine.running) <= 2
            for o in await engine.step():
                if o.request_id not in order:
                    order.append(o.request_id)

    asyncio.run(drive())
    assert order == ["urgent", "high", "normal", "low"]


@pytest.mark.parametrize(
    ("prompt", "params", "error", "field"),
    [
        ([], GREEDY, InvalidArgumentError, "prompt_token_ids"),
        ([1, 10**6], GREEDY, InvalidArgumentError, "prompt_token_ids"),
        (PROMPT, replace(GREEDY, stop_token_ids=(-3,)), InvalidArgumentError, "stop_token_ids"),
        (PROMPT, replace(GREEDY, max_tokens=0), InvalidArgumentError, "max_tokens"),
        (PROMPT, replace(GREEDY, max_tokens=60), CapacityError, "max_tokens"),
        (PROMPT, replace(GREEDY, temperature=-0.5), InvalidArgumentError, "temperature"),
        (PROMPT, replace(GREEDY, temperature=math.nan), InvalidArgumentError, "temperature"),
        (PROMPT, replace(GREEDY, temperature=math.inf), InvalidArgumentError, "temperature"),
        (PROMPT, replace(GREEDY, top_p=0.0), InvalidArgumentError, "top_p"),
        (PROMPT, replace(GREEDY, top_p=1.5), InvalidArgumentError, "top_p"),
        (PROMPT, replace(GREEDY, top_k=-1), InvalidArgumentError, "top_k"),
        (PROMPT, replace(GREEDY, min_p=-0.1), InvalidArgumentError, "min_p"),
        (PROMPT, replace(GREEDY, min_p=1.5), InvalidArgumentError, "min_p"),
        (PROMPT, replace(GREEDY, min_p=math.nan), InvalidArgumentError, "min_p"),
    ],
)
def test_invalid_requests_name_the_field_and_leave_the_engine_usable(
    engine, prompt, params, error, field
) -> None:
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field and str(info.value).startswith(field)
    assert not engine.has_unfinished()
    assert generate(engine, GREEDY)[1] is FinishReason.LENGTH


def test_duplicate_request_id_is_rejected(engine: Engine) -> None:
    engine.add_request("same", PROMPT, GREEDY)
    with pytest.raises(AlreadyExistsError, match="request_id"):
        engine.add_request("same", PROMPT, GREEDY)
    assert collect(engine)["same"][1] is FinishReason.LENGTH


def test_a_failing_forward_pass_fails_that_steps_requests_and_the_engine_keeps_serving(
    engine: Engine,
) -> None:
    real = engine.model.forward
    calls = 0

    async def broken(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("simulated kernel failure")
        return await real(*args, **kwargs)

    engine.model.forward = broken
    engine.add_request("a", PROMPT, GREEDY)
    out = collect(engine)
    assert out["a"][1] is FinishReason.ERROR
    assert not engine.running and not engine.has_unfinished()
    engine.model.forward = real
    assert generate(engine, GREEDY)[1] is FinishReason.LENGTH


def test_resuming_from_prompt_plus_generated_tokens_continues_seeded_sampling_exactly(
    engine: Engine, checkpoint
) -> None:
    """What gateway failover relies on: randomness depends on (seed, position), not on the process."""
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=2024, ignore_eos=True)
    tokens, reason = generate(engine, params)
    assert reason is FinishReason.LENGTH and len(tokens) == 16
    assert tokens != generate(engine, GREEDY)[0][:16]  # really sampled, so the check below can fail
    for k in (1, 6, 15):
        resumed = generate(engine, replace(params, max_tokens=16 - k), PROMPT + tokens[:k])
        assert resumed == (tokens[k:], FinishReason.LENGTH), k
    other_router = build_local_engine(
        RouterSettings(checkpoint=checkpoint("qwen3_moe"), max_model_len=64)
    )
    resumed = generate(other_router, replace(params, max_tokens=9), PROMPT + tokens[:7])
    assert resumed == (tokens[7:], FinishReason.LENGTH)
    unseeded = replace(params, seed=None)
    assert generate(engine, unseeded)[0] != generate(engine, unseeded)[0]  # no seed: still random


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-6, 2e-5])
def test_tiny_temperatures_sample_greedily_without_error(
    engine: Engine, temperature: float
) -> None:
    greedy, _ = generate(engine, GREEDY)
    assert generate(engine, replace(GREEDY, temperature=temperature, seed=3)) == (
        greedy,
        FinishReason.LENGTH,
    )


@pytest.mark.parametrize(
    "logits",
    [
        torch.tensor([0.0, math.nan, 1.0]),
        torch.tensor([0.0, math.inf, 1.0]),
        torch.tensor([-math.inf, -math.inf, -math.inf]),
        torch.tensor([1e38, 3e38, -3e38]),
    ],
)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-5),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=3.0, top_k=2),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.3, top_k=2, top_p=0.8, min_p=1.0),
    ],
)
def test_degenerate_distributions_fall_back_to_argmax(
    logits: torch.Tensor, params: SamplingParams
) -> None:
    token = sample(logits, params, torch.Generator().manual_seed(0))
    assert token == int(torch.argmax(torch.nan_to_num(logits, nan=-math.inf)))


def test_a_failure_while_sampling_fails_only_that_request(engine: Engine, monkeypatch) -> None:
    alone = generate(engine, GREEDY, [20, 21, 22])
    real = engine_module.sample

    def poisoned(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("invalid multinomial distribution")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", poisoned)
    engine.add_request("poison", PROMPT, replace(GREEDY, temperature=1.0, seed=666))
    engine.add_request("fine", [20, 21, 22], GREEDY)
    outputs: list = []

    async def drive() -> None:
        for _ in range(GREEDY.max_tokens + 2):  # bounded: step() must never raise
            outputs.extend(await engine.step())

    asyncio.run(drive())
    [poison] = [o for o in outputs if o.request_id == "poison"]
    assert poison.finish_reason is FinishReason.ERROR and isinstance(poison.error, InternalError)
    assert "sampling failed" in str(poison.error) and "invalid multinomial" in str(poison.error)
    fine = [o for o in outputs if o.request_id == "fine"]
    assert ([t for o in fine for t in o.new_token_ids], fine[-1].finish_reason) == alone
    assert not engine.has_unfinished() and engine.running == []
    assert generate(engine, GREEDY, [20, 21, 22]) == alone


def test_a_failure_while_preparing_a_step_fails_the_steps_requests_only(
    engine: Engine,
) -> None:
    alone = generate(engine, GREEDY)
    real, calls = engine.scheduler.schedule, 0

    def broken():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated bug")
        return real()

    engine.scheduler.schedule = broken
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", [20, 21, 22], GREEDY)
    out = collect(engine)
    assert out["a"] == (alone[0][:2], FinishReason.ERROR) and out["b"][1] is FinishReason.ERROR
    assert not engine.has_unfinished() and engine.running == []
    assert engine.scheduler.pool.num_used == 0  # their blocks went back
    assert generate(engine, GREEDY) == alone


@pytest.mark.parametrize("serial", [16, 0])
def test_an_unset_serial_max_tokens_follows_what_the_host_measured(checkpoint, monkeypatch, serial):
    monkeypatch.setattr(model_module, "serial_tokens", lambda dtype: serial)
    path = checkpoint("qwen3_moe")
    for asked, expected in ((None, serial), (7, 7)):
        settings = RouterSettings(checkpoint=path, max_model_len=64, serial_max_tokens=asked)
        engine = build_local_engine(settings)
        try:
            assert engine.model.serial_max_tokens == expected
        finally:
            engine.close()
