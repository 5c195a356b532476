"""Reading a service's Prometheus endpoint in tests: every sample, and sums over label filters."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from common.telemetry import Telemetry


def scrape(telemetry: Telemetry | str) -> dict[str, float]:
    """Every sample of a service's /metrics as {"name{label=value,...}": value}, labels sorted, scope labels dropped."""
    address = telemetry if isinstance(telemetry, str) else telemetry.metrics_address
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if not k.startswith("otel_scope")
            )
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        v
        for k, v in samples.items()
        if k.split("{")[0] == name
        and all(w in k.split("{")[1].rstrip("}").split(",") for w in want)
    )
