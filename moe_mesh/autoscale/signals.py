"""Each group's load per replica and the gateway's p99 time per output token, from the services'
own metrics: scraped directly from every replica (a local mesh; `LocalSignals`) or asked of the
Prometheus server that scrapes a deployment (`PrometheusSignals`).

A load is a counter's rate (policy.SERIES) over the last `window_s`: token rows or compute seconds
per second. A replica seen once has no rate yet and is left out of the average rather than counted
as idle: a replica that just started would otherwise read as spare capacity and undo its own
scale-up.
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.errors import UnavailableError
from moe_mesh.autoscale.policy import SERIES
from moe_mesh.autoscale.queries import TPOT_BUCKETS, duration, per_replica, tpot_p99
from moe_mesh.ops.stats import quantile, scrape

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local endpoints only


@dataclass(frozen=True)
class GroupLoad:
    replicas: int  # serving now
    load: float | None  # per measured replica, in the metric's unit; None: nothing measured yet


class Signals(Protocol):
    def read(self, metrics: dict[str, str]) -> dict[str, GroupLoad]:
        """{group: its load} for {group: metric name}; groups with no replica are absent."""
        ...

    def tpot_p99_ms(self) -> float | None: ...


class _Rates:
    """Counter samples per series over a sliding window, and their rates."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = defaultdict(deque)

    def add(self, key: str, now: float, value: float) -> float | None:
        """Record a sample; the rate since the window's oldest sample (None with one sample)."""
        samples = self._samples[key]
        if samples and value < samples[-1][1]:  # the process restarted: its counter did too
            samples.clear()
        samples.append((now, value))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None

    def forget_except(self, keys: set[str]) -> None:
        for key in set(self._samples) - keys:
            del self._samples[key]


class LocalSignals:
    """A mesh started by `moe-mesh up`: its endpoints (the ready file's contents) name every
    replica's metrics endpoint and the experts it serves (the group, e.g. '0-7:0-3'); the gateway's
    histogram gives TPOT."""

    def __init__(self, mesh: Callable[[], dict], window_s: float, clock=time.monotonic) -> None:
        self.mesh, self.clock = mesh, clock
        self._rates = _Rates(window_s)
        self._tpot: deque[tuple[float, dict[float, float]]] = deque()

    def read(self, metrics: dict[str, str]) -> dict[str, GroupLoad]:
        mesh = self.mesh()
        now = self.clock()
        rates: dict[str, list[float]] = defaultdict(list)
        serving: dict[str, int] = defaultdict(int)
        keys = set()
        metrics_of = mesh.get("metrics", {})
        for replica, endpoint in zip(mesh.get("experts", []), metrics_of.get("experts", [])):
            group = replica["experts"]
            if group not in metrics or not endpoint:
                continue
            serving[group] += 1
            try:
                families = scrape(endpoint)
            except UnavailableError:  # retiring or just died: the next read no longer lists it
                continue
            series = SERIES[metrics[group]]
            total = sum(s.value for f in families for s in f.samples if s.name == series)
            keys.add(key := f"{replica['address']} {series}")
            rate = self._rates.add(key, now, total)
            if rate is not None:
                rates[group].append(rate)
        self._rates.forget_except(keys)
        if serving and not keys:  # every endpoint refused: a stale ready file, a mesh gone
            raise UnavailableError("no expert service of the mesh answers its metrics endpoint")
        self._gateway_tpot(mesh, now)
        return {
            g: GroupLoad(n, sum(rates[g]) / len(rates[g]) if rates[g] else None)
            for g, n in serving.items()
        }

    def _gateway_tpot(self, mesh: dict, now: float) -> None:
        endpoint = mesh.get("metrics", {}).get("gateway")
        try:
            families = scrape(endpoint) if endpoint else []
        except UnavailableError:
            return
        buckets: dict[float, float] = defaultdict(float)
        for f in families:
            for s in f.samples:
                if s.name == TPOT_BUCKETS:
                    buckets[float(s.labels["le"])] += s.value
        self._tpot.append((now, dict(buckets)))
        while len(self._tpot) > 2 and self._tpot[1][0] <= now - self._rates.window_s:
            self._tpot.popleft()

    def tpot_p99_ms(self) -> float | None:
        """p99 of the tokens streamed in the window (Prometheus' histogram_quantile over the
        buckets' increase)."""
        if len(self._tpot) < 2:
            return None
        old, new = self._tpot[0][1], self._tpot[-1][1]
        increase = [(le, new[le] - old.get(le, 0.0)) for le in new]
        value = quantile(increase, 0.99) if increase else None
        return None if value is None else 1000 * value


class PrometheusSignals:
    """A deployment Prometheus scrapes (compose renders one): each group's Prometheus job and the
    gateway's, asked through its HTTP API with the PromQL the rendered Nomad policies use."""

    def __init__(self, url: str, window_s: float, jobs: dict[str, str], gateway_job: str) -> None:
        self.url, self.jobs, self.gateway_job = url.rstrip("/"), jobs, gateway_job
        self.window = duration(max(1, math.ceil(window_s)))

    def query(self, promql: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with _OPENER.open(url, timeout=10) as reply:
                body = json.loads(reply.read())
        except (OSError, ValueError) as e:
            raise UnavailableError(f"Prometheus at {self.url}: {getattr(e, 'reason', e)}") from None
        if body.get("status") != "success":
            raise UnavailableError(f"Prometheus at {self.url}: {body.get('error', body)}")
        return body["data"]["result"]

    def _scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        value = float(result[0]["value"][1]) if result else None
        return None if value is None or math.isnan(value) else value

    def read(self, metrics: dict[str, str]) -> dict[str, GroupLoad]:
        out = {}
        for group, metric in metrics.items():
            job = self.jobs[group]
            replicas = self._scalar(f'count(up{{job="{job}"}} == 1)')
            if replicas:
                out[group] = GroupLoad(
                    int(replicas), self._scalar(per_replica(metric, job, self.window))
                )
        return out

    def tpot_p99_ms(self) -> float | None:
        value = self._scalar(tpot_p99(self.gateway_job, self.window))
        return None if value is None else 1000 * value
