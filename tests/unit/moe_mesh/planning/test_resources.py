"""What `moe-mesh plan` asks for (moe_mesh/planning/resources.py): groups sized by their own load and
bytes, a plan derived from the record without --base, a base of another model refused with the fix,
the total printed, and devices carried from the base (the router's, and each group's by name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moe_mesh.planning import deploy, resources
from moe_mesh.planning import plan as plan_cli
from moe_mesh.planning.eplb import GroupProposal
from moe_mesh.planning.search import group_cpu_mhz
from moe_mesh.planning.simulate import Node
from tests.support.plans import EXAMPLE_PLAN, MIB, search_args, skewed, write_record


def group(name: str, share: float, replicas: int = 1) -> GroupProposal:
    return GroupProposal(name, ((0, 0),), replicas, share)


def test_cpu_follows_the_load_each_replica_computes() -> None:
    groups = [group("hot", 0.5, replicas=2), group("warm", 0.3), group("cold", 0.2)]
    # 10 cores: hot's 5 over two replicas, warm 3, cold 2.
    assert resources.split_cpu(10_000, groups) == [2500, 3000, 2000]
    assert resources.split_cpu(300, [group("a", 0.0), group("b", 0.0)]) == [200, 200]  # rounded
    assert resources.split_cpu(100, [group("a", 1.0), group("b", 0.0)]) == [100, 100]  # the floor


def test_plan_without_base_derives_the_model_from_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    record = write_record(tmp_path, skewed(), model_id="ckpt")
    out = tmp_path / "plan.yaml"
    assert plan_cli.main(["plan", "--utilization", str(record), "--out", str(out)]) == 0
    plan = deploy.load_plan(out)
    assert plan.model.model_id == "ckpt" and plan.model.checkpoint == "/models/ckpt"
    assert (plan.model.num_layers, plan.model.num_experts, plan.model.moe_layers) == (2, 8, [0, 1])
    # One core per expert-service replica in all, shared out by load; memory by the bytes held.
    replicas = sum(g.replicas for g in plan.expert_groups)
    asked = sum(g.resources.cpu_mhz * g.replicas for g in plan.expert_groups)
    assert abs(asked - 1000 * replicas) <= 50 * len(plan.expert_groups)
    for g in plan.expert_groups:
        assert g.resources.memory_mb == len(deploy.expert_pairs(g.experts)) * MIB // 2**20 + 512
        assert g.compute_threads == max(1, g.resources.cpu_mhz // 1000)
    total = resources.total(plan)
    err = capsys.readouterr().err
    assert f"the plan asks for {total.cores:g} cores and {total.memory_mb / 1024:.1f} GiB" in err
    assert total.cores == pytest.approx(asked / 1000 + 2 + 0.5)  # the router's and gateway's too


def test_groups_do_not_copy_the_first_groups_size(tmp_path: Path) -> None:
    """The issue: every group was given the base's first group's 4 cores (10 -> 24 cores)."""
    base = yaml.safe_load(EXAMPLE_PLAN.read_text())
    base["model"]["model_id"] = "ckpt"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    record = write_record(tmp_path, skewed(), model_id="ckpt")
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--utilization", str(record), "--base", str(tmp_path / "base.yaml")]
    assert plan_cli.main([*argv, "--out", str(out)]) == 0
    plan = deploy.load_plan(out)
    cpus = {g.name: g.resources.cpu_mhz for g in plan.expert_groups}
    assert len(set(cpus.values())) > 1, cpus  # each its own
    asked = sum(g.resources.cpu_mhz * g.replicas for g in plan.expert_groups)
    assert abs(asked - (2 * 4000 + 2000)) <= 50 * len(cpus)  # the base's 10 cores, not 24
    assert all(g.autoscale for g in plan.expert_groups)  # how the first group runs is kept
    assert all(
        g.autoscale.min_replicas <= g.replicas <= g.autoscale.max_replicas
        for g in plan.expert_groups
        if g.autoscale
    )


def test_a_base_of_another_model_says_how_to_fix_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    record = write_record(tmp_path, skewed(), model_id="ckpt")
    argv = ["plan", "--utilization", str(record), "--base", str(EXAMPLE_PLAN)]
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"{EXAMPLE_PLAN}: model.model_id: 'mixtral-small', but the record {record} is of 'ckpt'"
        in err
    )
    assert "set model.model_id (and model.checkpoint)" in err and "leave out --base" in err


def test_search_sizes_groups_by_their_predicted_share(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, prediction = tmp_path / "plan.yaml", tmp_path / "prediction.json"
    argv = search_args(tmp_path, "--out", str(out), "--prediction-out", str(prediction))
    argv.remove("--base")
    argv.remove(str(EXAMPLE_PLAN))
    assert plan_cli.main(argv) == 0  # without --base: the model from the record
    plan = deploy.load_plan(out)
    assert plan.model.model_id == "mixtral-small"
    err = capsys.readouterr().err
    assert "the plan asks for " in err and " node(s): small x" in err
    predicted = json.loads(prediction.read_text())
    shares = {g["name"]: g["load_share"] for g in predicted["plan"]["expert_groups"]}
    cpus = {g.name: g.resources.cpu_mhz for g in plan.expert_groups}
    if len(set(shares.values())) > 1:  # a hotter group never gets less
        ranked = sorted(shares, key=shares.get)
        assert [cpus[n] for n in ranked] == sorted(cpus[n] for n in ranked)


def test_group_cpu_splits_a_node_by_share() -> None:
    class Best:  # the parts of a Candidate group_cpu_mhz reads
        groups = (group("a", 0.6), group("b", 0.3), group("c", 0.1))
        replicas = 1
        nodes = (Node("n", 2, True, ()), Node("n", 4, False, (0, 1, 2)))

    assert group_cpu_mhz(Best()) == [2400, 1200, 400]  # type: ignore[arg-type]
    Best.nodes = (Node("n", 3, True, (0, 1, 2)),)  # the router keeps its equal share: 750 MHz
    assert group_cpu_mhz(Best()) == [1300, 600, 200]  # type: ignore[arg-type]


def test_search_without_a_record_takes_the_profiles_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = search_args(tmp_path, "--out", str(tmp_path / "plan.yaml"))
    at = argv.index("--utilization")
    del argv[at : at + 2]
    argv.remove("--base")
    argv.remove(str(EXAMPLE_PLAN))
    assert plan_cli.main(argv) == 0
    plan = deploy.load_plan(tmp_path / "plan.yaml")
    assert plan.model.model_id == "mixtral-small" and plan.model.num_layers == 2
    assert "from " in (tmp_path / "plan.yaml").read_text().splitlines()[0]
    # EPLB has nothing to balance without a record.
    capsys.readouterr()
    assert plan_cli.main(["plan", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "--utilization is required" in capsys.readouterr().err


def _base_on_gpus(tmp_path: Path, model_id: str = "mixtral-small") -> Path:
    base = yaml.safe_load(EXAMPLE_PLAN.read_text())
    base["model"]["model_id"] = model_id
    base["router"]["device"] = "cuda:1"
    base["expert_groups"][0]["device"] = "cuda"  # cold stays on the CPU
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def test_a_derived_plan_keeps_the_base_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    record = write_record(tmp_path, skewed(), model_id="ckpt")
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--utilization", str(record), "--out", str(out)]
    assert plan_cli.main([*argv, "--base", str(_base_on_gpus(tmp_path, "ckpt"))]) == 0
    plan = deploy.load_plan(out)
    assert plan.router.device == "cuda:1"
    # New group names: each runs where the base's first group ran, like its region and args.
    assert {g.device for g in plan.expert_groups} == {"cuda"}
    gpus = plan.router.replicas + sum(g.replicas for g in plan.expert_groups)
    assert resources.total(plan).gpus == gpus
    assert f" cores, {gpus} GPUs and " in capsys.readouterr().err
    # Planned again from that plan: a group of the same name keeps its own device.
    raw = yaml.safe_load(out.read_text())
    raw["expert_groups"][-1]["device"] = "cpu"
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(raw))
    assert plan_cli.main([*argv, "--base", str(tmp_path / "again.yaml")]) == 0
    again = deploy.load_plan(out)
    assert [g.name for g in again.expert_groups] == [g.name for g in plan.expert_groups]
    assert [g.device for g in again.expert_groups][-1] == "cpu"
    assert {g.device for g in again.expert_groups[:-1]} == {"cuda"}


def test_search_keeps_the_base_devices(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    argv = search_args(tmp_path, "--out", str(out))
    argv[argv.index(str(EXAMPLE_PLAN))] = str(_base_on_gpus(tmp_path))
    assert plan_cli.main(argv) == 0
    plan = deploy.load_plan(out)
    assert plan.router.device == "cuda:1"
    assert {g.device for g in plan.expert_groups} == {"cuda"}
    assert "nvidia.com/gpu" in deploy.render(plan, "kubernetes")["router.yaml"]


def test_a_cpu_plan_totals_no_gpus() -> None:
    total = resources.total(deploy.load_plan(EXAMPLE_PLAN))
    assert total.gpus == 0 and "GPU" not in total.text()
