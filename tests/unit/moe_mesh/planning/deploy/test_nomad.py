"""The nomad target's autoscaling: a `scaling` block per group with `autoscale` that python-hcl2
parses and that carries the policy (bounds, interval, cool-down, the two target-value checks and
their queries), the Nomad Autoscaler's agent configuration, and none of it without `autoscale`.
Its devices: a task on CUDA asks for one `nvidia/gpu` device and runs with `--device cuda`; a task
on the CPU asks for none (and runs with `--device cpu` where the plan uses GPUs)."""

from __future__ import annotations

from pathlib import Path

import hcl2
from hcl2.utils import SerializationOptions

from moe_mesh.autoscale.policy import SERIES
from moe_mesh.planning import deploy
from tests.support.plans import (
    EXAMPLE_PLAN,
    busy_plan,
    example_raw,
    gpu_raw,
    plan_of,
    static_plan,
)

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


def nomad_tasks(plan: deploy.Plan) -> dict[str, dict]:
    """Task name (serve-expert of group G as G) -> its body, from every job, parsed by python-hcl2."""
    out = {}
    for name, text in deploy.render(plan, "nomad").items():
        if not name.endswith(".nomad.hcl"):
            continue
        [job] = hcl2.loads(text, serialization_options=HCL_OPTIONS)["job"]
        [(_, body)] = job.items()
        for group in body["group"]:
            [(_, group_body)] = group.items()
            [task] = group_body["task"]
            [(task_name, task_body)] = task.items()
            group_name = name.removeprefix(f"{plan.name}-experts-").removesuffix(".nomad.hcl")
            out[group_name if task_name == "serve-expert" else task_name] = task_body
    return out


def _device_flag(task: dict) -> list[str]:
    args = task["config"][0]["args"]
    return [args[i + 1] for i, word in enumerate(args) if word == "--device"]


def test_cuda_tasks_ask_for_an_nvidia_gpu_and_cpu_tasks_do_not(tmp_path: Path) -> None:
    plan = plan_of(gpu_raw(), tmp_path)
    tasks = nomad_tasks(plan)
    assert set(tasks) == {"hot", "cold", "serve-router", "serve-gateway"}
    for name in ("hot", "serve-router"):  # cuda and cuda:1: Nomad picks the GPU either way
        [resources] = tasks[name]["resources"]
        assert resources["device"] == [{"nvidia/gpu": {"count": 1}}]
        assert _device_flag(tasks[name]) == ["cuda"]  # the task's only GPU, its device 0
    assert tasks["hot"]["resources"][0]["cpu"] == plan.expert_groups[0].resources.cpu_mhz
    for name in ("cold", "serve-gateway"):
        [resources] = tasks[name]["resources"]
        assert "device" not in resources
    assert _device_flag(tasks["cold"]) == ["cpu"] and _device_flag(tasks["serve-gateway"]) == []


def test_a_cpu_plan_asks_for_no_device() -> None:
    tasks = nomad_tasks(deploy.load_plan(EXAMPLE_PLAN))
    assert len(tasks) == 4
    assert all("device" not in t["resources"][0] and not _device_flag(t) for t in tasks.values())
