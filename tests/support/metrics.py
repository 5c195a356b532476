"""Reading a service's Prometheus endpoint in tests, through the benchmarks' own helper
(moe_mesh/benchmark/metrics.py): every sample, and sums over label filters."""

from __future__ import annotations

from common.telemetry import Telemetry
from moe_mesh.benchmark.metrics import samples, total

__all__ = ["scrape", "total"]


def scrape(telemetry: Telemetry | str) -> dict[str, float]:
    """Every sample of a service's /metrics (a Telemetry's or at an address), as `samples` gives."""
    return samples(telemetry if isinstance(telemetry, str) else telemetry.metrics_address)
