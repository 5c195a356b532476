"""`moe-mesh plan`: EPLB placement from a utilization window (moe_mesh/planning/eplb.py) and the plan it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moe_mesh.planning import deploy
from moe_mesh.planning import plan as plan_cli
from moe_mesh.planning.eplb import MAX_REPLICAS, PlanOptions, propose
from tests.support.plans import EXAMPLE_PLAN, HOT, MIB, skewed, write_record


def load_of(rows: list[list[float]]) -> dict[tuple[int, int], float]:
    return {(layer, e): x for layer, row in enumerate(rows) for e, x in enumerate(row)}


def covered(proposal) -> list[tuple[int, int]]:
    return sorted(p for g in proposal.groups for p in g.pairs)


# ------------------------------------------------------------------------------------------ planning


def test_colocates_exactly_the_hottest_pairs_that_fit() -> None:
    load = load_of(skewed())  # 16 pairs: 25% of their bytes fits 4 experts, 6 are hot
    proposal = propose(load, MIB, PlanOptions(budget_bytes=4 * MIB))
    assert proposal.colocated == ((0, 1), (1, 2), (0, 5), (1, 7))
    assert proposal.colocated_bytes == 4 * MIB
    assert proposal.in_process_share == pytest.approx(365 / sum(load.values()))
    assert propose(load, MIB, PlanOptions(budget_bytes=4 * MIB - 1)).colocated == (
        (0, 1),
        (1, 2),
        (0, 5),
    )
    assert propose(load, MIB, PlanOptions(budget_bytes=100 * MIB)).colocated == tuple(
        HOT
    )  # only hot pairs
    assert propose(load, MIB, PlanOptions(budget_bytes=0)).colocated == ()


def test_even_window_colocates_nothing() -> None:
    for rows in ([[10.0] * 8] * 2, [[10.0, 12.0, 11.0, 9.0] * 2] * 2, [[0.0] * 8] * 2):
        proposal = propose(load_of(rows), MIB, PlanOptions(budget_bytes=100 * MIB))
        assert proposal.colocated == () and proposal.in_process_share == 0.0


def test_extra_replicas_go_to_the_hottest_remote_pairs() -> None:
    load = load_of(skewed())
    proposal = propose(load, MIB, PlanOptions(budget_bytes=4 * MIB, extra_replicas=3))
    # (0, 3) = 70 first, then (1, 4) = 60, then (0, 3) again (70 / 2 = 35 > 60 / 2 = 30).
    assert {p: r for p, r in proposal.replicas.items() if r > 1} == {(0, 3): 3, (1, 4): 2}
    assert set(proposal.replicas) == set(load) and min(proposal.replicas.values()) == 1
    assert [(g.name, g.pairs, g.replicas) for g in proposal.groups[:2]] == [
        ("hot-r3", ((0, 3),), 3),
        ("hot-r2", ((1, 4),), 2),
    ]
    assert proposal.imbalance_after < proposal.imbalance_before
    assert proposal.imbalance_before == pytest.approx(100 / (sum(load.values()) / 16))
    default = propose(load, MIB, PlanOptions(budget_bytes=4 * MIB))  # 16 pairs // 8 = 2 extra
    assert sum(default.replicas.values()) == 16 + 2


def test_every_pair_in_exactly_one_group() -> None:
    load = load_of(skewed(layers=3, experts=16))
    for options in (
        PlanOptions(budget_bytes=4 * MIB, extra_replicas=10),
        PlanOptions(budget_bytes=0, groups=7),
        PlanOptions(budget_bytes=0, groups=64),
    ):
        proposal = propose(load, MIB, options)
        assert covered(proposal) == sorted(load)  # each pair once: no duplicates across groups
        assert len({g.name for g in proposal.groups}) == len(proposal.groups)
        assert sum(
            g.load_share for g in proposal.groups
        ) + proposal.in_process_share == pytest.approx(1.0)
        for g in proposal.groups:
            assert all(proposal.replicas[p] == g.replicas for p in g.pairs)


def test_replicas_are_capped_and_idle_pairs_get_none() -> None:
    load = {(0, 0): 1000.0, (0, 1): 0.0, (0, 2): 0.0, (0, 3): 1.0}
    proposal = propose(load, MIB, PlanOptions(budget_bytes=0, extra_replicas=50))
    assert proposal.replicas == {(0, 0): MAX_REPLICAS, (0, 1): 1, (0, 2): 1, (0, 3): MAX_REPLICAS}


def test_lpt_balances_single_replica_groups() -> None:
    load = {(0, e): x for e, x in enumerate([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 0.0, 0.0])}
    proposal = propose(load, MIB, PlanOptions(budget_bytes=0, groups=2, extra_replicas=0))
    assert [(g.name, g.pairs) for g in proposal.groups] == [
        ("experts-0", ((0, 0), (0, 3), (0, 4), (0, 7), (0, 8))),  # 9 + 6 + 5 + 2 = 22
        (
            "experts-1",
            ((0, 1), (0, 2), (0, 5), (0, 6), (0, 9)),
        ),  # 8 + 7 + 4 + 3 = 22; idle pairs split evenly
    ]
    assert [g.load_share for g in proposal.groups] == [0.5, 0.5]


# ------------------------------------------------------------------------------------------ the plan file


def test_plan_validates_and_renders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = yaml.safe_load(EXAMPLE_PLAN.read_text())
    base["router"]["args"] = ["--max-num-seqs", "64"]
    base["router"]["colocate_budget"] = "1"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    out = tmp_path / "proposed.yaml"
    args = [
        "plan",
        "--utilization",
        str(write_record(tmp_path, skewed())),
        "--base",
        str(tmp_path / "base.yaml"),
        "--out",
        str(out),
        "--extra-replicas",
        "3",
    ]
    assert plan_cli.main(args) == 0
    err = capsys.readouterr().err
    assert (
        "colocated in the router: 0:1,5; 1:2,7  (4 experts, 4.0 MiB of the 4.0 MiB budget)" in err
    )
    assert "hot-r3" in err and "imbalance (max / mean load per remote replica): " in err

    plan = deploy.load_plan(out)  # validates, coverage included: the record's sizes are in `model`
    assert (plan.model.num_layers, plan.model.num_experts) == (2, 8)
    assert plan.router.args == ["--max-num-seqs", "64"]  # the budget is a field, edited as data
    assert plan.router.colocate_budget == str(4 * MIB)
    template = deploy.load_plan(EXAMPLE_PLAN).expert_groups[0]
    assert [g.name for g in plan.expert_groups] == [
        "hot-r3",
        "hot-r2",
        "experts-0",
        "experts-1",
        "experts-2",
        "experts-3",
    ]
    sized = {"name", "experts", "replicas", "resources", "compute_threads"}
    for g in plan.expert_groups:  # where and how the base's first group runs, not its size
        assert g.model_dump(exclude=sized) == template.model_dump(exclude=sized)
        pairs = len(deploy.expert_pairs(g.experts))
        assert g.resources.memory_mb == pairs + 512  # a MiB an expert, and the process's own
    # The CPU the base's groups asked for (hot 2 x 4000 + cold 1 x 2000), shared out by load.
    asked = sum(g.resources.cpu_mhz * g.replicas for g in plan.expert_groups)
    assert abs(asked - 10000) <= 50 * len(plan.expert_groups)
    assert "the plan asks for " in err
    assert plan.model_dump(exclude={"model", "router", "expert_groups"}) == deploy.load_plan(
        tmp_path / "base.yaml"
    ).model_dump(exclude={"model", "router", "expert_groups"})
    for target in deploy.TARGETS:
        assert (
            deploy.main(
                [
                    "deploy",
                    "render",
                    "--plan",
                    str(out),
                    "--target",
                    target,
                    "--out",
                    str(tmp_path / target),
                ]
            )
            == 0
        )
    rendered = (tmp_path / "compose" / "docker-compose.yml").read_text()
    assert (
        f"- --colocate-budget\n    - '{4 * MIB}'\n" in rendered
    )  # the field, rendered as the router's flag
    assert plan_cli.main(args) == 0 and deploy.load_plan(out) == plan  # deterministic


def test_dense_layers_get_no_groups(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [[50.0] + [0.0] * 7, *skewed()]  # layer 0 is dense; its row is ignored whatever it holds
    record = write_record(tmp_path, rows, moe_layers=[1, 2])
    out = tmp_path / "proposed.yaml"
    assert (
        plan_cli.main(
            ["plan", "--utilization", str(record), "--base", str(EXAMPLE_PLAN), "--out", str(out)]
        )
        == 0
    )
    plan = deploy.load_plan(out)
    pairs = [p for g in plan.expert_groups for p in deploy.expert_pairs(g.experts)]
    assert sorted(pairs) == [(layer, e) for layer in (1, 2) for e in range(8)]
    assert plan.model.moe_layers == [1, 2]  # the plan's coverage check skips dense layer 0
    short = plan.model_dump(mode="json")
    short["expert_groups"][-1]["experts"] = "1:0"  # now some MoE pairs of layers 1-2 have no group
    with pytest.raises(ValueError, match="no group serves"):
        deploy.Plan.model_validate(short)
    assert "colocated in the router: 1:1,5; 2:2,7" in capsys.readouterr().err
    assert (
        deploy.main(
            ["deploy", "render", "--plan", str(out), "--target", "nomad", "--out", str(tmp_path)]
        )
        == 0
    )


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget", "25 percent"], "argument --budget: '25 percent' is not a size"),
        (["--budget", "101%"], "argument --budget: '101%': a percentage is at most 100%"),
        (["--budget=-1MiB"], "argument --budget: '-1MiB' is not a size"),
        (
            ["--groups", "0"],
            "argument --groups: Input should be greater than or equal to 1, got '0'",
        ),
        (
            ["--groups", "two"],
            "argument --groups: Input should be a valid integer, unable to parse",
        ),
        (
            ["--extra-replicas=-2"],
            "argument --extra-replicas: Input should be greater than or equal to 0, got '-2'",
        ),
        (
            ["--hot-factor", "nan"],
            "argument --hot-factor: Input should be greater than or equal to 0, got 'nan'",
        ),
    ],
)
def test_bad_flags_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as e:
        plan_cli.main(
            [
                "plan",
                "--utilization",
                str(write_record(tmp_path, skewed())),
                "--base",
                str(EXAMPLE_PLAN),
                *flags,
            ]
        )
    assert e.value.code == 2
    assert f"moe-mesh plan: error: {message}" in capsys.readouterr().err


BAD_RECORDS = [
    ({"expert_bytes": None}, "expert_bytes: missing"),
    ({"utilization": skewed()[:1]}, "utilization: expected 2 rows of 8 experts, got 1 rows"),
    (
        {"utilization": [[1.0] * 8, [1.0] * 7]},
        "utilization[1]: expected a row of 8 experts, got 7 experts",
    ),
    (
        {"utilization": [[1.0] * 8, [1.0] * 7 + [-3]]},
        "utilization[1][7]: expected a number >= 0, got -3",
    ),
    (
        {"utilization": [[1.0] * 8, [1.0] * 7 + ["x"]]},
        "utilization[1][7]: expected a number >= 0, got 'x'",
    ),
    ({"num_experts": 0}, "num_experts: expected an integer >= 1, got 0"),
    ({"expert_bytes": -5}, "expert_bytes: expected an integer >= 1, got -5"),
    ({"moe_layers": [0, 2]}, "moe_layers[1]: layer 2 is repeated or not below num_layers 2"),
    ({"moe_layers": []}, "moe_layers: empty"),
]


@pytest.mark.parametrize("change, message", BAD_RECORDS, ids=[m for _, m in BAD_RECORDS])
def test_bad_record_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, change: dict, message: str
) -> None:
    record = write_record(tmp_path, skewed())
    raw = json.loads(record.read_text())
    raw.update(change)
    record.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    out = tmp_path / "proposed.yaml"
    assert (
        plan_cli.main(
            ["plan", "--utilization", str(record), "--base", str(EXAMPLE_PLAN), "--out", str(out)]
        )
        == 2
    )
    assert f"moe-mesh plan: error: {record}: {message}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "cannot read the utilization record"),
        ("{", "not valid JSON"),
        ("[]", "expected a JSON object"),
    ],
)
def test_unreadable_record(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: str | None, message: str
) -> None:
    record = tmp_path / "utilization.json"
    if text is not None:
        record.write_text(text)
    assert plan_cli.main(["plan", "--utilization", str(record), "--base", str(EXAMPLE_PLAN)]) == 2
    assert f"moe-mesh plan: error: {record}: {message}" in capsys.readouterr().err
