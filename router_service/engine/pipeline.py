"""How a step's micro-batches overlap (MegaScale-Infer's ping-pong): while one micro-batch waits
for its remote experts, another computes on the router's compute thread.

- `run_stretches` runs a forward pass, written as one coroutine, a stretch at a time on the compute
  thread; what the pass awaits through `on_loop` (a MoE layer's expert calls) runs on the event
  loop meanwhile, so other micro-batches' stretches compute while it is on the wire.
- `MicroBatchPlanner` picks how many micro-batches a step is split into.
"""

from __future__ import annotations

import contextvars
import inspect
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from statistics import fmean, median
from typing import Any, TypeVar

from common.perfmodel import LayerCosts, Linear, best_micro_batches, layer_time

T = TypeVar("T")

MAX_AUTO = 4  # the paper's 3-4 in practice; beyond, fixed costs per micro-batch dominate
TRIAL_STEPS = 4  # decode steps an m runs before its time counts
# Steps after which a measurement is forgotten: short enough that a choice made in noise is taken
# again, long enough that re-measuring a much slower runner-up costs few steps (32 cost ~30%).
MEMORY = 128
HYSTERESIS = 0.1  # a proposal must predict a layer this much shorter than the best measured

# Runs torch work where the router computes: its compute thread (engine/compute.py), or inline.
Compute = Callable[..., Awaitable[Any]]


async def inline(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


@dataclass
class CallTimes:
    """What one MoE layer's remote calls cost, for the micro-batch planner (seconds)."""

    wall: float = 0.0  # first call out to last answer in
    service: float = 0.0  # the slowest answering service's own time (queue + compute)


@dataclass
class PassCosts:
    """What one forward pass cost, for the micro-batch planner: router compute and, per MoE layer
    that called remote experts, the calls' times."""

    compute_s: float = 0.0
    remote: list[CallTimes] = field(default_factory=list)
    moe_layers: int = 1


# True while a stretch of a pass runs under run_stretches: on_loop then hands its work over.
_IN_STRETCH = contextvars.ContextVar("in_stretch", default=False)


class _OnLoop:
    """`fn(*args)`, to be awaited on the event loop (see on_loop)."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __await__(self):
        if not _IN_STRETCH.get():  # already on the event loop: nothing to hand over
            return (yield from self.fn(*self.args).__await__())
        # Suspends the pass: run_stretches awaits fn(*args) on the loop and resumes it with the result.
        return (yield self)


def on_loop(fn: Callable[..., Awaitable[T]], *args: Any) -> Awaitable[T]:
    """Await `fn(*args)` on the event loop: from a pass under run_stretches, its stretch ends here
    and the next one starts with the result; anywhere else, it is simply awaited."""
    return _OnLoop(fn, args)


def _stretch(
    coro: Coroutine[Any, Any, T],
    value: Any,
    error: BaseException | None,
    around: Callable[[], AbstractContextManager],
) -> tuple[bool, Any]:
    """Run `coro` up to its next on_loop, or its end: (False, _OnLoop) or (True, its result)."""
    token = _IN_STRETCH.set(True)
    try:
        with around():
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return True, stop.value
    finally:
        _IN_STRETCH.reset(token)
    if not isinstance(step, _OnLoop):
        coro.close()
        raise RuntimeError(f"a pass may await the event loop only through on_loop, not {step!r}")
    return False, step


async def run_stretches(
    compute: Compute,
    coro: Coroutine[Any, Any, T],
    around: Callable[[], AbstractContextManager] = nullcontext,
) -> T:
    """`coro`'s result, its code run on `compute` one stretch at a time, each stretch in `around()`;
    what it awaits through on_loop runs on the event loop between two stretches, while `compute`
    runs other passes' stretches."""
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            done, step = await compute(_stretch, coro, value, error, around)
            if done:
                return step
            try:
                value, error = await step.fn(*step.args), None
            except Exception as e:  # raised where the pass awaited it
                value, error = None, e
    finally:
        # Cancelled between two stretches (or before the first): end the pass here. A stretch
        # still running on the compute thread cannot be stopped; its pass is closed when collected.
        if inspect.getcoroutinestate(coro) in (inspect.CORO_CREATED, inspect.CORO_SUSPENDED):
            with suppress(ValueError):  # the compute thread took it up meanwhile
                coro.close()


class MicroBatchPlanner:
    """Chooses each step's micro-batches and learns from the steps and passes that ran.

    `auto` runs m = 1 and m = 2 in turns, tries a larger m when the pipeline model (fitted to
    the passes' costs) predicts a layer shorter than the best measured by HYSTERESIS, and uses
    the m with the shortest measured time per sequence; measurements expire after MEMORY steps.
    docs/architecture/micro-batches.md explains why.
    """

    def __init__(self, setting: str = "auto", window: int = 64) -> None:
        """`setting`: "auto" or a fixed count."""
        self.fixed = None if setting == "auto" else int(setting)
        # (sequences of a decode micro-batch, seconds per MoE layer) of recent remote passes
        self._ta: deque[tuple[int, float]] = deque(maxlen=window)
        self._te: deque[tuple[int, float]] = deque(maxlen=window)
        self._tc: deque[tuple[int, float]] = deque(maxlen=window)
        # (size class, m) -> (step number, seconds per sequence) of recent decode steps
        self._steps: defaultdict[tuple[int, int], deque[tuple[int, float]]] = defaultdict(
            lambda: deque(maxlen=TRIAL_STEPS)
        )
        self._step = 0
        self.last = 1  # what the latest step used
        self._sequences = 1  # ... and how many sequences it had
        self.steps_by_m: Counter[int] = Counter()

    def choose(self, sequences: int, remote: bool) -> int:
        """Micro-batches for a step of `sequences` (each micro-batch gets at least one)."""
        self._step += 1
        if self.fixed is not None:
            m = self.fixed
        elif not remote or sequences < 2:
            m = 1
        else:
            m = self._auto(sequences)
        self._sequences = sequences
        return max(1, min(m, sequences))

    def ran(self, m: int) -> None:
        """The step ran as m micro-batches (a split by tokens may make fewer than chosen)."""
        self.last = m
        self.steps_by_m[m] += 1

    def _auto(self, sequences: int) -> int:
        size = sequences.bit_length()
        fresh = {
            m: [s for n, s in self._steps[(size, m)] if self._step - n <= MEMORY]
            for m in range(1, min(MAX_AUTO, sequences) + 1)
        }
        measured = {m: median(s) for m, s in fresh.items() if len(s) == TRIAL_STEPS}
        untried = [m for m in (1, 2) if m not in measured]
        if untried:  # in turns while both are being measured
            return min(untried, key=lambda m: (len(fresh[m]), m))
        best = min(measured, key=measured.__getitem__)
        if not self._ta:  # no pass called remote experts: nothing to model
            return best
        costs = self.costs()
        proposal = best_micro_batches(costs, sequences, MAX_AUTO)
        if proposal not in measured and layer_time(costs, sequences, proposal) < (
            1 - HYSTERESIS
        ) * layer_time(costs, sequences, best):
            return proposal
        return best

    def observe_step(self, sequences: int, m: int, seconds: float) -> None:
        """A decode step's time (no prefill in it), for the m it ran with."""
        self._steps[(sequences.bit_length(), m)].append((self._step, seconds / sequences))

    def observe(self, sequences: int, costs: PassCosts) -> None:
        """Learn from one decode micro-batch's pass; passes without remote calls teach nothing."""
        if not costs.remote:
            return
        # The router's whole compute (dense layers, head, colocated layers too) per MoE layer.
        self._ta.append((sequences, costs.compute_s / costs.moe_layers))
        self._te.append((sequences, fmean(t.service for t in costs.remote)))
        self._tc.append(
            (sequences, fmean(max(0.0, (t.wall - t.service) / 2) for t in costs.remote))
        )

    def costs(self) -> Callable[[int], LayerCosts]:
        """The fitted LayerCosts as a function of micro-batch size."""
        ta, te, tc = (Linear.fit(*zip(*w)) for w in (self._ta, self._te, self._tc))
        return lambda b: LayerCosts(ta(b), te(b), tc(b))

    def estimate(self) -> LayerCosts:
        """The fitted costs for one micro-batch of the latest step (zeros until measured)."""
        if not self._ta:
            return LayerCosts(0.0, 0.0, 0.0)
        return self.costs()(-(-self._sequences // self.last))
