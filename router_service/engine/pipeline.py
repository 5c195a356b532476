"""How many micro-batches a step is split into (MegaScale-Infer's ping-pong, brief §4).

While one micro-batch waits for its remote experts, another computes on the router's compute
thread. `auto` lets the pipeline model propose and measured steps decide, per batch-size class
(powers of two):

- m = 1 and m = 2 are each run for a few decode steps, in turns (a burst of noise on shared cores
  then slows both, not one); two sizes of micro-batch are what the model needs to fit Ta(b),
  Te(b) and Tc(b) (common.perfmodel) from the passes — the router's compute per MoE layer, the
  services' own time per call, the rest of each round trip;
- a larger m is tried when the model predicts a layer shorter than the best measured m's by more
  than HYSTERESIS;
- the step uses the m with the shortest measured time per sequence; measurements expire after
  MEMORY steps, so the choice follows the mesh as it changes and one made in a burst of noise is
  taken again.

A model fitted to noisy timings on shared cores can be wrong where memory-bound experts pay their
weight reads once per micro-batch; a measured step cannot. Everything colocated needs no overlap:
m = 1.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable
from statistics import fmean, median

from common.perfmodel import LayerCosts, Linear, best_micro_batches, layer_time
from router_service.engine.model import PassCosts

MAX_AUTO = 4  # the paper's 3-4 in practice; beyond, fixed costs per micro-batch dominate
TRIAL_STEPS = 4  # decode steps an m runs before its time counts
# Steps after which a measurement is forgotten: short enough that a choice made in noise is taken
# again, long enough that re-measuring a much slower runner-up costs few steps (32 cost ~30%).
MEMORY = 128
HYSTERESIS = 0.1  # a proposal must predict a layer this much shorter than the best measured


class MicroBatchPlanner:
    """Chooses each step's micro-batches and learns from the steps and passes that ran."""

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
