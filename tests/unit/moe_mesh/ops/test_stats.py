"""`moe-mesh stats`: summaries of real OpenTelemetry Prometheus expositions, scraped over HTTP."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator

import pytest
from opentelemetry.metrics import Observation

from common import telemetry as tm
from common.errors import UnavailableError
from common.telemetry import COUNT_BUCKETS, SECONDS_BUCKETS, Telemetry
from moe_mesh.ops import stats as stats_view
from moe_mesh.ops.stats import (
    collect,
    infer_role,
    percentile,
    quantile,
    render,
    scrape,
    summarize,
)

PNG = b"\x89PNG\r\n\x1a\n"
EXPERTS = 4
# Tokens routed per router: layer 1 and 2 route (layer 0 is dense and never does), {(layer, expert): tokens}.
ROUTED = [{(1, 0): 30, (1, 1): 10, (2, 3): 7}, {(1, 0): 10, (1, 2): 20, (2, 0): 3, (2, 3): 13}]


def seconds(t: Telemetry, name: str):
    return t.meter.create_histogram(
        name, unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS
    )


def counts(t: Telemetry, name: str):
    return t.meter.create_histogram(name, explicit_bucket_boundaries_advisory=COUNT_BUCKETS)


def gateway(t: Telemetry) -> None:
    """100 requests: 40 of 3 ms, 60 of 200 ms; time to first token 0.01 s .. 1.0 s uniformly; 3 errors."""
    duration = seconds(t, tm.REQUEST_DURATION)
    for i in range(100):
        duration.record(0.003 if i < 40 else 0.2, {"rpc.grpc.status_code": "OK"})
    ttft = seconds(t, tm.TIME_TO_FIRST_TOKEN)
    for i in range(1, 101):
        ttft.record(i / 100)
    errors = t.meter.create_counter(tm.ERRORS)
    errors.add(2, {"rpc.grpc.status_code": "INVALID_ARGUMENT"})
    errors.add(1, {"rpc.grpc.status_code": "RESOURCE_EXHAUSTED"})
    t.meter.create_observable_gauge(tm.GATEWAY_QUEUE_DEPTH, callbacks=[lambda _: [Observation(3)]])


def router(t: Telemetry, routed: dict[tuple[int, int], int]) -> None:
    """Batches of 1, 2, 3 and 4 sequences; colocated calls of 0.1 ms, gRPC ones of 4 ms; one failover."""
    batch = counts(t, tm.ROUTER_BATCH_SIZE)
    for size in (1, 2, 3, 4):
        batch.record(size)
    dispatch = seconds(t, tm.DISPATCH_DURATION)
    for _ in range(10):
        dispatch.record(0.0001, {"moe.transport": "colocated", "moe.layer": 1})
        dispatch.record(0.004, {"moe.transport": "grpc", "moe.layer": 2})
    tokens = t.meter.create_counter(tm.TOKENS_ROUTED)
    for (layer, expert), n in routed.items():
        tokens.add(n, {"moe.layer": layer, "moe.expert": expert})
    t.meter.create_observable_counter(tm.FAILOVERS, callbacks=[lambda _: [Observation(1)]])
    t.meter.create_up_down_counter(tm.ROUTER_QUEUE_DEPTH).add(5)


def expert(t: Telemetry) -> None:
    compute = seconds(t, tm.EXPERT_COMPUTE_DURATION)
    for _ in range(8):
        compute.record(0.002)
    counts(t, tm.EXPERT_BATCH_TOKENS).record(16)


@pytest.fixture(scope="module")
def mesh() -> Iterator[dict[str, list[str]]]:
    """Metrics endpoints of a gateway, two routers and an expert service, as `moe-mesh up` would name them."""
    services = [
        Telemetry.create(name, metrics_port=0) for name in ("gateway", "router", "router", "expert")
    ]
    gateway(services[0])
    router(services[1], ROUTED[0])
    router(services[2], ROUTED[1])
    expert(services[3])
    try:
        yield {
            "gateway": services[0].metrics_address,
            "routers": [s.metrics_address for s in services[1:3]],
            "experts": [services[3].metrics_address],
        }
    finally:
        for s in services:
            s.shutdown()


def stats(*argv) -> int:
    parser = argparse.ArgumentParser()
    stats_view.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["stats", *map(str, argv)])
    return args.func(args)


def test_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.1, 0.0), (0.25, 60.0), (1.0, 100.0), (math.inf, 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.15 * 50 / 60)
    assert quantile(buckets, 0.9) == pytest.approx(0.25 + 0.75 * 30 / 40)
    assert quantile(buckets, 0.0) == 0.1  # the lower end of the lowest non-empty bucket
    assert quantile([(0.5, 10.0), (math.inf, 10.0)], 0.5) == 0.25  # the first bucket starts at 0
    assert (
        quantile([(0.5, 1.0), (1.0, 1.0), (math.inf, 4.0)], 0.9) == 1.0
    )  # beyond the last bound: that bound
    assert quantile([(0.5, 0.0), (math.inf, 0.0)], 0.5) is None
    assert quantile([(0.5, 3.0)], 0.5) is None  # no +Inf bucket: not a whole histogram
    with pytest.raises(ValueError):
        quantile(buckets, 1.5)


def test_percentiles_are_exact_where_the_buckets_pin_them_and_bounds_elsewhere() -> None:
    seconds = [(0.1, 0.0), (0.25, 1.0), (math.inf, 1.0)]
    # One 201 ms request: exactly 201 ms (interpolating said p50 175, p90 235).
    assert percentile(seconds, 1, 0.201, 0.5) == (0.201, "=")
    assert percentile(seconds, 1, 0.201, 0.99) == (0.201, "=")
    # Every batch had 1 sequence: 1, not 0.5; also as seconds, all at the bucket's upper bound.
    batches = [(1.0, 7.0), (2.0, 7.0), (math.inf, 7.0)]
    assert percentile(batches, 7, 7.0, 0.5, integer=True) == (1.0, "=")
    assert percentile(batches, 7, 7.0, 0.5) == (1.0, "=")
    spread = [(0.1, 2.0), (0.25, 5.0), (1.0, 5.0), (math.inf, 6.0)]
    assert percentile(spread, 6, 3.0, 0.5) == (0.25, "≤")
    assert percentile(spread, 6, 3.0, 0.99) == (1.0, ">")  # past the last finite bound
    assert percentile(spread, 0, 0.0, 0.5) == (None, "=")


def test_gateway_percentiles_requests_and_errors_from_the_real_exposition(mesh) -> None:
    families = scrape(mesh["gateway"])
    assert infer_role(families) == "gateway"
    s = summarize({mesh["gateway"]: families})["services"][0]
    assert (s["role"], s["address"], s["requests"]) == ("gateway", mesh["gateway"], 100)
    assert s["errors"] == {"INVALID_ARGUMENT": 2, "RESOURCE_EXHAUSTED": 1}
    assert s["queue_depth"] == {tm.GATEWAY_QUEUE_DEPTH: 3} and "failovers" not in s
    duration, ttft = s["latency"]
    assert (
        duration["metric"] == tm.REQUEST_DURATION
        and duration["unit"] == "s"
        and duration["count"] == 100
    )
    assert duration["mean"] == pytest.approx((40 * 0.003 + 60 * 0.2) / 100)
    # 40 in (2.5 ms, 5 ms], 60 in (100 ms, 250 ms]: the 50th, 90th and 99th observations are in the
    # upper bucket, and that is all a histogram knows of them: at most 250 ms.
    for p in ("p50", "p90", "p99"):
        assert (duration[p], duration[f"{p}_known"]) == (0.25, "≤")
    assert ttft["metric"] == tm.TIME_TO_FIRST_TOKEN
    # 0.01 ... 1.00 s: the 50th is in (0.25, 0.5], the 90th and 99th in (0.75, 1].
    assert [(ttft[p], ttft[f"{p}_known"]) for p in ("p50", "p90", "p99")] == [
        (0.5, "≤"),
        (1.0, "≤"),
        (1.0, "≤"),
    ]
    assert s["batch"] == []


def test_routers_batches_transports_and_the_summed_heatmap(mesh) -> None:
    summary = summarize({a: scrape(a) for a in mesh["routers"]})
    first = summary["services"][0]
    assert first["role"] == "router" and first["requests"] is None and first["errors"] == {}
    assert first["failovers"] == 1 and first["queue_depth"] == {tm.ROUTER_QUEUE_DEPTH: 5}
    [batch] = first["batch"]
    assert (batch["metric"], batch["unit"], batch["count"], batch["mean"]) == (
        tm.ROUTER_BATCH_SIZE,
        "",
        4,
        2.5,
    )
    assert batch["p50"] == 2.0  # 2 of 4 batches <= 2
    colocated, grpc = first["latency"]
    assert colocated["labels"] == {"moe_transport": "colocated"} and grpc["labels"] == {
        "moe_transport": "grpc"
    }
    assert colocated["count"] == grpc["count"] == 10
    assert colocated["p50"] <= 0.0005 < 0.0025 < grpc["p50"] <= 0.005
    u = summary["utilization"]
    assert (u["layers"], u["num_experts"]) == ([1, 2], EXPERTS)
    assert u["tokens_routed"] == [[40, 10, 20, 0], [3, 0, 0, 20]]
    assert u["shares"] == [[57, 14, 29, 0], [13, 0, 0, 87]] and all(
        sum(r) == 100 for r in u["shares"]
    )


def test_render_shows_every_service_and_the_heatmap(mesh) -> None:
    text = render(
        collect([(None, a) for a in [mesh["gateway"], *mesh["routers"], *mesh["experts"]]])
    )
    blocks = text.split("\n\n")
    assert blocks[0].splitlines()[0] == (
        f"gateway {mesh['gateway']}  requests 100  errors INVALID_ARGUMENT 2, "
        "RESOURCE_EXHAUSTED 1  gateway queue 3"
    )
    assert blocks[0].splitlines()[1].split() == ["count", "p50", "p90", "p99", "mean"]
    assert blocks[0].splitlines()[2].split() == [
        tm.REQUEST_DURATION,
        "(ms)",
        "100",
        "≤250.00",
        "≤250.00",
        "≤250.00",
        "121.20",
    ]
    assert (
        blocks[1].splitlines()[0]
        == f"router {mesh['routers'][0]}  errors none  failovers 1  router queue 5"
    )
    assert f"  {tm.DISPATCH_DURATION} [grpc] (ms)" in blocks[1]
    assert blocks[1].splitlines()[-1].split() == [
        tm.ROUTER_BATCH_SIZE,
        "4",
        "2.0",  # exact: the bucket (1, 2] holds one integer
        "≤4.0",  # 3 and 4 share the bucket (2, 4]
        "≤4.0",
        "2.5",
    ]
    assert blocks[3].startswith(f"expert {mesh['experts'][0]}  errors none\n")
    heatmap = blocks[-2:]
    assert heatmap[0].startswith("tokens routed per (layer, expert), summed over routers")
    assert heatmap[1].splitlines() == [
        "layer   0    1    2    3    tokens",
        "    1  57   14   29    0        70",
        "    2  13    0    0   87        23",
    ]


def test_ready_file_json_and_png(mesh, tmp_path, capsys, closed_port) -> None:
    ready = tmp_path / "mesh.json"
    down = f"127.0.0.1:{closed_port}"
    ready.write_text(
        json.dumps(
            {
                "gateway_grpc": "127.0.0.1:1",
                "routers": ["127.0.0.1:2"],
                "metrics": mesh | {"experts": [*mesh["experts"], down]},
            }
        )
    )
    assert stats("--ready-file", ready, "--json", "--png", tmp_path / "heat.png") == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert set(summary) == {"services", "utilization", "unreachable"}
    assert [s["role"] for s in summary["services"]] == ["gateway", "router", "router", "expert"]
    # Named as `moe-mesh status` names them, by gRPC address, with the metrics endpoint beside it.
    assert [s["address"] for s in summary["services"][:2]] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert summary["services"][2]["address"] == summary["services"][2]["metrics"]  # no name given
    assert set(summary["services"][1]) == {
        "role",
        "address",
        "metrics",
        "requests",
        "latency",
        "batch",
        "errors",
        "failovers",
        "queue_depth",
    }
    assert set(summary["services"][0]["latency"][0]) == {
        "metric",
        "unit",
        "count",
        "mean",
        "p50",
        "p90",
        "p99",
        "p50_known",
        "p90_known",
        "p99_known",
    }
    assert summary["utilization"]["tokens_routed"] == [[40, 10, 20, 0], [3, 0, 0, 20]]
    assert [u["address"] for u in summary["unreachable"]] == [down]
    assert (
        f"warning: metrics endpoint {down}: " in err
        and "skipped" in err
        and f"wrote {tmp_path / 'heat.png'}" in err
    )
    assert (tmp_path / "heat.png").read_bytes().startswith(PNG)


def test_role_without_target_info_comes_from_the_metrics(mesh) -> None:
    for address, role in [
        (mesh["gateway"], "gateway"),
        (mesh["routers"][0], "router"),
        (mesh["experts"][0], "expert"),
    ]:
        families = scrape(address)
        assert infer_role(families) == role
        assert infer_role([f for f in families if f.name != "target_info"]) == role


def test_unreachable_endpoints(mesh, tmp_path, capsys, closed_port) -> None:
    down = f"127.0.0.1:{closed_port}"
    with pytest.raises(UnavailableError, match=f"{down}: .*refused"):
        scrape(down)
    assert stats("--metrics", down, "--metrics", mesh["experts"][0]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"expert {mesh['experts'][0]}") and out.rstrip().endswith(
        "no tokens routed yet"
    )
    assert err.count("warning: metrics endpoint") == 1
    assert stats("--metrics", down) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(f"moe-mesh stats: error: no metrics endpoint answered: {down}: ")
    )
    assert (
        stats("--metrics", mesh["experts"][0], "--png", tmp_path / "none.png") == 2
    )  # nothing routed to draw
    assert "nothing to draw" in capsys.readouterr().err
    assert stats("--ready-file", tmp_path / "nope.json") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "old.json").write_text(json.dumps({"routers": []}))
    assert stats("--ready-file", tmp_path / "old.json") == 2
    assert "is not a ready file of `moe-mesh up` (no metrics)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stats("--metrics", "no-port")
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_registered_on_the_moe_mesh_cli(mesh, capsys) -> None:
    from moe_mesh.cli import build_parser

    args = build_parser().parse_args(["stats", "--metrics", mesh["routers"][1], "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["utilization"]["tokens_routed"] == [
        [10, 0, 20, 0],
        [3, 0, 0, 13],
    ]
