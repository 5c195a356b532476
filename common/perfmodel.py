"""Timing model of MegaScale-Infer's ping-pong pipeline (one MoE layer's time from its router-side,
expert-side and transfer costs over m micro-batches), shared by the router's choice of micro-batches,
`moe-mesh profile` and `moe-mesh plan --search`. The model is docs/design/ping-pong-model.md.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Linear:
    """y = slope·x + intercept (seconds against sequences or bytes)."""

    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> Linear:
        """Least squares, both coefficients kept >= 0 (a cost never shrinks with work).

        One distinct x cannot separate the two: the whole cost is taken as fixed."""
        if not xs or len(xs) != len(ys):
            raise ValueError("fit needs as many x as y values, at least one")
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return cls(0.0, max(0.0, my))
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if slope < 0:
            return cls(0.0, max(0.0, my))
        intercept = my - slope * mx
        if intercept < 0:  # through the origin instead
            return cls(max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)), 0.0)
        return cls(slope, intercept)


@dataclass(frozen=True)
class Piecewise:
    """Seconds through measured (x, seconds) points, linear between neighbours and beyond the ends
    along the end segments (a cost never shrinks with work: the points are first made
    non-decreasing, a running maximum, and the result is never negative).

    Unlike one straight line through every point, it reproduces what was measured where it was
    measured: a line fitted over 1..64 undershoots a cost that bends upwards in between."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) < 2 or len(self.xs) != len(self.ys):
            raise ValueError("Piecewise needs as many x as y values, at least two")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError("Piecewise needs strictly increasing x values")

    @classmethod
    def through(cls, xs: Sequence[float], ys: Sequence[float]) -> Piecewise | Linear:
        """Through the points (repeated x averaged); fewer than two distinct x cannot give a
        slope, so those are Linear.fit's fixed cost."""
        if not xs or len(xs) != len(ys):
            raise ValueError("through needs as many x as y values, at least one")
        by_x: dict[float, list[float]] = {}
        for x, y in zip(xs, ys):
            by_x.setdefault(float(x), []).append(float(y))
        if len(by_x) < 2:
            return Linear.fit(xs, ys)
        keys = sorted(by_x)
        level, out = 0.0, []
        for x in keys:
            level = max(level, sum(by_x[x]) / len(by_x[x]))
            out.append(level)
        return cls(tuple(keys), tuple(out))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = bisect.bisect_right(xs, x) - 1
        i = min(max(i, 0), len(xs) - 2)  # the end segments carry on beyond the ends
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (x - xs[i]))


@dataclass(frozen=True)
class LayerCosts:
    """Seconds for one MoE layer of one micro-batch."""

    ta: float
    te: float
    tc: float  # one way


def split(batch: int, m: int) -> list[int]:
    """Micro-batch sizes: `batch` sequences in min(m, batch) parts that differ by at most one."""
    m = max(1, min(m, batch))
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)]


def layer_time(costs: Callable[[int], LayerCosts], batch: int, m: int) -> float:
    """Seconds one MoE layer takes for `batch` sequences in m micro-batches (see the module doc)."""
    parts = [costs(b) for b in split(batch, m)]
    one_round = max(c.ta + c.te + 2 * c.tc for c in parts)
    return max(one_round, sum(c.ta for c in parts), sum(c.te for c in parts))


def best_micro_batches(costs: Callable[[int], LayerCosts], batch: int, max_m: int = 4) -> int:
    """The m in 1..max_m with the shortest predicted layer; the smaller m on a tie."""
    candidates = range(1, max(1, min(max_m, batch)) + 1)
    return min(candidates, key=lambda m: (layer_time(costs, batch, m), m))


def paper_minimum(c: LayerCosts) -> int:
    """MegaScale-Infer's condition m >= 2(1 + Tc/Tf), Tf = max(Ta, Te): enough micro-batches to
    cover both transfers of a round, when every micro-batch costs the same whatever its size."""
    tf = max(c.ta, c.te)
    return 1 if tf <= 0 else math.ceil(2 * (1 + c.tc / tf))
