"""Micro-batches: a pass run a stretch at a time, how a step is split, how many `auto` picks, and
proof that they overlap."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest

from common.checkpoint import Checkpoint
from common.errors import InternalError
from common.perfmodel import split
from common.sampling import SamplingParams
from router_service.build import build_model
from router_service.engine.compute import ComputeThread
from router_service.engine.engine import Engine, _partition
from router_service.engine.pipeline import (
    MEMORY,
    TRIAL_STEPS,
    CallTimes,
    MicroBatchPlanner,
    PassCosts,
    inline,
    on_loop,
    run_stretches,
)
from router_service.engine.scheduler import Chunk, Sequence
from router_service.experts.backends import ColocatedExperts
from router_service.experts.remote import ExpertOutputs
from router_service.settings import RouterSettings

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SLEEP_S = 0.05


def seqs(*lengths: int) -> list[Chunk]:
    """One chunk of `n` tokens per length (1: a decode)."""
    return [
        Chunk(Sequence(str(i), [1] * (n + 1), GREEDY, 0, None), int(n == 1), n)
        for i, n in enumerate(lengths)
    ]


def test_partition_balances_tokens_and_keeps_order() -> None:
    decodes = seqs(*[1] * 8)
    parts = _partition([], decodes, 3)
    assert [len(d) for _, d in parts] == [3, 3, 2]
    assert [s for _, d in parts for s in d] == decodes
    prefills = seqs(30, 2)
    parts = _partition(prefills, decodes, 2)
    assert parts[0] == ([prefills[0]], [])  # 30 of 40 tokens: a micro-batch of its own
    assert parts[1] == ([prefills[1]], decodes)
    assert _partition([], decodes[:1], 4) == [([], decodes[:1])]


def costs(b: int, ta: float, te: float, tc: float) -> PassCosts:
    """One pass with one remote MoE layer, costs per sequence."""
    return PassCosts(ta * b, [CallTimes(wall=te * b + 2 * tc * b, service=te * b)])


def run(planner: MicroBatchPlanner, sequences: int, step_s: dict[int, float]) -> int:
    """One decode step as the engine drives it: choose, pass(es), the step's time. Returns m."""
    m = planner.choose(sequences, remote=True)
    planner.ran(m)
    for b in split(sequences, m):
        planner.observe(b, costs(b, ta=1e-4, te=1e-4, tc=0.01))
    planner.observe_step(sequences, m, step_s[m])
    return m


def run_flat(planner: MicroBatchPlanner, step_s: dict[int, float]) -> int:
    """A 32-sequence decode step whose calls take 10 ms whatever their size, so the model proposes
    no m beyond the measured ones. Returns m."""
    m = planner.choose(32, remote=True)
    planner.ran(m)
    for b in split(32, m):
        planner.observe(b, PassCosts(0.011 * b / 32, [CallTimes(wall=0.01, service=0.01)]))
    planner.observe_step(32, m, step_s[m])
    return m


def test_planner_fixed_and_colocated() -> None:
    assert MicroBatchPlanner("3").choose(8, remote=True) == 3
    assert MicroBatchPlanner("3").choose(2, remote=True) == 2  # at least one sequence each
    assert MicroBatchPlanner("auto").choose(32, remote=False) == 1


def test_auto_measures_1_and_2_then_tries_what_the_model_proposes_and_keeps_the_fastest() -> None:
    auto = MicroBatchPlanner("auto")
    # The passes say: transfers far longer than compute, in proportion to the bytes, so the
    # model predicts 4 micro-batches best; the measured steps say 2 is fastest.
    step_s = {1: 0.30, 2: 0.20, 3: 0.25, 4: 0.40}
    used = [run(auto, 32, step_s) for _ in range(3 * TRIAL_STEPS + 4)]
    assert used[: 3 * TRIAL_STEPS] == [1, 2] * TRIAL_STEPS + [4] * TRIAL_STEPS
    assert used[3 * TRIAL_STEPS :] == [2] * 4
    assert auto.steps_by_m == {1: TRIAL_STEPS, 2: TRIAL_STEPS + 4, 4: TRIAL_STEPS}


def test_auto_tries_no_proposal_that_is_not_clearly_faster_and_forgets_old_steps() -> None:
    auto = MicroBatchPlanner("auto")
    # Te = 10 ms per call whatever its size, no transfer: the model predicts that splitting
    # costs the experts' time twice, so after measuring 1 and 2 it proposes nothing.
    for _ in range(2 * TRIAL_STEPS + 1):
        run_flat(auto, {1: 0.1, 2: 0.15})
    assert auto.steps_by_m == {1: TRIAL_STEPS + 1, 2: TRIAL_STEPS}
    for _ in range(MEMORY):  # other batch sizes run meanwhile
        auto.choose(4, remote=True)
    assert auto.choose(32, remote=True) == 1  # measured again, from the start


def test_auto_takes_back_a_choice_made_in_a_burst_of_noise_within_memory_steps() -> None:
    """m = 1 is faster, but the host was busy while it was measured: auto runs m = 2 until the
    measurement expires, then measures m = 1 again and returns to it."""
    auto = MicroBatchPlanner("auto")
    used = [
        run_flat(auto, {1: 0.5 if step < 2 * TRIAL_STEPS else 0.1, 2: 0.15})
        for step in range(2 * TRIAL_STEPS + MEMORY + 2 * TRIAL_STEPS)
    ]
    assert used[2 * TRIAL_STEPS] == 2  # misled
    assert used.count(2) <= TRIAL_STEPS + MEMORY + 1
    assert used[-TRIAL_STEPS:] == [1] * TRIAL_STEPS


class SleepyExperts(ColocatedExperts):
    """A remote-looking backend that sleeps SLEEP_S per call, then computes the true outputs;
    it records each call's (start, end)."""

    local = False
    address = "sleepy"

    def __init__(self, weights) -> None:
        super().__init__(weights)
        self.calls: list[tuple[int, float, float]] = []

    async def forward(self, layer, groups, timeout_s=None):
        start = time.perf_counter()
        await asyncio.sleep(SLEEP_S)
        out = self.compute(layer, groups)
        self.calls.append((layer, start, time.perf_counter()))
        return ExpertOutputs(out, "grpc", SLEEP_S)


def run_step(path, micro_batches: str) -> tuple[SleepyExperts, list[list[int]]]:
    ckpt = Checkpoint(path)
    sleepy = SleepyExperts(ckpt.load_experts(ckpt.all_expert_pairs()))
    settings = RouterSettings(checkpoint=path, micro_batches=micro_batches)
    model = build_model(ckpt, settings, placement={p: [sleepy] for p in ckpt.all_expert_pairs()})
    engine = Engine(model, settings)
    for i in range(4):
        engine.add_request(str(i), [5 + i, 9, 11], GREEDY)

    async def steps():
        out = [await engine.step() for _ in range(2)]  # prefill, then one decode step
        return [o.new_token_ids for o in out[-1]]

    try:
        return sleepy, asyncio.run(steps())
    finally:
        model.close()


def test_micro_batches_overlap_their_expert_calls(checkpoint) -> None:
    """With m = 2, the second micro-batch's call for a layer starts before the first one's has
    answered: the calls' intervals overlap, so the step waits on the union of its calls, not on
    their sum (which m = 1 does: its calls never overlap)."""
    path = checkpoint("mixtral")
    one, tokens_one = run_step(path, "1")
    two, tokens_two = run_step(path, "2")
    assert tokens_one == tokens_two
    moe_layers = len(Checkpoint(path).spec.moe_layer_ids)
    assert len(one.calls) == 2 * moe_layers and len(two.calls) == 4 * moe_layers

    def union_over_sum(calls) -> float:
        spans = sorted((s, e) for _, s, e in calls)
        union, end = 0.0, float("-inf")
        for s, e in spans:
            union += max(0.0, e - max(s, end))
            end = max(end, e)
        return union / sum(e - s for s, e in spans)

    assert union_over_sum(one.calls) == pytest.approx(1.0)
    decode_calls = two.calls[-2 * moe_layers :]
    for layer in set(layer for layer, _, _ in decode_calls):
        (a_start, a_end), (b_start, b_end) = sorted(
            (s, e) for lay, s, e in decode_calls if lay == layer
        )
        assert b_start < a_end  # in flight together
    assert union_over_sum(decode_calls) < 0.75


class BrokenOnce(ColocatedExperts):
    """Remote-looking experts whose next call, once armed, raises a bug (not a MoeMeshError)."""

    local = False
    address = "broken"

    def __init__(self, weights) -> None:
        super().__init__(weights)
        self.armed = False

    async def forward(self, layer, groups, timeout_s=None):
        if self.armed:
            self.armed = False
            raise RuntimeError("a bug in one micro-batch")
        return ExpertOutputs(self.compute(layer, groups), "grpc", 0.0)


def test_a_bug_in_one_micro_batch_ends_only_its_requests(checkpoint) -> None:
    path = checkpoint("olmoe")
    ckpt = Checkpoint(path)
    broken = BrokenOnce(ckpt.load_experts(ckpt.all_expert_pairs()))
    settings = RouterSettings(checkpoint=path, micro_batches="2")
    model = build_model(ckpt, settings, placement={p: [broken] for p in ckpt.all_expert_pairs()})
    engine = Engine(model, settings)
    for i in range(4):
        engine.add_request(str(i), [5 + i, 9, 11], GREEDY)

    async def steps():
        await engine.step()  # prefill
        broken.armed = True  # the first micro-batch's first call of the next step fails
        failing = await engine.step()
        return failing, await engine.step()

    try:
        failing, after = asyncio.run(steps())
    finally:
        engine.close()
    by_request = {}
    for out in failing:
        assert out.request_id not in by_request, "two results for one request in one step"
        by_request[out.request_id] = out
    assert {r for r, o in by_request.items() if o.error is not None} == {"0", "1"}
    assert all(isinstance(by_request[r].error, InternalError) for r in ("0", "1"))
    assert [len(by_request[r].new_token_ids) for r in ("2", "3")] == [1, 1]
    assert sorted(o.request_id for o in after) == ["2", "3"]  # they keep decoding


async def on_the_loop(value: int) -> tuple[int, int]:
    await asyncio.sleep(0)  # a real await: only the event loop can run it
    return value, threading.get_ident()


async def a_pass(trace: list[tuple[str, int]]) -> int:
    """Two stretches around an on_loop await, recording the thread each part ran on."""
    trace.append(("stretch", threading.get_ident()))
    value, loop_thread = await on_loop(on_the_loop, 41)
    trace.append(("loop", loop_thread))
    trace.append(("stretch", threading.get_ident()))
    return value + 1


def test_a_pass_runs_its_stretches_on_the_compute_thread_and_on_loop_work_on_the_loop() -> None:
    compute = ComputeThread()
    trace: list[tuple[str, int]] = []
    entered: list[str] = []

    @contextmanager
    def around():
        entered.append("stretch")
        yield

    async def main() -> tuple[int, int]:
        return await run_stretches(compute, a_pass(trace), around), threading.get_ident()

    try:
        result, loop_thread = asyncio.run(main())
    finally:
        compute.close()
    assert result == 42 and entered == ["stretch", "stretch"]
    (_, first), (_, on_loop_thread), (_, second) = trace
    assert first == second != loop_thread and on_loop_thread == loop_thread


async def test_outside_run_stretches_on_loop_is_a_plain_await() -> None:
    trace: list[tuple[str, int]] = []
    assert await a_pass(trace) == 42
    assert {thread for _, thread in trace} == {threading.get_ident()}


async def test_an_error_on_the_loop_is_raised_where_the_pass_awaited_it() -> None:
    async def failing() -> None:
        raise ValueError("no experts")

    async def catching() -> str:
        try:
            await on_loop(failing)
        except ValueError as e:
            return f"caught {e}"
        return "not raised"

    assert await run_stretches(inline, catching()) == "caught no experts"


async def test_a_pass_may_not_await_the_loop_except_through_on_loop() -> None:
    async def sneaky() -> None:
        await asyncio.sleep(0.01)

    with pytest.raises(RuntimeError, match="only through on_loop"):
        await run_stretches(inline, sneaky())


async def test_a_pass_cancelled_while_its_work_is_on_the_loop_is_closed() -> None:
    gate = asyncio.Event()
    closed: list[bool] = []

    async def waiting() -> None:
        try:
            await on_loop(gate.wait)
        finally:
            closed.append(True)

    task = asyncio.create_task(run_stretches(inline, waiting()))
    await asyncio.sleep(0)  # the task runs up to the gate
    assert not task.done() and closed == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]
