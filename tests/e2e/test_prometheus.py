"""A real Prometheus server scrapes a running mesh: PromQL answers equal the router's and the
gateway's own counters. Skipped where Debian's `prometheus` is not installed (.ci/run installs it
when it runs as root)."""

from __future__ import annotations

import httpx
import pytest

from moe_mesh.planning.deploy.prometheus import static_job
from tests.support.meshes import local_mesh
from tests.support.metrics import scrape
from tests.support.prometheus import MISSING, PROMETHEUS, promql, running, until

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)


async def test_promql_over_a_scraped_mesh_equals_the_services_own_counters(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    async with local_mesh(path, router={"metrics_port": 0}, metrics_port=0) as mesh:
        router = mesh.router.telemetry.metrics_address
        gateway = mesh.gateway.telemetry.metrics_address
        jobs = [static_job("router", [router]), static_job("gateway", [gateway])]
        with running(jobs, tmp_path) as base:
            until("both targets up", lambda: promql(base, "sum(up)") == 2)
            async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
                for i in range(3):
                    body = {"prompt": [1, 2, 3 + i], "max_tokens": 4, "ignore_eos": True}
                    assert (await h.post("/v1/completions", json=body)).status_code == 200
            own = scrape(router)
            routed = sum(
                v for k, v in own.items() if k.startswith("moe_router_tokens_routed_total{")
            )
            assert routed > 0
            # Once a scrape has seen the last request, PromQL sums what the router counted.
            until(
                "Prometheus to see every routed token",
                lambda: promql(base, "sum(moe_router_tokens_routed_total)") == routed,
            )
            # The gateway is a target of its own, scraped at its own moments: wait for it too.
            until(
                "Prometheus to see the gateway's 3 requests",
                lambda: (
                    promql(base, 'sum(gen_ai_server_request_duration_seconds_count{job="gateway"})')
                    == 3
                ),
            )
            assert promql(base, "count(moe_router_tokens_routed_total)") == sum(
                1 for k in own if k.startswith("moe_router_tokens_routed_total{")
            )
