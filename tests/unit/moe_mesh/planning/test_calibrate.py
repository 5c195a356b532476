"""`plan --search --calibrate-bench/--calibrate-status`: the model's level fitted to a measured mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.placement import ModelShape
from moe_mesh.planning import plan as plan_cli
from moe_mesh.planning.calibrate import calibrate, observed
from moe_mesh.planning.inventory import Inventory
from moe_mesh.planning.profile_format import ProfileFile
from moe_mesh.planning.search import Limits, all_transports, planning_load, search
from moe_mesh.planning.simulate import Node, simulate
from tests.support.plans import SMALL_NODE, profile_dict, search_args

SHAPE = ModelShape(2, 8, (0, 1))
UNIFORM = {(la, e): 1.0 for la in range(2) for e in range(8)}


def bench_report(tmp_path: Path, tpot_ms: float, concurrency: int = 4, points: int = 1) -> Path:
    """What `moe-mesh bench --concurrency N --out` writes (the fields calibration reads)."""
    point = {
        "load": f"c={concurrency}",
        "concurrency": concurrency,
        "completed": 8,
        "input_tokens": 8 * 64,
        "output_tokens": 8 * 128,
        "tpot_ms": {"p50": tpot_ms},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"setups": [{"name": "mesh", "points": [point] * points}]}))
    return path


def status_report(tmp_path: Path, placement: dict[str, str], m: int = 1) -> Path:
    """What `moe-mesh status --json` prints about the router (the fields calibration reads)."""
    router = {
        "placement": placement,
        "micro_batches": {"setting": "auto", "last": m},
        "replicas": [{"transport": "grpc"} for _ in placement],
    }
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"routers": [router]}))
    return path


TWO_GROUPS_ONE_TWICE = {"a:1": "*:0-3", "b:1": "*:4-7", "c:1": "*:0-3"}


def test_the_observed_mesh_is_read_from_the_bench_and_the_status(tmp_path: Path) -> None:
    seen = observed(
        bench_report(tmp_path, 120.0), status_report(tmp_path, TWO_GROUPS_ONE_TWICE, m=2), SHAPE
    )
    assert seen.replicas == (2, 1)
    assert [len(g) for g in seen.groups] == [8, 8]  # 4 experts x 2 layers each
    assert (seen.m, seen.transport, seen.batch, seen.tpot_s) == (2, "grpc", 4, 0.12)
    assert (seen.workload.input_len, seen.workload.output_len) == (64, 128)


def test_the_factor_is_measured_over_the_model_and_scales_every_candidate(tmp_path: Path) -> None:
    profile = ProfileFile.model_validate(profile_dict())
    costs = all_transports(profile)
    inventory = Inventory.model_validate({"kinds": [SMALL_NODE]})
    seen = observed(
        bench_report(tmp_path, 120.0), status_report(tmp_path, TWO_GROUPS_ONE_TWICE), SHAPE
    )
    # The model's own step for that mesh: three processes and the router on one 2-core node.
    half = [0.5, 0.5]
    step = simulate(
        costs["grpc"],
        [half, half],
        [2, 1],
        [Node(SMALL_NODE["name"], 2, True, (0, 0, 1))],
        4,
        1,
        [[[1 / 8] * 4] * 2] * 2,
        seen.workload.prefill_tokens(4),
    )
    fitted = calibrate(profile, costs, planning_load(profile, UNIFORM), inventory, seen)
    assert fitted.predicted_tpot_s == pytest.approx(step.seconds)
    assert fitted.factor == pytest.approx(0.12 / step.seconds)
    raw = search(profile, UNIFORM, inventory, Limits(8))
    scaled = search(profile, UNIFORM, inventory, Limits(8), scale=fitted.factor)
    assert [c.step.seconds * fitted.factor for c in raw] == pytest.approx(
        [c.step.seconds for c in scaled]
    )


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return search_args(tmp_path, "--max-num-seqs", "8", "--out", "/dev/null", *extra)


def test_a_calibrated_search_predicts_the_observed_level(tmp_path: Path, capsys) -> None:
    prediction = tmp_path / "prediction.json"
    args = _args(tmp_path, "--prediction-out", str(prediction))
    assert plan_cli.main(args) == 0
    raw = json.loads(prediction.read_text())
    assert raw["calibration"] is None
    status = status_report(tmp_path, {"a:1": "*:0-7"})
    for tpot_ms in (50.0, 500.0):
        bench = bench_report(tmp_path, tpot_ms)
        calibrating = ["--calibrate-bench", str(bench), "--calibrate-status", str(status)]
        assert plan_cli.main([*args, *calibrating]) == 0
        assert "every step x" in capsys.readouterr().err
        got = json.loads(prediction.read_text())
        c = got["calibration"]
        assert c["observed_tpot_ms"] == tpot_ms
        assert c["factor"] == pytest.approx(tpot_ms / c["model_tpot_ms"])
        # A uniform factor keeps the ranking: the same plan, its step scaled.
        assert got["plan"] == raw["plan"] and got["batch_size"] == raw["batch_size"]
        assert got["predicted_tpot_ms"] == pytest.approx(raw["predicted_tpot_ms"] * c["factor"])


@pytest.mark.parametrize(
    "bench_points, placement, only_one, message",
    [
        (2, {"a:1": "*:0-7"}, False, "expected one load point of `moe-mesh bench`"),
        (1, {"colocated": "0:1", "a:1": "*:0-7"}, False, "calibrate on an all-remote mesh"),
        (1, {}, False, "routers[0].placement: no expert service"),
        (1, {"a:1": "*:0-7"}, True, "--calibrate-bench and --calibrate-status go together"),
    ],
)
def test_calibration_input_errors_exit_2(
    tmp_path: Path, capsys, bench_points: int, placement: dict, only_one: bool, message: str
) -> None:
    bench = bench_report(tmp_path, 100.0, points=bench_points)
    status = status_report(tmp_path, placement)
    extra = ["--calibrate-bench", str(bench)]
    if not only_one:
        extra += ["--calibrate-status", str(status)]
    assert plan_cli.main(_args(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
