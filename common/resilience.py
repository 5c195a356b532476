"""Client-edge resilience, shared by gateway -> router and router -> expert calls.

- `EndpointHealth`: Envoy-style outlier ejection per endpoint. Consecutive failures eject it for
  a time that doubles with each ejection (capped); once that time passes it is re-admitted, and
  its next call is the probe. A success resets the failure count. A passing health check may end
  an ejection early (`readmit`; common/probing.py checks ejected endpoints).
- `pick_healthy`: the endpoints a balancer may choose from: the admitted ones, or all of them when
  every one is ejected (Envoy's panic mode: a fully ejected cluster still gets traffic).
- `RetryBudget`: retries may add at most `ratio` of the recent requests (plus a small reserve per
  second), so a sick mesh is not hit with a multiple of its load.
- `LatencyWindow`: the recent latencies of an endpoint, for hedging delays and per-call timeouts;
  `SizedLatency` keeps them by call size, scaled to the call at hand (`call_size`).

Callers retry only calls that never reached the peer's application (or failed retryably), only
within the request's deadline, and only when the budget allows.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
Clock = Callable[[], float]


@dataclass(frozen=True)
class EjectionPolicy:
    consecutive_failures: int = 1  # failures in a row that eject an endpoint
    base_ejection_s: float = 1.0  # first ejection; doubles with each further one
    max_ejection_s: float = 30.0


class EndpointHealth:
    """Failure tracking and ejection state of one endpoint."""

    def __init__(
        self, policy: EjectionPolicy = EjectionPolicy(), clock: Clock = time.monotonic
    ) -> None:
        self.policy, self._clock = policy, clock
        self.failures = 0  # consecutive
        self.ejections = 0  # total, for status and metrics
        self._streak = 0  # ejections since the last success: sets the next ejection's length
        self.ejected_until = 0.0
        self.ejection_s = 0.0  # length of the latest ejection, for logs
        # Re-admitted by a health check and no real call has succeeded since.
        self.readmitted = False

    @property
    def ejected(self) -> bool:
        return self._clock() < self.ejected_until

    @property
    def ejection_left_s(self) -> float:
        return max(0.0, self.ejected_until - self._clock())

    @property
    def streak(self) -> int:
        """Ejections since the last successful call."""
        return self._streak

    def success(self) -> None:
        self.failures = 0
        self._streak = 0
        self.readmitted = False

    def readmit(self) -> None:
        """End the ejection now: a health check passed.

        The streak stays until a real call succeeds. A check shows the endpoint is up, not that it
        serves well: one that passes checks but fails its next call is ejected for twice as long
        again, as if the check had not been made."""
        self.ejected_until = 0.0
        self.failures = 0
        self.readmitted = True

    def failure(self) -> bool:
        """Count a failure; True when it ejected the endpoint."""
        self.failures += 1
        if self.failures < self.policy.consecutive_failures or self.ejected:
            return False
        p = self.policy
        self.ejection_s = min(p.max_ejection_s, p.base_ejection_s * 2**self._streak)
        self.ejected_until = self._clock() + self.ejection_s
        self._streak += 1
        self.ejections += 1
        self.failures = 0
        return True


def pick_healthy(endpoints: Iterable[T], health: Callable[[T], EndpointHealth]) -> list[T]:
    """The endpoints not ejected; all of them when every one is (panic mode)."""
    everyone = list(endpoints)
    admitted = [e for e in everyone if not health(e).ejected]
    return admitted or everyone


class RetryBudget:
    """Token bucket: each request deposits `ratio` tokens, a retry costs one.

    `min_per_s` tokens also accrue per second so a quiet service can still retry; the bucket holds
    at most `ratio * window_requests + min_per_s * window_s` tokens (bounded bursts).
    """

    def __init__(
        self,
        ratio: float = 0.2,
        min_per_s: float = 5.0,
        window_s: float = 10.0,
        window_requests: int = 100,
        clock: Clock = time.monotonic,
    ) -> None:
        self.ratio, self.min_per_s = ratio, min_per_s
        self.capacity = ratio * window_requests + min_per_s * window_s
        self._clock = clock
        self._tokens = min_per_s * window_s
        self._at = clock()
        self.retries = 0
        self.refused = 0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.min_per_s)
        self._at = now

    def request(self) -> None:
        """Record a first attempt."""
        self._refill()
        self._tokens = min(self.capacity, self._tokens + self.ratio)

    def try_retry(self) -> bool:
        """Take a retry token; False (and counted as refused) when the budget is spent."""
        self._refill()
        if self._tokens >= 1.0 - 1e-9:  # deposits of `ratio` add up with rounding error
            self._tokens -= 1.0
            self.retries += 1
            return True
        self.refused += 1
        return False


# Up to this many rows an expert call's time is mostly its fixed part (transport, wake-ups, reading
# the weights), beyond it the rows' compute. Latencies are learned per this many rows and scaled by
# `call_size`, so a call larger than those seen (a long prompt's prefill after decode steps) is
# given proportionally longer, not timed out and hedged on the small calls' figures. Small, so that
# the scaling errs long: a row of a larger call costs at most what one of this many does.
CALL_ROWS = 8


def call_size(rows: int) -> float:
    """A call of `rows` rows in CALL_ROWS-row calls' worth of time (at least 1)."""
    return max(rows, CALL_ROWS) / CALL_ROWS


class LatencyWindow:
    """The last `size` latencies (seconds) of an endpoint; quantiles once `min_samples` arrived."""

    def __init__(self, size: int = 256, min_samples: int = 16) -> None:
        self.min_samples = min_samples
        self._recent: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    def __len__(self) -> int:
        return len(self._recent)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the recent latencies, None while fewer than `min_samples` are known."""
        if len(self._sorted) < self.min_samples:
            return None
        return _quantile(self._sorted, q)


class SizedLatency:
    """An endpoint's latencies by call size: a LatencyWindow per size class (up to CALL_ROWS rows,
    then four times as many each), of seconds per call_size. A call is estimated from its own
    class, else from the nearest smaller one that knows enough (scaling up errs long), else the
    nearest larger one. In one window, a run of large calls (their fixed cost spread over many
    rows) would set the small calls' hedge delays far below what those take."""

    def __init__(self) -> None:
        self._classes: dict[int, LatencyWindow] = {}

    @staticmethod
    def _class(rows: int) -> int:
        k, top = 0, CALL_ROWS
        while rows > top:
            k, top = k + 1, top * 4
        return k

    def add(self, seconds: float, rows: int) -> None:
        window = self._classes.setdefault(self._class(rows), LatencyWindow())
        window.add(seconds / call_size(rows))

    def quantile(self, q: float, rows: int) -> float | None:
        """The q-quantile (seconds) of a call of `rows` rows; None while no class knows enough."""
        known = sorted(k for k, w in self._classes.items() if len(w) >= w.min_samples)
        if not known:
            return None
        below = [k for k in known if k <= self._class(rows)]
        window = self._classes[below[-1] if below else known[0]]
        return window.quantile(q) * call_size(rows)  # type: ignore[operator]  # known: not None


def _quantile(ordered: Sequence[float], q: float) -> float:
    i = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[i]
