"""Scheduling over the paged KV cache, driven through the engine: admission by free blocks,
preemption of the newest, chunked prefill, prefix-cache hits, and what a failed step publishes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from common.checkpoint import Checkpoint
from common.errors import CapacityError, InvalidArgumentError
from common.sampling import SamplingParams
from router_service.build import build_local_engine, build_model
from router_service.engine.engine import Engine, FinishReason
from router_service.settings import RouterSettings

BS = 4
GREEDY = SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(6)] for i in range(8)]  # 6 tokens: 2 blocks


def paged(path, blocks: int, **settings) -> Engine:
    """An engine over a cache of exactly `blocks` blocks of BS tokens."""
    s = RouterSettings(checkpoint=path, max_model_len=64, kv_block_size=BS, **settings)
    model = build_model(Checkpoint(path), s)
    return Engine(model, s, model.new_cache(blocks, BS))


def run(
    engine: Engine, prompts, params=GREEDY, each_step=None, finished: list[str] | None = None
) -> dict[str, list[int]]:
    """Every request's tokens; every request must end with LENGTH. `each_step(engine)` runs
    before every step; `finished` receives request ids as they finish."""
    finished = [] if finished is None else finished
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}

    async def drive() -> None:
        while engine.has_unfinished():
            if each_step is not None:
                each_step(engine)
            for o in await engine.step():
                assert o.error is None, o.error
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.finish_reason is FinishReason.LENGTH
                    finished.append(o.request_id)

    asyncio.run(drive())
    return out


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def alone(path) -> dict[str, list[int]]:
    """Each prompt's tokens with room to spare and nothing shared."""
    return run(paged(path, 512, enable_prefix_caching=False), PROMPTS)


def test_more_sequences_than_fit_all_finish_in_admission_order_within_the_budget(
    path, alone
) -> None:
    """24 blocks hold three of these 32-token sequences; eight arrive at once."""
    engine = paged(path, 24, max_num_seqs=8)
    order = [str(i) for i in range(len(PROMPTS))]
    used: list[int] = []
    finished: list[str] = []

    def check(e: Engine) -> None:
        used.append(e.scheduler.pool.num_used)
        assert e.scheduler.pool.num_used <= 24
        # Preemption takes the newest: the running sequences are always the oldest unfinished.
        running = [s.request_id for s in e.running]
        unfinished = [r for r in order if r not in finished]
        assert running == unfinished[: len(running)]

    got = run(engine, PROMPTS, each_step=check, finished=finished)
    assert got == alone  # recomputed sequences continue exactly
    assert finished == order
    assert engine.scheduler.preemptions > 0 and max(used) > 20
    assert engine.scheduler.pool.num_used == 0


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_stepping(path) -> None:
    long_prompt = [(11 * j) % 200 + 5 for j in range(30)]
    whole = run(paged(path, 64, enable_chunked_prefill=False), [PROMPTS[0], long_prompt])
    engine = paged(path, 64, max_prefill_tokens=8)
    engine.add_request("0", PROMPTS[0], GREEDY)
    steps: list[list[str]] = []

    async def drive() -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for step in range(40):
            if step == 2:
                engine.add_request("1", long_prompt, GREEDY)
            outputs = await engine.step()
            steps.append(sorted(o.request_id for o in outputs if o.new_token_ids))
            for o in outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    got = asyncio.run(drive())
    assert got == whole
    # 30 prompt tokens in chunks of 8: four steps, the first three give no token; "0" gets one
    # token every step meanwhile.
    assert steps[2:6] == [["0"], ["0"], ["0"], ["0", "1"]]


def test_a_cached_prefix_is_not_computed_again_and_gives_the_same_tokens(path, alone) -> None:
    engine = paged(path, 64)
    prompt = PROMPTS[0] + [9, 8, 7, 6, 5, 4]  # 12 tokens: 3 blocks
    first = run(engine, [prompt])["0"]
    s = engine.scheduler
    assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (0, 12)
    assert run(engine, [prompt])["0"] == first
    # Two blocks hit; the third holds the last prompt token, which is always computed.
    assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (8, 24)
    # A prompt that shares the first block only, and one that continues a generated sequence.
    shared = run(engine, [PROMPTS[0][:4] + [1, 2, 3]])
    assert s.prefix_hit_tokens == 12
    run(engine, [prompt + first[:10]])
    assert s.prefix_hit_tokens == 12 + 20  # blocks written by decode steps are cached too
    assert shared and len(shared["0"]) == GREEDY.max_tokens
    off = paged(path, 64, enable_prefix_caching=False)
    assert run(off, [prompt])["0"] == first and run(off, [prompt])["0"] == first
    assert off.scheduler.prefix_hit_tokens == 0


def test_a_failed_step_publishes_nothing(path) -> None:
    engine = paged(path, 64)
    real = engine.model.forward
    calls = 0

    async def broken(*args, **kwargs):
        nonlocal calls
        calls += 1
        logits = await real(*args, **kwargs)  # the keys and values are written...
        if calls == 1:
            raise RuntimeError("simulated failure after the writes")  # ...but the step fails
        return logits

    engine.model.forward = broken
    prompt = PROMPTS[1] + PROMPTS[2]  # 12 tokens: 2 full blocks before the last token's
    engine.add_request("a", prompt, GREEDY)
    out = asyncio.run(engine.step())
    assert out[0].finish_reason is FinishReason.ERROR
    pool = engine.scheduler.pool
    assert pool.num_cached == 0 and pool.num_used == 0
    run(engine, [prompt])
    assert engine.scheduler.prefix_hit_tokens == 0  # nothing was found from the failed step
    assert pool.num_cached >= 2  # the successful run published its blocks


def test_micro_batches_with_shared_prefixes_and_preemption_give_the_same_tokens(
    path, alone
) -> None:
    prompts = PROMPTS + [PROMPTS[0] + [1], PROMPTS[1] + [2]]  # share a block with 0 and 1
    want = run(paged(path, 512, enable_prefix_caching=False), prompts)
    engine = paged(path, 30, max_num_seqs=8, micro_batches="2", max_prefill_tokens=7)
    assert run(engine, prompts) == want
    assert engine.scheduler.preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0
    assert engine.planner.steps_by_m[2] > 0


def test_a_request_that_can_never_fit_the_cache_is_refused_naming_the_field(path) -> None:
    engine = paged(path, 4)  # 16 tokens
    with pytest.raises(CapacityError, match="max_tokens: .* holds 16 tokens .*kv_cache_bytes"):
        engine.add_request("r", [5] * 10, replace(GREEDY, max_tokens=8))
    with pytest.raises(CapacityError, match="prompt: 17 tokens do not fit the KV cache"):
        engine.add_request("r", [5] * 17, replace(GREEDY, max_tokens=1))
    engine.add_request("r", [5] * 10, replace(GREEDY, max_tokens=7))  # 16 tokens stored: fits
    assert engine.num_waiting == 1


def test_a_budget_smaller_than_one_sequence_is_a_start_up_error(path) -> None:
    with pytest.raises(InvalidArgumentError, match="max_model_len=64") as info:
        build_local_engine(RouterSettings(checkpoint=path, max_model_len=64, kv_cache_bytes="1KB"))
    assert info.value.field == "kv_cache_bytes"
