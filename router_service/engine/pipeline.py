"""How many micro-batches a step is split into (MegaScale-Infer's ping-pong, brief §4).

While one micro-batch waits for its remote experts, another computes on the router's compute
thread. `auto` fits Ta(b), Te(b) and Tc(b) (common.perfmodel) to what recent steps measured — the
router's compute per MoE layer, the services' own time per call, the rest of each round trip — and
takes the m with the shortest predicted layer. Everything colocated needs no overlap: m = 1.
"""

from __future__ import annotations

from collections import Counter, deque
from statistics import fmean

from moe_mesh.common.perfmodel import LayerCosts, Linear, best_micro_batches, layer_time
from moe_mesh.router_service.engine.model import PassCosts

MAX_AUTO = 4  # the paper's 3-4 in practice; beyond, fixed costs per micro-batch dominate
# auto moves off the m it uses only for a predicted gain above this: fits of noisy timings
# would otherwise flip between two m that are about as good
HYSTERESIS = 0.1


class MicroBatchPlanner:
    def __init__(self, setting: str = "auto", window: int = 64) -> None:
        """`setting`: "auto" or a fixed count."""
        self.fixed = None if setting == "auto" else int(setting)
        # (sequences of a decode micro-batch, seconds per MoE layer) of recent remote passes
        self._ta: deque[tuple[int, float]] = deque(maxlen=window)
        self._te: deque[tuple[int, float]] = deque(maxlen=window)
        self._tc: deque[tuple[int, float]] = deque(maxlen=window)
        self.last = 1  # what the latest step used
        self.steps_by_m: Counter[int] = Counter()
        self._sequences = 1  # ... and how many sequences it had

    def choose(self, sequences: int, remote: bool) -> int:
        """Micro-batches for a step of `sequences` (each micro-batch gets at least one)."""
        if self.fixed is not None:
            m = self.fixed
        elif not remote or sequences < 2:
            m = 1
        elif len(sizes := {b for b, _ in self._ta}) < 2:
            # One size cannot tell fixed from per-token cost: measure the whole batch, then halves.
            m = 2 if sequences in sizes else 1
        else:
            costs = self.costs()
            m = best_micro_batches(costs, sequences, MAX_AUTO)
            now = min(self.last, sequences)
            if layer_time(costs, sequences, m) > (1 - HYSTERESIS) * layer_time(
                costs, sequences, now
            ):
                m = now
        self.last = max(1, min(m, sequences))
        self._sequences = sequences
        self.steps_by_m[self.last] += 1
        return self.last

    def estimate(self) -> LayerCosts:
        """The fitted costs for one micro-batch of the latest step (zeros until measured)."""
        if not self._ta:
            return LayerCosts(0.0, 0.0, 0.0)
        return self.costs()(-(-self._sequences // self.last))

    def observe(self, sequences: int, costs: PassCosts) -> None:
        """Learn from one decode micro-batch's pass; passes without remote calls teach nothing."""
        if not costs.remote:
            return
        layers = len(costs.remote)
        self._ta.append((sequences, costs.compute_s / layers))
        self._te.append((sequences, fmean(t.service for t in costs.remote)))
        self._tc.append(
            (sequences, fmean(max(0.0, (t.wall - t.service) / 2) for t in costs.remote))
        )

    def costs(self):
        """The fitted LayerCosts as a function of micro-batch size."""
        ta, te, tc = (Linear.fit(*zip(*w)) for w in (self._ta, self._te, self._tc))
        return lambda b: LayerCosts(ta(b), te(b), tc(b))
