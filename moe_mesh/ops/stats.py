"""`moe-mesh stats`: latency percentiles, batch sizes, errors and expert utilization from the services'
Prometheus endpoints.

Every service exposes its OpenTelemetry metrics for Prometheus (common/telemetry.py). This reads them
once, without a Prometheus server. A histogram knows only how many observations fell in each bucket,
so a percentile is shown exactly where the buckets pin it down (one observation: the sum; all
observations at a bucket's upper bound: the mean equals it) and otherwise as the bound it is known
to be ("≤ 250", or "> 10000" past the last bucket), never interpolated: Prometheus'
`histogram_quantile` interpolates (`quantile` below), which made one 201 ms request read p50 175.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from common import telemetry as tm
from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError, MoeMeshError, UnavailableError
from moe_mesh.ops import tables
from moe_mesh.ops.placement import BLOCK, heatmap_png, shares
from moe_mesh.ops.ready import read_ready_file

ROLES = ("gateway", "router", "expert")
SECONDS = (
    tm.REQUEST_DURATION,
    tm.TIME_TO_FIRST_TOKEN,
    tm.TIME_PER_OUTPUT_TOKEN,
    tm.GATEWAY_QUEUE_WAIT,
    tm.DISPATCH_DURATION,
    tm.EXPERT_QUEUE_DURATION,
    tm.EXPERT_COMPUTE_DURATION,
)
COUNTS = (tm.ROUTER_BATCH_SIZE, tm.EXPERT_BATCH_TOKENS)
GAUGES = (tm.GATEWAY_QUEUE_DEPTH, tm.ROUTER_QUEUE_DEPTH)
SPLIT_BY = {
    tm.DISPATCH_DURATION: "moe_transport"
}  # colocated and gRPC calls differ by orders of magnitude
QUANTILES = (0.5, 0.9, 0.99)
SCRAPE_TIMEOUT_S = 5.0
# Mesh endpoints are local: an http_proxy from the environment must not be asked for them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def prometheus_name(otel_name: str) -> str:
    """A metric's family name as the OpenTelemetry exporter exposes it (the parser drops `_total`)."""
    return otel_name.replace(".", "_") + ("_seconds" if otel_name in SECONDS else "")


def scrape(address: str) -> list[Metric]:
    """The metric families at http://HOST:PORT/metrics; UnavailableError when unreachable or not Prometheus text."""
    try:
        with _OPENER.open(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
            text = reply.read().decode("utf-8")
        return list(text_string_to_metric_families(text))
    # URLError and timeouts are OSErrors; the parser raises ValueError
    except (OSError, ValueError) as e:
        raise UnavailableError(f"{address}: {getattr(e, 'reason', e)}") from None


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram from its (upper bound, cumulative count) buckets, +Inf last.

    As Prometheus' histogram_quantile: linear within the bucket holding the rank, the first bucket
    starting at 0, a rank in the +Inf bucket answered with the largest finite bound. None without
    observations."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    buckets = sorted(buckets)
    if len(buckets) < 2 or buckets[-1][0] != math.inf or not buckets[-1][1]:
        return None
    rank = q * buckets[-1][1]
    # The first non-empty bucket reaching the rank (non-empty: q=0 is the lower end of the lowest observation).
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank and count > 0)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    lower, below = buckets[b - 1] if b else (0.0, 0.0)
    upper, count = buckets[b]
    if b == 0 and upper <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)


def percentile(
    buckets: list[tuple[float, float]], count: float, total: float, q: float, integer: bool = False
) -> tuple[float | None, str]:
    """(value, how it is known): "=" exact, "≤" the upper bound of the bucket holding the rank, ">"
    beyond the largest finite bound. `count` and `total` are the histogram's _count and _sum;
    `integer`: the metric counts things (batch sizes), so a bucket holding one integer pins it."""
    buckets = sorted(buckets)
    if not count or len(buckets) < 2:
        return None, "="
    if count == 1:
        return total, "="
    rank = max(q * count, 1.0)  # the ceil-free rank: the smallest bucket holding that many
    b = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0], ">"
    upper = buckets[b][0]
    lower = buckets[b - 1][0] if b else 0.0
    if integer and upper == math.floor(upper) and upper - lower <= 1:
        return upper, "="
    # Every observation in this one bucket, their mean at its upper bound: all equal that bound.
    below = buckets[b - 1][1] if b else 0.0
    if below == 0 and buckets[b][1] == count and math.isclose(total / count, upper):
        return upper, "="
    return upper, "≤"


def _samples(families: list[Metric], otel_name: str, suffix: str = "") -> list[tuple[dict, float]]:
    name = prometheus_name(otel_name)
    return [
        (s.labels, s.value)
        for f in families
        if f.name == name
        for s in f.samples
        if s.name == name + suffix
    ]


def _histograms(families: list[Metric], otel_name: str, seconds: bool) -> list[dict]:
    """One row per value of the metric's split label (one row if it has none), summed over other labels."""
    split = SPLIT_BY.get(otel_name)
    parts: dict[str, dict] = defaultdict(
        lambda: {"buckets": defaultdict(float), "count": 0.0, "sum": 0.0}
    )
    for labels, value in _samples(families, otel_name, "_bucket"):
        parts[labels.get(split, "")]["buckets"][float(labels["le"])] += value
    for key, suffix in (("count", "_count"), ("sum", "_sum")):
        for labels, value in _samples(families, otel_name, suffix):
            parts[labels.get(split, "")][key] += value
    rows = []
    for part, h in sorted(parts.items()):
        row = {
            "metric": otel_name,
            "unit": "s" if seconds else "",
            "count": int(h["count"]),
            "mean": h["sum"] / h["count"] if h["count"] else None,
        }
        if split:
            row["labels"] = {split: part}
        for q in QUANTILES:
            value, known = percentile(
                list(h["buckets"].items()), h["count"], h["sum"], q, integer=not seconds
            )
            row[f"p{round(100 * q)}"] = value
            row[f"p{round(100 * q)}_known"] = known  # "=", "≤" or ">"
        rows.append(row)
    return rows


def infer_role(families: list[Metric]) -> str:
    """gateway, router or expert: named by target_info's service_name, else by the metrics only that role has."""
    for labels, _ in (
        (s.labels, s.value) for f in families if f.name == "target_info" for s in f.samples
    ):
        role = next((r for r in ROLES if labels.get("service_name", "").startswith(r)), None)
        if role:
            return role
    names = {f.name for f in families}
    prefixes = {
        "gateway": ("gen_ai_server", "moe_gateway"),
        "router": ("moe_router",),
        "expert": ("moe_expert",),
    }
    return next((r for r, p in prefixes.items() if any(n.startswith(p) for n in names)), "unknown")


def service_summary(address: str, families: list[Metric], role: str | None = None) -> dict:
    """One service's requests, latency and batch histograms, errors by gRPC status code, failovers, queue depth."""
    errors: dict[str, int] = defaultdict(int)
    for labels, value in _samples(families, tm.ERRORS, "_total"):
        errors[labels.get("rpc_grpc_status_code", "?")] += int(value)
    summary = {
        "role": role or infer_role(families),
        "address": address,
        "latency": [row for name in SECONDS for row in _histograms(families, name, True)],
        "batch": [row for name in COUNTS for row in _histograms(families, name, False)],
        "errors": dict(sorted(errors.items())),
    }
    requests = [r["count"] for r in summary["latency"] if r["metric"] == tm.REQUEST_DURATION]
    summary["requests"] = requests[0] if requests else None  # only the gateway sees whole requests
    failovers = _samples(families, tm.FAILOVERS, "_total")
    if failovers:
        summary["failovers"] = int(sum(v for _, v in failovers))
    depth = {
        name: sum(v for _, v in samples) for name in GAUGES if (samples := _samples(families, name))
    }
    if depth:
        summary["queue_depth"] = depth
    return summary


def utilization(scraped: dict[str, list[Metric]]) -> dict:
    """Tokens routed per (layer, expert) summed over every router, and each expert's share of its layer in %.

    Layers are those with routed tokens (dense layers never route); experts are numbered up to the highest seen."""
    tokens: dict[tuple[int, int], int] = defaultdict(int)
    for families in scraped.values():
        for labels, value in _samples(families, tm.TOKENS_ROUTED, "_total"):
            tokens[int(labels["moe_layer"]), int(labels["moe_expert"])] += int(value)
    layers = sorted({layer for layer, _ in tokens})
    experts = 1 + max((e for _, e in tokens), default=-1)
    rows = [[tokens.get((layer, e), 0) for e in range(experts)] for layer in layers]
    return {
        "layers": layers,
        "num_experts": experts,
        "tokens_routed": rows,
        "shares": [shares(r) for r in rows],
    }


def summarize(scraped: dict[str, list[Metric]], roles: dict[str, str] | None = None) -> dict:
    """The record `--json` prints: a summary per service in role order, and the mesh's expert utilization."""
    services = [
        service_summary(a, families, (roles or {}).get(a)) for a, families in scraped.items()
    ]
    order = {r: i for i, r in enumerate(ROLES)}
    services.sort(
        key=lambda s: order.get(s["role"], len(ROLES))
    )  # stable: given order within a role
    return {"services": services, "utilization": utilization(scraped)}


def collect(endpoints: list[tuple]) -> dict:
    """Scrape (role or None, metrics address[, service address]) endpoints and summarize; unreachable
    ones are warned about and listed under "unreachable", UnavailableError if none answers.

    With its service address (the gRPC address `moe-mesh status` shows) a service is named by it, and
    its metrics endpoint is listed as "metrics": one name for a service in every view."""
    scraped: dict[str, list[Metric]] = {}
    roles: dict[str, str] = {}
    names: dict[str, str] = {}
    unreachable = []
    for role, address, *name in endpoints:
        if name and name[0]:
            names[address] = name[0]
        try:
            scraped[address] = scrape(address)
        except UnavailableError as e:
            print(f"warning: metrics endpoint {e}; skipped", file=sys.stderr)
            unreachable.append({"address": address, "error": str(e)})
            continue
        if role:
            roles[address] = role
    if not scraped:
        raise UnavailableError(
            "no metrics endpoint answered: " + "; ".join(u["error"] for u in unreachable)
        )
    summary = summarize(scraped, roles) | {"unreachable": unreachable}
    for s in summary["services"]:
        s["metrics"] = s["address"]
        s["address"] = names.get(s["address"], s["address"])
    return summary


def render(summary: dict) -> str:
    """Per service a line of counts and a table of histogram percentiles (ms for latencies), then the heatmap."""
    blocks = []
    for s in summary["services"]:
        head = f"{s['role']} {s['address']}"
        if s["requests"] is not None:
            head += f"  requests {s['requests']}"
        head += "  errors " + (
            ", ".join(f"{code} {n}" for code, n in s["errors"].items()) or "none"
        )
        if "failovers" in s:
            head += f"  failovers {s['failovers']}"
        for name, depth in s.get("queue_depth", {}).items():
            head += f"  {name.split('.')[1]} queue {depth:g}"
        rows = [_row(r) for r in s["latency"] + s["batch"]]
        blocks.append(
            "\n".join([head, *_aligned(["", "count", "p50", "p90", "p99", "mean"], rows)])
            if rows
            else head + "\n  no observations yet"
        )
    blocks.append(_heatmap(summary["utilization"]))
    return "\n\n".join(blocks)


def _row(r: dict) -> list[str]:
    scale, fmt = (1000, "{:.2f}") if r["unit"] == "s" else (1, "{:.1f}")
    name = r["metric"] + "".join(f" [{v}]" for v in r.get("labels", {}).values())
    name += " (ms)" if r["unit"] == "s" else ""

    def shown(k: str) -> str:
        if r[k] is None:
            return "-"
        known = r.get(f"{k}_known", "=")
        return ("" if known == "=" else known) + fmt.format(scale * r[k])

    return [name, str(r["count"]), *(shown(k) for k in ("p50", "p90", "p99", "mean"))]


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    """Indented table: the first column left-aligned, numbers right-aligned."""
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    return [
        "  "
        + "  ".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(line, widths))
        )
        for line in [header, *rows]
    ]


def _heatmap(u: dict) -> str:
    """placement_view's heatmap layout: each layer's share in %, blocks of BLOCK experts, then the tokens."""
    if not u["layers"]:
        return "no tokens routed yet"
    lines = [
        "tokens routed per (layer, expert), summed over routers: share of each layer's tokens, %"
    ]
    for start in range(0, u["num_experts"], BLOCK):
        block = range(start, min(start + BLOCK, u["num_experts"]))
        lines += ["", "layer" + "".join(f" {e:>3} " for e in block) + "   tokens"]
        lines += [
            f"{layer:>5}" + "".join(f" {share[e]:>3} " for e in block) + f" {sum(row):>8}"
            for layer, share, row in zip(u["layers"], u["shares"], u["tokens_routed"])
        ]
    return "\n".join(lines)


def write_png(summary: dict, path: Path) -> None:
    """The utilization heatmap as a PNG: each expert's share of its layer's routed tokens."""
    u = summary["utilization"]
    heatmap_png(
        [[100 * v / (sum(row) or 1) for v in row] for row in u["tokens_routed"]],
        path,
        "tokens routed per (layer, expert), summed over routers",
        row_labels=[str(x) for x in u["layers"]],
        colorbar_label="% of the layer's routed tokens",
    )


def _nth(names: list, i: int) -> str | None:
    return names[i] if i < len(names) else None


def _ready_endpoints(path: Path) -> list[tuple[str | None, str]]:
    mesh = read_ready_file(path, "metrics")
    try:
        m = mesh["metrics"]
        routers = list(mesh.get("routers") or [])
        experts = [e.get("address") for e in mesh.get("experts") or []]
        # Parallel lists when `moe-mesh up` wrote them; a metrics endpoint without a name keeps its own.
        return [
            ("gateway", m["gateway"], mesh.get("gateway_grpc")),
            *(("router", a, _nth(routers, i)) for i, a in enumerate(m["routers"])),
            *(("expert", a, _nth(experts, i)) for i, a in enumerate(m["experts"])),
        ]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            "--ready-file",
            f"{path} names no metrics endpoints (a JSON 'metrics' object "
            "with gateway, routers and experts)",
        ) from None


class StatsSettings(BaseModel):
    """`moe-mesh stats`'s flags: where the metrics are, and how to show them."""

    model_config = ConfigDict(extra="forbid")

    ready_file: Path | None = Field(
        None,
        description="the file `moe-mesh up --ready-file` wrote; its metrics endpoints are read",
        json_schema_extra={"metavar": "FILE"},
    )
    metrics: list[tables.HostPort] | None = Field(
        None,
        description="a service's Prometheus endpoint (repeatable); its role is read from its metrics",
        json_schema_extra={"metavar": "HOST:PORT"},
    )
    as_json: bool = Field(False, description="print the summary as JSON instead of tables")
    png: Path | None = Field(
        None,
        description="also draw the utilization heatmap into this PNG file",
        json_schema_extra={"metavar": "FILE"},
    )


WHERE = ("ready_file", "metrics")  # one or the other
FLAGS = {"as_json": "--json"}


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `stats` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "stats",
        help="latency, batching, errors and expert utilization of a running mesh",
        description="Read every service's Prometheus endpoint once: request latency "
        "percentiles, batch sizes, errors by gRPC status code and the tokens "
        "routed to each expert.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    add_settings_arguments(where, StatsSettings, only=WHERE, flags=FLAGS)
    add_settings_arguments(p, StatsSettings, skip=WHERE, flags=FLAGS)
    p.set_defaults(func=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    s = typing.cast(StatsSettings, settings_from_args(StatsSettings, args, flags=FLAGS))
    try:
        endpoints = (
            [(None, a) for a in s.metrics]
            if s.metrics
            else _ready_endpoints(typing.cast(Path, s.ready_file))  # the group requires one
        )
        summary = collect(endpoints)
        if s.png:
            write_png(summary, s.png)
            print(f"wrote {s.png}", file=sys.stderr)
    except MoeMeshError as e:
        print(f"moe-mesh stats: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if s.as_json else render(summary))
    return 0
