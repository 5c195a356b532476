"""Server-side dynamic batching: concurrent token groups for the same (layer, expert) share one FFN run.

Each (layer, expert) has a queue; one scheduler task per batcher runs while any queue holds work.
Each round it takes up to `max_batch_tokens` rows from the head of every non-empty queue (splitting
a group that does not fit) and runs all those batches, one after another, in ONE job on the single
compute thread, so a call with groups for k experts costs one executor hop, not k. Each batch's
groups then get their output rows; a batch whose FFN raises fails only its own groups. Compute
runs off the event loop, so calls keep arriving while a job runs; they queue up and go into the
next job together. That is where merging comes from even with `max_queue_delay_us=0`; a positive
delay only widens the window for the first group of an idle queue (a round starts when the oldest
head group has waited the delay, or when some queue holds `max_batch_tokens` rows).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from common import runtime
from common.device import device_lost
from common.errors import NotFoundError, UnavailableError
from common.moe import expert_ffn, experts_ffn, fusable
from common.placement import Pair
from common.staging import Stager
from common.telemetry import (
    EXPERT_BATCH_TOKENS,
    EXPERT_COMPUTE_DURATION,
    EXPERT_QUEUE_DURATION,
    OFF,
    Telemetry,
)
from common.weights import FFNWeights

HOST = Stager(torch.device("cpu"))  # the identity: rows and outputs stay in host memory


@dataclass
class BatcherStats:
    """Counters since start: groups submitted, successful expert FFN executions, token rows submitted."""

    groups: int = 0
    batches: int = 0
    tokens: int = 0


@dataclass(eq=False)
class _Group:
    """One caller's rows for one expert, possibly computed over several batches."""

    rows: torch.Tensor  # [n, hidden]
    future: asyncio.Future[torch.Tensor]
    enqueued_s: float
    taken: int = 0  # rows handed to batches so far
    computed: int = 0  # rows whose output arrived
    outputs: list[torch.Tensor] = field(
        default_factory=list
    )  # in row order: a job holds at most one batch per expert

    @property
    def rest(self) -> int:
        return self.rows.shape[0] - self.taken


@dataclass(eq=False)
class _Queue:
    groups: deque[_Group] = field(default_factory=deque)
    pending_tokens: int = 0  # queued rows not yet taken into a batch


_Batch = list[tuple[_Group, int, int]]  # (group, start row, stop row)


def _compute(parts: list[torch.Tensor], w: FFNWeights) -> torch.Tensor:
    """One batch's FFN; runs on the compute thread (grad mode is per thread, hence no_grad here).
    `parts`: the batch's rows, as one tensor once staged (several still join)."""
    with torch.no_grad():
        return expert_ffn(parts[0] if len(parts) == 1 else torch.cat(parts), w)  # [tokens, hidden]


def _compute_job(
    batches: list[tuple[list[torch.Tensor], FFNWeights]], stager: Stager = HOST
) -> list[tuple[torch.Tensor | Exception, float]]:
    """Every batch of one job, in order, on the compute thread: (output or its error, seconds) each.

    The rows go to the compute device in one copy and the outputs come back in host memory
    (common/staging.py; nothing moves on the CPU). Several batches in one call where their
    experts allow it (moe.experts_ffn: the threads share every expert's work), each then timed at
    its rows' share of the call; otherwise, or if that call fails, batch by batch, so that an
    error fails only the batch it belongs to. On a GPU the seconds are those of enqueueing."""
    xs = stager.to_device([parts for parts, _ in batches])  # each [tokens, hidden]
    results = _ffn_all(xs, [w for _, w in batches])
    host = iter(stager.to_host([out for out, _ in results if not isinstance(out, Exception)]))
    return [(out if isinstance(out, Exception) else next(host), s) for out, s in results]


def _ffn_all(
    xs: list[torch.Tensor], ws: list[FFNWeights]
) -> list[tuple[torch.Tensor | Exception, float]]:
    if len(xs) > 1 and all(fusable(w) for w in ws):
        with torch.no_grad():
            began = time.perf_counter()
            try:
                outs = experts_ffn(list(zip(xs, ws)))
            except Exception:  # found again below, and failing its own batch only
                outs = None
        if outs is not None:
            seconds = time.perf_counter() - began
            rows = sum(x.shape[0] for x in xs) or 1
            return [(out, seconds * x.shape[0] / rows) for out, x in zip(outs, xs)]
    results: list[tuple[torch.Tensor | Exception, float]] = []
    for x, w in zip(xs, ws):
        began = time.perf_counter()
        try:
            out: torch.Tensor | Exception = _compute([x], w)
        except Exception as e:  # fails this batch only
            out = e
        results.append((out, time.perf_counter() - began))
    return results


class DynamicBatcher:
    """Merges concurrent `submit` calls per (layer, expert) into batched `expert_ffn` executions.

    One compute thread: on a CPU host torch already uses every core inside one op, and a single
    thread keeps batches of different experts from competing for them. On a GPU the same thread
    enqueues each job on one stream; `stager` moves a job's rows to the device and its outputs
    back to host memory (common/staging.py; the default keeps them on the host).
    """

    def __init__(
        self,
        weights: Mapping[Pair, FFNWeights],
        max_batch_tokens: int = 4096,
        max_queue_delay_us: int = 0,
        telemetry: Telemetry = OFF,
        stager: Stager = HOST,
        on_device_lost: Callable[[BaseException], None] = lambda error: None,
    ) -> None:
        if max_batch_tokens < 1 or max_queue_delay_us < 0:
            raise ValueError("max_batch_tokens must be >= 1 and max_queue_delay_us >= 0")
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_us / 1e6
        self.stats = BatcherStats()
        self._queue_s = telemetry.latency(
            EXPERT_QUEUE_DURATION, "time a token group waited for its first batch"
        )
        self._compute_s = telemetry.latency(
            EXPERT_COMPUTE_DURATION, "time of one batched expert FFN"
        )
        self._batch_tokens = telemetry.sizes(
            EXPERT_BATCH_TOKENS, "token rows per batched expert FFN"
        )
        self._weights = dict(weights)
        self._stager = stager  # used on the compute thread only, one job at a time
        self._on_device_lost = on_device_lost  # told of each device error (common.device)
        self._queues: dict[Pair, _Queue] = {}
        self._active: dict[Pair, _Queue] = {}  # the queues holding groups, in arrival order
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = runtime.compute_thread("expert-ffn")
        self._closed = False

    async def submit(self, layer: int, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """expert_ffn(rows) for rows [n, hidden] -> [n, hidden], computed together with concurrent callers."""
        return (await self.submit_all(layer, [(expert, rows)]))[0]

    async def submit_all(
        self, layer: int, groups: list[tuple[int, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """`submit` for each (expert, rows) of one call, queued at once and awaited together
        (no task per group); nothing is queued when one expert is not served here."""
        if self._closed:
            raise UnavailableError("expert service is shutting down")
        for expert, _ in groups:
            if (layer, expert) not in self._weights:
                raise NotFoundError(f"layer {layer} expert {expert} is not served here")
        loop = asyncio.get_running_loop()
        futures = [self._enqueue(loop, (layer, expert), rows) for expert, rows in groups]
        if self._task is None:
            self._task = asyncio.create_task(self._schedule(), name="expert-batcher")
        # If our caller is cancelled, gather cancels the futures and the scheduler skips them.
        return list(await asyncio.gather(*futures))

    def _enqueue(
        self, loop: asyncio.AbstractEventLoop, key: Pair, rows: torch.Tensor
    ) -> asyncio.Future[torch.Tensor]:
        n = rows.shape[0]
        self.stats.groups += 1
        self.stats.tokens += n
        group = _Group(rows, loop.create_future(), loop.time())
        if n == 0:
            group.future.set_result(rows.clone())
            return group.future
        queue = self._queues.setdefault(key, _Queue())
        queue.groups.append(group)
        queue.pending_tokens += n
        self._active.setdefault(key, queue)
        self._arrived.set()
        return group.future

    async def close(self) -> None:
        """Stop batching: fail whatever is still queued, then stop the compute thread. Idempotent."""
        self._closed = True
        if (task := self._task) is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_queued(None)
        # A compute already running cannot be interrupted; wait for it off the loop.
        await asyncio.to_thread(self._executor.shutdown, True)

    # -- scheduler task ------------------------------------------------------------------

    async def _schedule(self) -> None:
        try:
            while self._prune():
                await self._wait_for_more()
                job: list[tuple[Pair, _Batch]] = []
                for key, queue in list(self._active.items()):
                    if batch := self._take(queue):
                        job.append((key, batch))
                    if not queue.groups:
                        del self._active[key]
                if job:
                    await self._run(job)
        except BaseException as e:  # close() cancels us, or a bug: either way no caller may hang
            self._fail_queued(e)
            raise
        finally:
            self._task = None

    def _prune(self) -> bool:
        """Drop finished head groups and emptied queues; True when work is left."""
        for key, queue in list(self._active.items()):
            if not self._drop_finished(queue):
                del self._active[key]
        return bool(self._active)

    @staticmethod
    def _drop_finished(queue: _Queue) -> bool:
        """Drop head groups nobody waits for any more (cancelled or failed); True when work is left."""
        while queue.groups and queue.groups[0].future.done():
            queue.pending_tokens -= queue.groups.popleft().rest
        return bool(queue.groups)

    async def _wait_for_more(self) -> None:
        """Wait until the oldest head group has waited max_queue_delay_s, or a full batch is queued."""
        if self.max_queue_delay_s <= 0:
            return
        loop = asyncio.get_running_loop()
        oldest = min(q.groups[0].enqueued_s for q in self._active.values())
        deadline = oldest + self.max_queue_delay_s
        while (
            all(q.pending_tokens < self.max_batch_tokens for q in self._active.values())
            and (remaining := deadline - loop.time()) > 0
        ):
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return

    def _take(self, queue: _Queue) -> _Batch:
        """Up to max_batch_tokens rows from the head of the queue, as (group, start row, stop row)."""
        budget, batch = self.max_batch_tokens, []
        while queue.groups and budget:
            g = queue.groups[0]
            if g.future.done():
                self._drop_finished(queue)
                continue
            n = min(budget, g.rest)
            batch.append((g, g.taken, g.taken + n))
            g.taken += n
            budget -= n
            queue.pending_tokens -= n
            if g.taken == g.rows.shape[0]:
                queue.groups.popleft()
        return batch

    async def _run(self, job: list[tuple[Pair, _Batch]]) -> None:
        """Compute every batch of the job in one executor call, then hand out the rows."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        for _, batch in job:
            for g, start, _ in batch:
                if start == 0:
                    self._queue_s.record(began - g.enqueued_s)
        work = [([g.rows[a:b] for g, a, b in batch], self._weights[key]) for key, batch in job]
        try:
            results = await loop.run_in_executor(self._executor, _compute_job, work, self._stager)
        # Fail every group of this job; their queued remainders are dropped later.
        except Exception as e:
            self._fail((g for _, batch in job for g, _, _ in batch), e)
            self._told(e)
            return
        except BaseException as e:
            self._fail((g for _, batch in job for g, _, _ in batch), e)
            raise
        for (_, batch), (out, seconds) in zip(job, results):
            if isinstance(out, Exception):
                self._fail((g for g, _, _ in batch), out)
                self._told(out)
                continue
            self.stats.batches += 1
            self._compute_s.record(seconds)
            self._batch_tokens.record(out.shape[0])
            offset = 0
            for g, start, stop in batch:
                g.outputs.append(out[offset : offset + stop - start])
                offset += stop - start
                g.computed += stop - start
                if g.computed == g.rows.shape[0] and not g.future.done():
                    g.future.set_result(
                        g.outputs[0] if len(g.outputs) == 1 else torch.cat(g.outputs)
                    )

    def _told(self, error: Exception) -> None:
        if device_lost(error):
            # Queued groups would run on the lost device: fail them retryably, as later calls are.
            self._fail_queued(UnavailableError(f"the expert service's device failed: {error!r}"))
            self._on_device_lost(error)

    def _fail_queued(self, error: BaseException | None) -> None:
        for queue in self._queues.values():
            self._fail(queue.groups, error)
            queue.groups.clear()
            queue.pending_tokens = 0
        self._active.clear()

    @staticmethod
    def _fail(groups: Iterable[_Group], error: BaseException | None) -> None:
        # Cancellation or shutdown: tell callers why, retryably.
        if not isinstance(error, Exception):
            error = UnavailableError("expert service stopped before computing this group")
        for g in groups:
            if not g.future.done():
                g.future.set_exception(error)
