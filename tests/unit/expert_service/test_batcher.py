"""DynamicBatcher on its own: groups queued during a compute merge, one job per round, split groups, failures, close."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from common import bf16
from common.errors import UnavailableError
from common.moe import expert_ffn
from common.staging import Stager
from common.weights import FFNWeights
from expert_service import batcher as batcher_module
from expert_service.batcher import DynamicBatcher
from expert_service.core import ExpertHost
from tests.support.devices import FakeDevice
from tests.support.experts import HIDDEN, assert_close
from tests.support.polling import eventually


def count_jobs(monkeypatch, batcher: DynamicBatcher) -> list[object]:
    """The functions handed to the batcher's compute thread, one entry per executor submission."""
    jobs: list[object] = []
    submit = batcher._executor.submit

    def counting(fn, /, *args, **kwargs):
        jobs.append(fn)
        return submit(fn, *args, **kwargs)

    monkeypatch.setattr(batcher._executor, "submit", counting)
    return jobs


async def test_a_call_with_groups_for_several_experts_is_computed_in_one_executor_job(
    settings, monkeypatch
) -> None:
    batches: list[int] = []
    compute = batcher_module._compute

    def counted(parts, w):
        batches.append(sum(p.shape[0] for p in parts))
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", counted)
    host = ExpertHost.load(settings())
    jobs = count_jobs(monkeypatch, host.batcher)
    groups = [(e, torch.randn(n, HIDDEN)) for e, n in ((0, 2), (1, 3), (2, 1), (3, 4))]
    out = await asyncio.wait_for(
        host.forward(
            host.model_id,
            host.weights_checksum,
            1,
            [e for e, _ in groups],
            [len(rows) for _, rows in groups],
            torch.cat([rows for _, rows in groups]),
        ),
        5,
    )
    assert len(jobs) == 1 and batches == [2, 3, 1, 4]  # four batches, one hop to the compute thread
    stats = host.batcher.stats
    assert (stats.groups, stats.batches, stats.tokens) == (4, 4, 10)
    assert_close(
        list(torch.split(out, [2, 3, 1, 4])),
        [expert_ffn(rows, host.weights[(1, e)]) for e, rows in groups],
    )
    await host.close()


async def test_groups_queued_during_a_compute_merge_into_the_next_batch_without_delay(
    settings, monkeypatch
) -> None:
    started, release = threading.Event(), threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # holds the compute thread until the test has queued more groups
        started.set()
        release.wait(5)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    host = ExpertHost.load(settings())
    batcher = DynamicBatcher(host.weights, max_queue_delay_us=0)
    rows = [torch.randn(n, HIDDEN) for n in (2, 3, 4)]
    first = asyncio.ensure_future(batcher.submit(0, 1, rows[0]))
    assert await asyncio.to_thread(started.wait, 5)
    rest = [asyncio.ensure_future(batcher.submit(0, 1, r)) for r in rows[1:]]
    await eventually(lambda: batcher.stats.groups == 3, 5, "both groups queued behind the batch")
    release.set()
    results = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    assert (batcher.stats.groups, batcher.stats.batches, batcher.stats.tokens) == (3, 2, 9)
    assert_close(results, [expert_ffn(r, host.weights[(0, 1)]) for r in rows])
    await batcher.close()


async def test_cancelling_a_group_split_across_batches_drops_its_rest_and_serves_the_others(
    settings, monkeypatch
) -> None:
    batches: list[int] = []
    started, release = threading.Event(), threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # the first batch holds the compute thread until the test has cancelled
        batches.append(sum(p.shape[0] for p in parts))
        started.set()
        release.wait(5)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    host = ExpertHost.load(settings())
    batcher = DynamicBatcher(host.weights, max_batch_tokens=4, max_queue_delay_us=0)
    big, small = torch.randn(10, HIDDEN), torch.randn(3, HIDDEN)
    cancelled = asyncio.ensure_future(batcher.submit(0, 1, big))  # 10 rows: batches of 4, 4, 2
    assert await asyncio.to_thread(started.wait, 5)  # its first 4 rows are computing
    other = asyncio.ensure_future(batcher.submit(0, 1, small))
    await eventually(lambda: batcher.stats.groups == 2, 5, "the second group queued")
    cancelled.cancel()
    release.set()
    assert_close([await asyncio.wait_for(other, 5)], [expert_ffn(small, host.weights[(0, 1)])])
    assert cancelled.cancelled()
    assert batches == [4, 3]  # the cancelled group's other 6 rows were never computed
    queue = batcher._queues[(0, 1)]
    assert (queue.pending_tokens, len(queue.groups)) == (0, 0)
    again = torch.randn(
        5, HIDDEN
    )  # the queue's accounting is intact: a new group is split and served
    assert_close(
        [await asyncio.wait_for(batcher.submit(0, 1, again), 5)],
        [expert_ffn(again, host.weights[(0, 1)])],
    )
    assert batches[2:] == [4, 1]
    await batcher.close()
    await host.close()


async def test_batcher_fails_every_group_of_a_failing_batch_and_keeps_serving(
    settings, monkeypatch
) -> None:
    host = ExpertHost.load(settings())
    broken = FFNWeights.from_parts(
        torch.zeros(8, 3), torch.zeros(8, 3), torch.zeros(3, 8)
    )  # wrong width
    batcher = DynamicBatcher(
        {(0, 0): broken, (0, 1): host.weights[(0, 1)]}, max_queue_delay_us=50_000
    )
    jobs = count_jobs(monkeypatch, batcher)
    rows = torch.randn(2, HIDDEN)
    results = await asyncio.wait_for(
        asyncio.gather(
            batcher.submit(0, 0, rows),
            batcher.submit(0, 0, rows),
            batcher.submit(0, 1, rows),
            return_exceptions=True,
        ),
        5,
    )
    assert [type(r) for r in results[:2]] == [RuntimeError, RuntimeError]
    assert_close([results[2]], [expert_ffn(rows, host.weights[(0, 1)])])
    assert (batcher.stats.groups, batcher.stats.batches) == (3, 1)
    assert len(jobs) == 1  # the failing batch shared its job with the one that succeeded
    assert_close(
        [await batcher.submit(0, 1, rows)], [results[2]]
    )  # the queue still works after a failure
    await batcher.close()
    await host.close()


async def test_closing_the_batcher_fails_queued_groups_instead_of_hanging(settings) -> None:
    host = ExpertHost.load(settings())
    batcher = DynamicBatcher(host.weights, max_queue_delay_us=10_000_000)
    queued = asyncio.ensure_future(batcher.submit(0, 1, torch.randn(2, HIDDEN)))
    await eventually(lambda: batcher.stats.groups == 1, 5, "the group queued")
    await asyncio.wait_for(batcher.close(), 5)
    with pytest.raises(UnavailableError):
        await queued
    with pytest.raises(UnavailableError):
        await batcher.submit(0, 1, torch.randn(2, HIDDEN))


@pytest.mark.skipif(bf16.kernel("moe_silu_ffns") is None, reason="no C compiler or no AVX2")
async def test_a_job_of_experts_in_panels_is_one_call_for_all_of_them(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)

    def panels(*shape: int) -> bf16.Panels:
        return bf16.Panels((torch.randn(*shape, generator=gen) / shape[1] ** 0.5).bfloat16())

    weights = {(0, e): FFNWeights(gate_up=panels(128, 64), down=panels(64, 64)) for e in range(3)}
    calls: list[int] = []
    together = batcher_module.experts_ffn
    monkeypatch.setattr(
        batcher_module, "experts_ffn", lambda pairs: calls.append(len(pairs)) or together(pairs)
    )
    batcher = DynamicBatcher(weights)
    groups = [
        (e, torch.randn(n, 64, generator=gen).bfloat16()) for e, n in ((0, 2), (1, 1), (2, 3))
    ]
    out = await asyncio.wait_for(batcher.submit_all(0, groups), 5)
    assert calls == [3] and batcher.stats.batches == 3  # three batches, one kernel call
    assert all(torch.equal(o, expert_ffn(x, weights[(0, e)])) for o, (e, x) in zip(out, groups))
    await batcher.close()


async def test_a_job_on_a_device_is_staged_in_once_and_back_to_host_memory_once(settings) -> None:
    """On a GPU (here the fake one of tests/support/devices.py) the rows of every batch of a job
    go to the device in one copy, and the outputs come back, after one synchronize."""
    host = ExpertHost.load(settings())
    device = FakeDevice()
    batcher = DynamicBatcher(
        host.weights, max_queue_delay_us=50_000, stager=Stager(torch.device("cuda"), device)
    )
    rows = [torch.randn(n, HIDDEN) for n in (2, 3, 4)]
    results = await asyncio.wait_for(
        asyncio.gather(
            batcher.submit(0, 1, rows[0]),
            batcher.submit(0, 1, rows[1]),
            batcher.submit(0, 2, rows[2]),
        ),
        5,
    )
    weights = [host.weights[(0, 1)], host.weights[(0, 1)], host.weights[(0, 2)]]
    assert_close(results, [expert_ffn(r, w) for r, w in zip(rows, weights)])
    # one job: both batches in, each batch's output out, one synchronize before any is read
    assert [e[0] for e in device.log] == ["h2d", "d2h", "d2h", "sync"]
    assert device.log[0][1:] == ((9 * HIDDEN * 4,), torch.uint8)  # 9 rows of float32, one copy
    await batcher.close()
    await host.close()
