"""The Grafana dashboard (deploy/grafana/moe-mesh.json) loads as Grafana's dashboard model, and every
PromQL expression in it names metrics the services really export (scraped from a running mesh with a
remote expert service)."""

from __future__ import annotations

import json
import re
import urllib.request

import httpx
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families

from moe_mesh.local.processes import start_experts
from tests.support import REPO
from tests.support.meshes import local_mesh

DASHBOARD = REPO / "deploy" / "grafana" / "moe-mesh.json"
METRIC = re.compile(r"\b((?:moe|gen_ai)_[a-z0-9_]+)\b")


def survives(original, loaded, where: str = "") -> list[str]:
    """Paths of `original` that the model lost or changed (it may add its defaults)."""
    if isinstance(original, dict):
        if not isinstance(loaded, dict):
            return [where]
        return [
            p
            for k, v in original.items()
            for p in (survives(v, loaded[k], f"{where}/{k}") if k in loaded else [f"{where}/{k}"])
        ]
    if isinstance(original, list):
        if not isinstance(loaded, list) or len(loaded) != len(original):
            return [where]
        return [
            p
            for i, (a, b) in enumerate(zip(original, loaded))
            for p in survives(a, b, f"{where}[{i}]")
        ]
    return [] if original == loaded else [where]


def expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def test_the_dashboard_loads_as_grafanas_dashboard_model() -> None:
    board = json.loads(DASHBOARD.read_text())
    model = Dashboard.from_json(board)
    assert model.title == "moe-mesh" and len(model.panels) == len(board["panels"]) >= 10
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    assert survives(board, again) == []  # no field the model does not know, none retyped
    titles = " | ".join(p["title"] for p in board["panels"])
    for topic in (
        "first token",
        "per output token",
        "Queue",
        "batch",
        "transport",
        "layer, expert",
    ):
        assert topic.lower() in titles.lower(), topic


def exported(address: str) -> set[str]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


async def test_every_promql_expression_names_metrics_the_services_export(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    [expert] = start_experts(path, ["*:*"], tmp_path, "--metrics-port", "0")
    try:
        router = {"metrics_port": 0, "expert_endpoints": [expert.address], "kv_block_size": 4}
        async with local_mesh(path, router=router, metrics_port=0) as mesh:
            async with httpx.AsyncClient(base_url=mesh.http_base_url) as h:
                prompt = list(range(1, 30))
                for _ in range(2):  # the second one finds the first's blocks in the prefix cache
                    body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True}
                    assert (await h.post("/v1/completions", json=body)).status_code == 200
                bad = await h.post("/v1/completions", json={"prompt": [1], "max_tokens": 0})
                assert bad.status_code == 400  # counted in moe_errors_total
            names = set().union(
                *(
                    exported(a)
                    for a in (
                        mesh.router.telemetry.metrics_address,
                        mesh.gateway.telemetry.metrics_address,
                        expert.ready["metrics"],
                    )
                )
            )
    finally:
        expert.stop()
    for title, expr in expressions():
        # Label names (in `by (...)` and `{...}`) are not metrics.
        bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)|\{[^}]*\}", "", expr)
        used = set(METRIC.findall(bare))
        assert used, (title, expr)
        assert used <= names, (title, sorted(used - names))
