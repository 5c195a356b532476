"""`moe-mesh plan --search`: candidates ranked from profiled costs, the SLO, and the plan it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_mesh.planning import deploy
from moe_mesh.planning import plan as plan_cli
from moe_mesh.planning.inventory import Inventory
from moe_mesh.planning.profile_format import ProfileFile
from moe_mesh.planning.search import Limits, search
from moe_mesh.planning.simulate import Workload
from tests.support.plans import (
    EXAMPLE_PLAN,
    SMALL_NODE,
    fit,
    measured,
    profile_dict,
    search_args,
    write_profile,
)

MS = 1e-3
BIG = {"name": "big", "cores": 64, "memory": "64GiB", "cost_per_hour": 1.0, "available": 2}
SMALL = SMALL_NODE


def inventory(*kinds: dict) -> Inventory:
    return Inventory.model_validate({"kinds": list(kinds)})


def load(layers: int = 2, experts: int = 8) -> dict[tuple[int, int], float]:
    return {(la, e): 1.0 for la in range(layers) for e in range(experts)}


def test_known_costs_give_the_known_plan() -> None:
    """Ta = Te = 0.1 ms per sequence, no fixed cost, Tc = 0.5 ms one way, on big nodes.

    m = 1: Ta + Te + 2 Tc = 3.2 + 3.2 + 1 ms for B = 32. m = 2 halves the round and keeps each
    side busy 3.2 ms + its transfers (2 x 0.5): 4.2 ms. m = 3 adds one more transfer to each side.
    One group: more groups cost the router one transfer each."""
    raw = profile_dict(
        ta=measured(fit(0.1 * MS, 0.0), threads=2),
        te=measured(fit(0.1 * MS, 0.0)),
        transports={"grpc": {"fit": fit(0.0, 0.5 * MS)}},
    )
    found = search(ProfileFile.model_validate(raw), load(), inventory(BIG), Limits(32))
    best = found[0]
    assert (len(best.groups), best.replicas, best.batch, best.m) == (1, 1, 32, 2)
    assert best.step.seconds == pytest.approx(2 * 4.2 * MS)  # two MoE layers
    assert [n.router for n in best.nodes] == [True]  # one big node holds it all, at a cost of 1
    assert best.tokens_per_s == pytest.approx(32 / (8.4 * MS))
    assert all(a.per_cost >= b.per_cost for a, b in zip(found, found[1:]))


def test_fixed_costs_make_one_micro_batch_best() -> None:
    raw = profile_dict(
        ta=measured(fit(0.0, 2 * MS), threads=2),
        te=measured(fit(0.0, 2 * MS)),
        transports={"grpc": {"fit": fit(0.0, 0.0)}},
    )
    best = search(ProfileFile.model_validate(raw), load(), inventory(BIG), Limits(16))[0]
    assert (best.m, best.batch) == (1, 16)


def test_the_slo_filters_and_the_cheaper_node_wins_per_cost() -> None:
    profile = ProfileFile.model_validate(profile_dict())
    every = search(profile, load(), inventory(BIG, SMALL), Limits(32))
    slo = sorted(c.step.seconds for c in every)[len(every) // 2]
    within = search(profile, load(), inventory(BIG, SMALL), Limits(32, tpot_slo_s=slo))
    assert within and len(within) < len(every)
    assert all(c.step.seconds <= slo for c in within)
    assert {n.kind for n in within[0].nodes} == {"small"}  # 10x cheaper, not 10x slower
    assert search(profile, load(), inventory(BIG), Limits(32, tpot_slo_s=1e-6)) == []


def test_a_crowded_node_is_bound_by_its_cores() -> None:
    profile = ProfileFile.model_validate(profile_dict())
    one_core = {**SMALL, "cores": 1}
    found = search(profile, load(), inventory(one_core), Limits(8, max_services=2))
    # One core runs everything in turn: overlapping micro-batches gains nothing (with one, the
    # pipeline already is the sum of all the work).
    assert found and all(c.step.bound == "cpu of small node 0" for c in found if c.m > 1)
    assert all(c.step.seconds > c.step.pipeline_s for c in found if c.m > 1)
    assert found[0].m == 1


def test_weights_that_do_not_fit_rule_a_layout_out() -> None:
    profile = ProfileFile.model_validate(profile_dict())  # 4 MiB dense + 16 x 1 MiB experts
    tight = {**SMALL, "memory": "12MiB", "available": 3}
    found = search(profile, load(), inventory(tight), Limits(4, max_replicas=1))
    assert found and all(not n.router or len(n.replicas) <= 8 for c in found for n in c.nodes)
    assert all(len(c.nodes) > 1 for c in found)  # never all 20 MiB on one node


def test_the_workload_slows_every_step_by_its_prompt_tokens() -> None:
    profile = ProfileFile.model_validate(profile_dict())
    decode = search(profile, load(), inventory(BIG), Limits(16))
    mixed = search(profile, load(), inventory(BIG), Limits(16), Workload(64, 128))
    assert len(decode) == len(mixed)
    slower = {(c.batch, c.m, len(c.groups), c.replicas): c.step.seconds for c in mixed}
    for c in decode:
        assert slower[(c.batch, c.m, len(c.groups), c.replicas)] > c.step.seconds
    assert all(c.tokens_per_s == pytest.approx(c.batch / c.step.seconds) for c in mixed)


def test_search_writes_a_plan_deploy_render_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, prediction = tmp_path / "plan.yaml", tmp_path / "prediction.json"
    args = search_args(
        tmp_path, "--out", str(out), "--prediction-out", str(prediction), "--tpot-slo-ms", "100"
    )
    assert plan_cli.main(args) == 0
    err = capsys.readouterr().err
    assert "TPOT ms" in err and "tokens/s" in err and err.count("small[") >= 5
    plan = deploy.load_plan(out)
    predicted = json.loads(prediction.read_text())
    assert plan.router.max_num_seqs == predicted["batch_size"]
    assert plan.router.micro_batches == predicted["micro_batches"]
    assert plan.router.colocate_budget == "0"
    assert predicted["predicted_tpot_ms"] <= 100
    assert predicted["predicted_tokens_per_s"] == pytest.approx(
        predicted["batch_size"] / predicted["predicted_tpot_ms"] * 1e3
    )
    groups = predicted["plan"]["expert_groups"]
    assert [g.name for g in plan.expert_groups] == [g["name"] for g in groups]
    assert all(g.compute_threads >= 1 for g in plan.expert_groups)
    # What it reserves fits the node it was predicted on (one kind: no node-class constraint, of
    # the example plan's first group or any other), with one router as predicted.
    assert plan.router.replicas == 1 and not any(g.constraints for g in plan.expert_groups)
    cpu = {g.name: g.resources.cpu_mhz for g in plan.expert_groups}
    for node in predicted["plan"]["nodes"]:
        used = sum(cpu[name] for name in node["expert_groups"])
        used += plan.router.resources.cpu_mhz if node["router"] else 0
        assert used <= SMALL["cores"] * 1000, node
    assert all(g.resources.memory_mb < 8 * 1024 for g in plan.expert_groups)
    rendered = deploy.render(plan, "compose")["docker-compose.yml"]
    assert "--micro-batches" in rendered and "--max-num-seqs" in rendered
    assert deploy.render(plan, "nomad")
    assert plan_cli.main(args) == 0 and deploy.load_plan(out) == plan  # deterministic
    # Without --input-len / --output-len: `moe-mesh bench`'s default medians.
    assert (predicted["input_len"], predicted["output_len"]) == (57, 16)
    assert predicted["prefill_tokens_per_step"] == pytest.approx(predicted["batch_size"] * 57 / 16)


def test_search_takes_the_request_lengths(tmp_path: Path) -> None:
    tokens_per_s = {}
    for lengths in (("0", "16"), ("64", "128"), ("256", "16")):
        prediction = tmp_path / "prediction.json"
        extra = ("--input-len", lengths[0], "--output-len", lengths[1], "--max-num-seqs", "8")
        args = search_args(tmp_path, "--prediction-out", str(prediction), "--out", "/dev/null")
        assert plan_cli.main([*args, *extra]) == 0
        predicted = json.loads(prediction.read_text())
        assert predicted["input_len"] == int(lengths[0])
        tokens_per_s[lengths] = predicted["predicted_tokens_per_s"]
    # One node kind, one node: the best is the fastest, and more prompt per output is slower.
    assert tokens_per_s[("0", "16")] > tokens_per_s[("64", "128")] > tokens_per_s[("256", "16")]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tpot-slo-ms", "0.0001"], "no candidate meets --tpot-slo-ms 0.0001"),
    ],
)
def test_search_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], message: str
) -> None:
    assert plan_cli.main(search_args(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err


def test_profile_of_another_model_is_refused(tmp_path: Path, capsys) -> None:
    args = search_args(tmp_path)
    write_profile(tmp_path, model_id="other")
    assert plan_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "utilization.json: model_id: the record has 'mixtral-small'" in err
    assert "profile.json has 'other'" in err


def test_search_flags_go_together(tmp_path: Path, capsys) -> None:
    args = search_args(tmp_path)
    without_inventory = args[: args.index("--inventory")] + args[args.index("--base") :]
    assert plan_cli.main(without_inventory) == 2
    assert "--search needs --inventory" in capsys.readouterr().err
    not_searching = [a for a in args if a != "--search"]
    assert plan_cli.main(not_searching) == 2
    assert "--profile, --inventory only go with --search" in capsys.readouterr().err
    lengths = [*args[args.index("--utilization") :][:2], "--base", str(EXAMPLE_PLAN)]
    assert plan_cli.main(["plan", *lengths, "--input-len", "64"]) == 2
    assert "--input-len only go with --search" in capsys.readouterr().err
