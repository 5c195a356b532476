"""Loads from the services' counters: rates over a window, restarts, replicas seen once left out
of the average, and the gateway's p99 TPOT, scraped from real Prometheus endpoints."""

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from common.errors import UnavailableError
from moe_mesh.autoscale.signals import LocalSignals, _Rates


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def endpoints():
    """Prometheus endpoints serving what an expert service and a gateway export."""
    servers, made = [], {}

    def serve(name: str, metric: str, buckets=Histogram.DEFAULT_BUCKETS) -> Histogram:
        registry = CollectorRegistry()
        h = Histogram(metric, "test", registry=registry, buckets=buckets)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append(server)
        made[name] = f"127.0.0.1:{server.server_port}"
        return h

    yield serve, made
    for s in servers:
        s.shutdown()
        s.server_close()


def test_rates_over_the_window():
    rates = _Rates(window_s=10)
    assert rates.add("a", 0, 0) is None  # one sample: no rate yet
    assert rates.add("a", 5, 50) == 10
    assert rates.add("a", 10, 150) == 15
    assert rates.add("a", 20, 250) == 10  # (250 - 150) / 10: t=0 and t=5 left the window
    assert rates.add("a", 22, 3) is None  # the counter went back: a restarted process


def test_local_loads_per_group_and_tpot(endpoints):
    serve, at = endpoints
    a = serve("a", "moe_expert_batch_tokens")
    b = serve("b", "moe_expert_batch_tokens")
    c = serve("c", "moe_expert_batch_tokens")
    tpot = serve("gw", "gen_ai_server_time_per_output_token_seconds", (0.01, 0.05, 0.1, 1.0))
    mesh = {
        "experts": [
            {"address": "x:1", "experts": "0-1:0-3"},
            {"address": "x:2", "experts": "0-1:0-3"},
            {"address": "x:3", "experts": "0-1:4-7"},
        ],
        "metrics": {"experts": [at["a"], at["b"], at["c"]], "gateway": at["gw"]},
    }
    clock = Clock()
    signals = LocalSignals(lambda: mesh, window_s=10, clock=clock)
    first = signals.read({"0-1:0-3": "token_rows", "0-1:4-7": "token_rows"})
    assert {g: (x.replicas, x.load) for g, x in first.items()} == {
        "0-1:0-3": (2, None),
        "0-1:4-7": (1, None),
    }
    a.observe(300)
    b.observe(100)
    c.observe(50)
    for _ in range(98):
        tpot.observe(0.04)
    tpot.observe(0.5)
    tpot.observe(0.5)
    clock.now = 10
    loads = signals.read({"0-1:0-3": "token_rows", "0-1:4-7": "token_rows"})
    assert loads["0-1:0-3"].load == pytest.approx(20)  # (30 + 10) / 2 rows/s per replica
    assert loads["0-1:4-7"].load == pytest.approx(5)
    # histogram_quantile(0.99): rank 99 of 100 is halfway into (0.1, 1.0], where the last 2 are
    assert signals.tpot_p99_ms() == pytest.approx(550)


def test_a_new_replica_is_left_out_until_it_has_a_rate(endpoints):
    serve, at = endpoints
    a = serve("a", "moe_expert_batch_tokens")
    serve("b", "moe_expert_batch_tokens")
    mesh = {"experts": [{"address": "x:1", "experts": "g"}], "metrics": {"experts": [at["a"]]}}
    clock = Clock()
    signals = LocalSignals(lambda: mesh, window_s=10, clock=clock)
    signals.read({"g": "token_rows"})
    a.observe(100)
    clock.now = 10
    mesh["experts"].append({"address": "x:2", "experts": "g"})
    mesh["metrics"]["experts"].append(at["b"])
    load = signals.read({"g": "token_rows"})["g"]
    assert (load.replicas, load.load) == (2, pytest.approx(10))  # not 5: b has no rate yet


def test_an_unreachable_replica_counts_but_is_not_measured(endpoints):
    serve, at = endpoints
    serve("a", "moe_expert_batch_tokens")
    mesh = {
        "experts": [{"address": "x:1", "experts": "g"}, {"address": "x:2", "experts": "g"}],
        "metrics": {"experts": [at["a"], "127.0.0.1:1"]},
    }
    load = LocalSignals(lambda: mesh, window_s=10).read({"g": "busy"})["g"]
    assert (load.replicas, load.load) == (2, None)  # a's one sample has no rate yet


def test_a_mesh_that_answers_nowhere_is_unavailable():
    """A stale ready file: say so at every tick rather than 'no measurement yet' forever."""
    mesh = {
        "experts": [{"address": "x:1", "experts": "g"}],
        "metrics": {"experts": ["127.0.0.1:1"]},
    }
    with pytest.raises(UnavailableError, match="no expert service of the mesh answers"):
        LocalSignals(lambda: mesh, window_s=10).read({"g": "busy"})
