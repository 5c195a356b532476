"""The nomad target's autoscaling: a `scaling` block per group with `autoscale` that python-hcl2
parses and that carries the policy (bounds, interval, cool-down, the two target-value checks and
their queries), the Nomad Autoscaler's agent configuration, and none of it without `autoscale`."""

from __future__ import annotations

from pathlib import Path

import hcl2
from hcl2.utils import SerializationOptions

from moe_mesh.autoscale.policy import SERIES
from moe_mesh.planning import deploy
from tests.support.plans import EXAMPLE_PLAN, busy_plan, example_raw, plan_of, static_plan

HCL_OPTIONS = SerializationOptions(
    explicit_blocks=False, strip_string_quotes=True, with_comments=False
)


def nomad_groups(plan: deploy.Plan) -> dict[str, dict]:
    """Expert group name -> its Nomad task group, parsed by python-hcl2."""
    out = {}
    for name, text in deploy.render(plan, "nomad").items():
        prefix = f"{plan.name}-experts-"
        if name.startswith(prefix):
            [job] = hcl2.loads(text, serialization_options=HCL_OPTIONS)["job"]
            [(_, body)] = job.items()
            out[name.removeprefix(prefix).removesuffix(".nomad.hcl")] = body["group"][0]["experts"]
    return out


def test_nomad_scaling_block_parses_and_carries_the_policy(tmp_path: Path) -> None:
    plan = busy_plan(tmp_path)
    groups = nomad_groups(plan)
    for g in plan.expert_groups:
        a = g.autoscale
        assert a is not None
        group = groups[g.name]
        assert group["count"] == g.replicas  # the starting count
        [scaling] = group["scaling"]
        assert (scaling["enabled"], scaling["min"], scaling["max"]) == (
            True,
            a.min_replicas,
            a.max_replicas,
        )
        [policy] = scaling["policy"]
        assert policy["evaluation_interval"] == f"{a.interval_s:g}s"
        assert policy["cooldown"] == policy["cooldown_on_scale_up"] == f"{a.step_period_s:g}s"
        checks = {name: body for c in policy["check"] for name, body in c.items()}
        assert set(checks) == {f"{a.metric}_up", f"{a.metric}_down"}
        for check in checks.values():
            assert check["source"] == "prometheus" and check["group"] == a.metric
            assert f'{SERIES[a.metric]}{{job="experts-{g.name}"}}' in check["query"]
            [strategy] = check["strategy"]
            assert strategy["target-value"] == {"target": a.level, "threshold": a.tolerance}
    hot = {n: b for c in groups["hot"]["scaling"][0]["policy"][0]["check"] for n, b in c.items()}
    assert "[300s:15s]" in hot["token_rows_down"]["query"]  # the scale-down window
    assert "gen_ai_server_time_per_output_token" in hot["token_rows_down"]["query"]  # the guard
    cold = {n: b for c in groups["cold"]["scaling"][0]["policy"][0]["check"] for n, b in c.items()}
    assert "[30s:10s]" in cold["busy_up"]["query"] and "[120s:10s]" in cold["busy_down"]["query"]
    assert "gen_ai" not in cold["busy_down"]["query"]  # no TPOT SLO, no guard


def test_autoscaler_agent_config_parses(tmp_path: Path) -> None:
    raw = example_raw()
    raw["nomad"].update(nomad_addr="https://nomad.example:4646", prometheus_addr="http://prom:9090")
    text = deploy.render(plan_of(raw, tmp_path), "nomad")["nomad-autoscaler.hcl"]
    assert text.startswith("# Rendered by `moe-mesh deploy render")
    config = hcl2.loads(text, serialization_options=HCL_OPTIONS)
    assert config["nomad"] == [{"address": "https://nomad.example:4646"}]
    assert config["apm"] == [
        {"prometheus": {"driver": "prometheus", "config": {"address": "http://prom:9090"}}}
    ]
    assert config["strategy"] == [{"target-value": {"driver": "target-value"}}]


def test_a_plan_without_autoscale_renders_no_scaling_and_no_agent_config(tmp_path: Path) -> None:
    plan = static_plan(tmp_path)
    assert "nomad-autoscaler.hcl" not in deploy.render(plan, "nomad")
    groups = nomad_groups(plan)
    assert set(groups) == {"hot", "cold"}
    assert all("scaling" not in group for group in groups.values())


def test_a_render_without_autoscale_removes_the_autoscaler_config(tmp_path: Path) -> None:
    out = tmp_path / "nomad"
    deploy.write_rendered(deploy.render(deploy.load_plan(EXAMPLE_PLAN), "nomad"), out, "nomad")
    assert (out / "nomad-autoscaler.hcl").exists()
    files = deploy.render(static_plan(tmp_path), "nomad")
    assert deploy.drifted(files, out, "nomad") == [
        "moe-mesh-experts-hot.nomad.hcl",
        "nomad-autoscaler.hcl",
    ]
    deploy.write_rendered(files, out, "nomad")
    assert not (out / "nomad-autoscaler.hcl").exists()
    assert deploy.drifted(files, out, "nomad") == []
