"""The rendered autoscalers read metrics the services really export (issue 43 item 2).

A live `moe-mesh up` serves a few requests; every series the rendered Prometheus Adapter rules and
Nomad checks name (token_rows on one group, busy on the other) is then in the expert services' or
the gateway's /metrics and non-zero. Where Debian's `prometheus` is installed, a real Prometheus
scraping the mesh also evaluates the rendered Nomad queries to a load per replica above zero.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import hcl2
import httpx
import pytest
import yaml
from hcl2.utils import SerializationOptions

from moe_mesh.autoscale import queries
from moe_mesh.autoscale.signals import PrometheusSignals
from moe_mesh.local.processes import running_up
from moe_mesh.planning import deploy
from moe_mesh.planning.deploy.prometheus import static_job
from tests.support import prometheus
from tests.support.metrics import scrape, total
from tests.support.plans import example_raw, plan_of

SYNTHETIC = {"up"}  # Prometheus' own series per target, not a service's


def _plan(tmp_path: Path) -> deploy.Plan:
    """The example plan (hot: token_rows, with the TPOT guard) with its cold group on busy time."""
    raw = example_raw()
    raw["expert_groups"][1].update(autoscale={"min_replicas": 1, "max_replicas": 3})
    return plan_of(raw, tmp_path)


def _rendered_queries(plan: deploy.Plan) -> list[str]:
    """Every adapter rule's series query and every Nomad check's query, as rendered."""
    k8s = yaml.safe_load_all(deploy.render(plan, "kubernetes")["prometheus-adapter.yaml"])
    [adapter] = list(k8s)
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    found = [r["seriesQuery"] for r in rules]
    options = SerializationOptions(
        explicit_blocks=False, strip_string_quotes=True, with_comments=False
    )
    for name, text in deploy.render(plan, "nomad").items():
        if name.startswith(f"{plan.name}-experts-"):
            [job] = hcl2.loads(text, serialization_options=options)["job"]
            [group] = next(iter(job.values()))["group"]
            [scaling] = group["experts"]["scaling"]
            for check in scaling["policy"][0]["check"]:
                found += [body["query"] for body in check.values()]
    assert len(found) == 2 + 2 * len(plan.expert_groups), found
    return found


@pytest.fixture(scope="module")
def mesh(checkpoint, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("autoscale-mesh")
    # `up --autoscale` too, with bounds that allow no change: its loop runs, logs and exports.
    policy = "--min-replicas 1 --max-replicas 1 --interval-s 1"
    flags = [
        "--expert-services",
        "2",
        "--replicas",
        "1",
        "--autoscale",
        f"--autoscale-arg={policy}",
    ]
    with running_up(
        checkpoint("mixtral"), flags, ready_file=tmp / "mesh.json", run_dir=tmp / "run",
        log_path=tmp / "up.log", ready_timeout_s=120, stop_timeout_s=30,
    ) as running:  # fmt: skip
        yield running.info


def _requests(info: dict, n: int = 3) -> None:
    with httpx.Client(base_url=f"http://{info['gateway_http']}", timeout=30) as h:
        for i in range(n):
            body = {"prompt": [1, 2, 3 + i], "max_tokens": 8, "ignore_eos": True}
            assert h.post("/v1/completions", json=body).status_code == 200


def test_every_series_the_rendered_autoscalers_read_is_exported(mesh, tmp_path) -> None:
    began = time.monotonic()
    used = set().union(*map(queries.series_in, _rendered_queries(_plan(tmp_path))))
    assert {"moe_expert_batch_tokens_sum", "moe_expert_compute_duration_seconds_sum"} <= used
    _requests(mesh)
    experts = [scrape(address) for address in mesh["metrics"]["experts"]]
    gateway = scrape(mesh["metrics"]["gateway"])
    assert len(experts) == 2
    for name in sorted(used - SYNTHETIC):
        owners = experts if name.startswith("moe_expert_") else [gateway]
        for samples in owners:  # every replica exports it, and it counted the requests
            assert any(k.split("{")[0] == name for k in samples), (name, sorted(samples)[:20])
            assert total(samples, name) > 0, name
    assert time.monotonic() - began < 30


@pytest.mark.skipif(prometheus.PROMETHEUS is None, reason=prometheus.MISSING)
def test_prometheus_evaluates_the_rendered_queries_over_the_mesh(mesh, tmp_path) -> None:
    """The Nomad checks' load per replica, as Prometheus computes it from the mesh's counters:
    both expert services scraped as the group `experts-hot`, the gateway as `gateway`."""
    plan = _plan(tmp_path)
    jobs = [
        static_job("experts-hot", list(mesh["metrics"]["experts"])),
        static_job("gateway", [mesh["metrics"]["gateway"]]),
    ]
    with prometheus.running(jobs, tmp_path) as base:
        _requests(mesh, 1)  # every counter exists (a histogram appears at its first sample) ...
        prometheus.until("every target up", lambda: prometheus.promql(base, "sum(up)") == 3)
        time.sleep(1.5)  # ... and has been scraped before the requests the rates must see
        _requests(mesh)
        for metric in ("token_rows", "busy"):
            load = queries.per_replica(metric, "experts-hot")
            assert (
                prometheus.until(f"{metric} per replica", lambda q=load: prometheus.promql(base, q))
                > 0
            )
        # `moe-mesh autoscale --compose-file` reads the same loads through the same queries.
        signals = PrometheusSignals(base, 60, {"hot": "experts-hot"}, gateway_job="gateway")
        seen = signals.read({"hot": "token_rows"})["hot"]
        assert seen.replicas == 2 and seen.load is not None and seen.load > 0
        # The gateway is a target of its own, scraped at its own moments: wait for its increase.
        assert prometheus.until("the gateway's TPOT p99", signals.tpot_p99_ms) > 0
        hot = plan.expert_groups[0].autoscale
        assert hot is not None
        # The scale-down check with its TPOT guard evaluates: to the window's largest load per
        # replica (its 15 s steps may all predate the requests: 0) or to the target.
        down = queries.scale_down_query(hot, "experts-hot", "gateway")
        value = prometheus.promql(base, down)
        assert value is not None and 0 <= value <= hot.level


def test_up_autoscale_logs_and_exports_every_decision(mesh) -> None:
    """The loop `up --autoscale` runs: named in the ready file, a JSON line per group and interval,
    and its metrics."""
    groups = {e["experts"] for e in mesh["experts"]}
    log = Path(mesh["autoscaler"]["log"])
    entries: list[dict] = []

    def both_decided() -> bool:
        entries[:] = [json.loads(line) for line in log.read_text().splitlines()]
        return {e.get("group") for e in entries} == groups

    prometheus.until("a decision for each group", both_decided, timeout_s=20)
    assert {e["action"] for e in entries} == {"hold"} and all("error" not in e for e in entries)
    seen = scrape(mesh["autoscaler"]["metrics"])
    for group in groups:
        assert total(seen, "moe_autoscaler_replicas", moe_group=group) == 1
        assert (
            total(seen, "moe_autoscaler_decisions_total", moe_group=group, moe_action="hold") >= 1
        )
