"""Decode bursts (engine/burst.py): a lone sequence's steps back to back give the tokens and
routing counts of single steps (greedy and sampled), end at an ending token, at max_tokens, at a
waiting request and at a cancellation, and never run where sampling or another sequence needs
single steps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.errors import DeadlineExceededError
from common.sampling import SamplingParams
from router_service import build
from router_service.build import build_local_engine
from router_service.engine.engine import Engine, FinishReason
from router_service.settings import RouterSettings
from tests.support.backends import Recording
from tests.support.engine_runs import PROMPT, run


def greedy(n: int, **params) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **params)


def engine(checkpoint, burst: int, arch: str = "mixtral", window_ms: float = 0) -> Engine:
    return build_local_engine(
        RouterSettings(
            checkpoint=checkpoint(arch),
            dtype="bfloat16",
            max_model_len=64,
            kv_block_size=4,
            decode_burst=burst,
            decode_burst_ms=window_ms,  # 0: bursts of `burst` steps, however fast
        )
    )


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_burst_gives_the_tokens_and_routing_counts_of_single_steps(panels, checkpoint, arch):
    single, bursts = engine(checkpoint, 1, arch), engine(checkpoint, 8, arch)
    want, one_each = run(single, {"r": greedy(21)})
    got, steps = run(bursts, {"r": greedy(21)})
    assert got == want and len(want["r"][0]) == 21
    assert [s["r"] for s in one_each] == [1] * 21
    assert [s["r"] for s in steps] == [1, 8, 8, 4]  # the prefill's token, then bursts
    a, b = bursts.model.dispatcher, single.model.dispatcher
    assert a.routed_counts() == b.routed_counts() and a.tokens_colocated == b.tokens_colocated


def test_bursts_grow_to_what_fits_in_their_window_of_time(panels, checkpoint):
    want, _ = run(engine(checkpoint, 1), {"r": greedy(40)})
    # tiny's steps take well under a millisecond: after the first burst, the window holds the
    # 64 steps a burst may have, and max_tokens ends it
    got, steps = run(engine(checkpoint, 2, window_ms=1000), {"r": greedy(40)})
    assert got == want and [s["r"] for s in steps] == [1, 2, 37]
    # a window shorter than any step leaves bursts at decode_burst
    _, steps = run(engine(checkpoint, 2, window_ms=0.001), {"r": greedy(9)})
    assert [s["r"] for s in steps] == [1, 2, 2, 2, 2]
    _, steps = run(engine(checkpoint, 1, window_ms=1000), {"r": greedy(5)})
    assert [s["r"] for s in steps] == [1] * 5  # 1: no bursts, whatever the window


def test_a_sampled_sequence_bursts_with_the_tokens_of_single_steps(panels, checkpoint):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    want, _ = run(engine(checkpoint, 1), {"r": params})
    got, steps = run(engine(checkpoint, 8), {"r": params})
    greedily, _ = run(engine(checkpoint, 8), {"r": greedy(20)})
    assert got == want and [s["r"] for s in steps] == [1, 8, 8, 3]
    assert got["r"][0] != greedily["r"][0]  # it really sampled


def test_a_burst_ends_at_a_stop_token_and_at_max_tokens(panels, checkpoint):
    ((tokens, _),) = run(engine(checkpoint, 1), {"r": greedy(12)})[0].values()
    stop = tokens[5]
    first = tokens.index(stop)
    single, bursts = engine(checkpoint, 1), engine(checkpoint, 8)
    run(single, {"r": greedy(12, stop_token_ids=(stop,))})
    out, steps = run(bursts, {"r": greedy(12, stop_token_ids=(stop,))})
    assert out["r"] == (tokens[: first + 1], FinishReason.STOP)
    # a burst that stopped early counts its steps' experts alone
    assert bursts.model.dispatcher.routed_counts() == single.model.dispatcher.routed_counts()
    out, steps = run(engine(checkpoint, 8), {"r": greedy(3)})
    assert out["r"] == (tokens[:3], FinishReason.LENGTH) and [s["r"] for s in steps] == [1, 2]


@pytest.mark.parametrize(
    "interrupt", ["a request arrives", "the sequence is cancelled", "its deadline passes"]
)
def test_a_burst_ends_at_the_next_token_when(panels, checkpoint, interrupt):
    e = engine(checkpoint, 8)
    deadline = time.monotonic() + 3 if interrupt == "its deadline passes" else None
    entered, go = threading.Event(), threading.Event()
    steps = e.model.fused.greedy_steps  # greedy: the whole burst runs in C

    def gated(*args):  # the burst begins once the interruption happened
        entered.set()
        assert go.wait(10)
        made = steps(*args)
        assert made is not None  # it ran in C
        return made

    async def drive() -> list:
        e.add_request("r", PROMPT, greedy(30), deadline=deadline)
        await e.step()  # the prefill
        e.model.fused.greedy_steps = gated
        step = asyncio.create_task(e.step())
        assert await asyncio.to_thread(entered.wait, 10)
        if interrupt == "a request arrives":
            e.add_request("late", PROMPT, greedy(2))
        elif deadline is None:
            e.abort("r")
        else:  # past the check before the burst, before its second step
            await asyncio.sleep(deadline - time.monotonic() + 0.01)
        go.set()
        return await step

    try:
        outputs = asyncio.run(drive())
    finally:
        e.close()
    [out] = [o for o in outputs if o.request_id == "r"]
    if interrupt != "the sequence is cancelled":
        assert len(out.new_token_ids) == 1 and out.finish_reason is None
    else:
        assert out.new_token_ids == [] and out.finish_reason is FinishReason.CANCELLED


@pytest.mark.parametrize(
    "requests",
    [
        {"r": greedy(6, logprobs=2)},
        {"r": greedy(6, repetition_penalty=1.2)},
        {"r": greedy(6, min_tokens=6)},
        {"r": greedy(6), "s": greedy(6)},
    ],
    ids=["logprobs", "penalized", "min_tokens", "two sequences"],
)
def test_no_burst_where_sampling_or_another_sequence_needs_single_steps(
    panels, checkpoint, requests
):
    _, steps = run(engine(checkpoint, 8), requests)
    assert all(n == 1 for step in steps for n in step.values())


def test_a_bursts_blocks_are_found_in_the_prefix_cache_as_single_steps_leave_them(
    panels, checkpoint
):
    hits = {}
    for burst in (1, 8):
        e = engine(checkpoint, burst)
        try:
            out, _ = run(e, {"a": greedy(20)}, close=False)
            before = e.scheduler.prefix_hit_tokens
            run(e, {"next turn": greedy(2)}, PROMPT + out["a"][0] + [1, 2, 3], close=False)
            hits[burst] = e.scheduler.prefix_hit_tokens - before
        finally:
            e.close()
    # 6 + 20 tokens, of which the cache holds the 25 computed: 6 full blocks of 4.
    assert hits[8] == hits[1] == 24


def test_a_burst_past_its_deadline_ends_its_request_as_a_failed_step_does(
    panels, checkpoint, caplog
):
    e = engine(checkpoint, 8)

    async def drive() -> list:
        e.add_request("r", PROMPT, greedy(30), deadline=time.monotonic() + 0.5)
        await e.step()  # the prefill
        await asyncio.sleep(0.6)
        return await e.step()

    try:
        [out] = asyncio.run(drive())
    finally:
        e.close()
    assert out.finish_reason is FinishReason.ERROR and isinstance(out.error, DeadlineExceededError)
    assert not e.has_unfinished() and e.scheduler.pool.num_free == e.scheduler.pool.num_blocks
    assert "engine step failed" not in caplog.text  # an expected end, not a bug's traceback


def test_no_burst_and_no_blocks_reserved_while_an_expert_is_remote(panels, checkpoint):
    s = RouterSettings(
        checkpoint=checkpoint("mixtral"), dtype="bfloat16", max_model_len=64, kv_block_size=4
    )
    here = build.build_model(build._open(s), s)
    remote = build._open(s).load_experts([(0, 3)])
    placement = {**here.dispatcher.placement, (0, 3): [Recording(remote)]}
    here.close()
    e = Engine(build.build_model(build._open(s), s, placement), s)
    assert not e.model.may_burst()
    _, steps = run(e, {"r": greedy(9)})
    assert [st["r"] for st in steps] == [1] * 9
