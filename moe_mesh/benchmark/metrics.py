"""A service's Prometheus samples as a flat dict, and sums over label filters: what a benchmark
reads before and after a run to count what the services did meanwhile."""

from __future__ import annotations

from moe_mesh.ops.stats import scrape


def samples(address: str) -> dict[str, float]:
    """Every sample at http://ADDRESS/metrics as {"name{label=value,...}": value}, labels sorted,
    OpenTelemetry scope labels dropped. UnavailableError when nothing answers there."""
    out = {}
    for family in scrape(address):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if not k.startswith("otel_scope")
            )
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include every one of `labels`."""
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        v
        for k, v in samples.items()
        if k.split("{")[0] == name
        and all(w in k.split("{")[1].rstrip("}").split(",") for w in want)
    )
