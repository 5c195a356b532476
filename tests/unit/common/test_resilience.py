"""common/resilience.py: ejection and re-admission, panic mode, retry budget, latency quantiles."""

from __future__ import annotations

from common.resilience import (
    EjectionPolicy,
    EndpointHealth,
    LatencyWindow,
    RetryBudget,
    SizedLatency,
    pick_healthy,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ejection_doubles_and_is_capped_and_a_success_resets_it() -> None:
    clock = Clock()
    h = EndpointHealth(
        EjectionPolicy(consecutive_failures=2, base_ejection_s=1.0, max_ejection_s=3.0), clock
    )
    assert not h.failure() and not h.ejected  # one failure is below the threshold
    assert h.failure() and h.ejected
    clock.now += 1.01
    assert not h.ejected  # re-admitted: its next call is the probe
    h.failure()
    assert (
        h.failure() and h.ejected_until == clock.now + 2.0
    )  # second ejection in a row: twice as long
    clock.now += 2.01
    h.failure(), h.failure()
    assert h.ejected_until == clock.now + 3.0  # capped
    clock.now += 3.01
    h.success()
    h.failure(), h.failure()
    assert h.ejected_until == clock.now + 1.0  # the streak ended with the success
    assert h.ejections == 4


def test_failures_while_ejected_do_not_extend_the_ejection() -> None:
    clock = Clock()
    h = EndpointHealth(EjectionPolicy(consecutive_failures=1, base_ejection_s=1.0), clock)
    assert h.failure()
    until = h.ejected_until
    assert not h.failure() and h.ejected_until == until


def test_pick_healthy_skips_ejected_endpoints_unless_all_are() -> None:
    clock = Clock()
    health = {name: EndpointHealth(EjectionPolicy(), clock) for name in "abc"}
    health["a"].failure()
    assert pick_healthy("abc", health.__getitem__) == ["b", "c"]
    health["b"].failure(), health["c"].failure()
    assert pick_healthy("abc", health.__getitem__) == ["a", "b", "c"]


def test_retry_budget_allows_a_fraction_of_requests_plus_a_reserve() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.1, min_per_s=1.0, window_s=2.0, window_requests=100, clock=clock)
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]  # the 2-token reserve
    for _ in range(50):
        budget.request()
    assert sum(budget.try_retry() for _ in range(10)) == 5  # 10% of 50 requests
    clock.now += 1.0
    assert budget.try_retry() and not budget.try_retry()  # one more per second
    assert budget.retries == 8 and budget.refused == 7


def test_latency_window_quantiles_over_the_recent_samples() -> None:
    w = LatencyWindow(size=100, min_samples=10)
    for i in range(9):
        w.add(float(i))
    assert w.quantile(0.5) is None
    for i in range(9, 200):
        w.add(float(i))
    assert len(w) == 100
    assert w.quantile(0.0) == 100.0 and w.quantile(1.0) == 199.0
    assert 148.0 <= w.quantile(0.5) <= 150.0


def test_sized_latency_estimates_a_call_from_calls_of_its_size() -> None:
    latency = SizedLatency()
    assert latency.quantile(0.5, 4) is None
    for _ in range(20):
        latency.add(0.05, 4)  # decode calls: 50 ms, mostly fixed cost
    assert latency.quantile(0.5, 4) == 0.05
    assert latency.quantile(0.5, 800) == 0.05 * 100  # never seen: scaled up from the small ones
    for _ in range(300):
        latency.add(1.0, 2048)  # a long prefill's calls: 2 ms a row
    # Each size from its own calls: the prefill's cheap rows do not shorten the decode calls'.
    assert latency.quantile(0.5, 4) == 0.05 and latency.quantile(0.5, 2048) == 1.0
    assert latency.quantile(0.5, 100) == 0.05 * 12.5  # the nearest smaller class, scaled up


def test_readmit_ends_the_ejection_and_keeps_the_streak_until_a_call_succeeds() -> None:
    clock = Clock()
    h = EndpointHealth(EjectionPolicy(base_ejection_s=1.0, max_ejection_s=30.0), clock)
    assert h.failure() and h.ejected and h.ejection_s == 1.0
    h.readmit()
    assert not h.ejected and h.readmitted and h.streak == 1
    assert h.failure() and h.ejection_s == 2.0  # failed again: backs off as if never re-admitted
    clock.now += 2.01
    h.success()
    assert not h.readmitted and h.streak == 0
    assert h.failure() and h.ejection_s == 1.0
