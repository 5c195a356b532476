"""UtilizationWindow: tokens routed per (layer, expert) over the last window_s."""

from __future__ import annotations

from router_service.experts.utilization import UtilizationWindow


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_window_counts_only_the_last_window_s() -> None:
    clock = Clock()
    w = UtilizationWindow(2, 4, window_s=10.0, buckets=5, clock=clock)
    w.add(0, [(0, 1), (3, 2)])
    clock.t += 4
    w.add(1, [(1, 5)])
    assert w.counts().tolist() == [[1, 0, 0, 2], [0, 5, 0, 0]]
    clock.t += 7  # the first add is now older than the window, the second is not
    w.add(0, [(2, 3)])
    assert w.counts().tolist() == [[0, 0, 3, 0], [0, 5, 0, 0]]
    clock.t += 60  # nothing recent: an idle router reports no load
    assert w.counts().sum() == 0
