"""The `moe-mesh profile` file: what `read_profile` accepts and the errors that name file and field.
(The measuring itself runs in tests/e2e/test_plan_search.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_mesh.planning.deploy import PlanError
from moe_mesh.planning.profile_format import FORMAT, Fit, Measured, read_profile
from moe_mesh.planning.search import costs
from tests.support.plans import fit, profile_dict, write_profile


def test_a_profile_reads_back(tmp_path: Path) -> None:
    """A format 1 profile (no per-call CPU) still reads."""
    profile = read_profile(write_profile(tmp_path))
    expected = {k: v for k, v in profile_dict().items() if v is not None}
    for transport in expected["transports"].values():
        transport["spread_points"] = []  # format 2's fields, empty
    assert profile.model_dump(mode="json", exclude_none=True) == expected
    assert costs(profile, "grpc").service_cpu(1000, experts=4) == pytest.approx(5e-4)  # one Tc
    assert profile.ta.wall.linear()(10) == pytest.approx(2e-3)


def test_a_format_2_profile_carries_each_ends_cpu_per_call(tmp_path: Path) -> None:
    grpc = {
        "fit": fit(0.0, 5e-4),
        "points": [
            {
                "tokens": 8,
                "bytes": 32768,
                "round_trip_s": 1.2e-3,
                "compute_s": 2e-4,
                "one_way_s": 5e-4,
                "cpu_calls": 400,
                "service_cpu_s": 1.4e-3,
                "ffn_cpu_s": 2e-4,
                "router_cpu_s": 6e-4,
            }
        ],
        "service_call_cpu": fit(1e-9, 1.2e-3),
        "router_call_cpu": fit(0.0, 6e-4),
        "service_expert_cpu": 2e-4,
        "router_expert_cpu": 1e-5,
    }
    ucx = {"fit": fit(0.0, 4e-4), "cpu_skipped": "no pid"}
    path = write_profile(
        tmp_path, format="moe-mesh-profile/2", transports={"grpc": grpc, "ucx": ucx}
    )
    profile = read_profile(path)
    assert profile.format == "moe-mesh-profile/2"
    assert profile.transports["grpc"].points[0].cpu_calls == 400
    grpc_costs, ucx_costs = costs(profile, "grpc"), costs(profile, "ucx")
    assert grpc_costs.service_cpu(1000) == pytest.approx(1.2e-3 + 1e-6)
    assert grpc_costs.router_cpu(1000) == pytest.approx(6e-4)
    # Rows for three experts: two more batches in the service.
    assert grpc_costs.service_cpu(1000, experts=3) == pytest.approx(1.2e-3 + 1e-6 + 2 * 2e-4)
    assert grpc_costs.router_cpu(1000, experts=3) == pytest.approx(6e-4 + 2 * 1e-5)
    # Not measured: each end pays one Tc per call.
    assert ucx_costs.service_cpu(1000) == ucx_costs.router_cpu(1000) == pytest.approx(4e-4)


def test_the_planner_reads_costs_through_the_measured_points() -> None:
    points = [(1, 2.0, 1.5), (8, 4.0, 3.5), (16, 9.56, 18.0)]
    m = Measured.model_validate(
        {
            "wall": Fit.of([1, 8, 16], [2.0, 4.0, 9.56]).model_dump(),
            "cpu": Fit.of([1, 8, 16], [1.5, 3.5, 18.0]).model_dump(),
            "threads": 1,
            "points": [{"x": x, "wall_s": w, "cpu_s": c} for x, w, c in points],
        }
    )
    assert m.wall.linear()(16) < 9.56  # the fit undershoots the last point ...
    assert m.wall_cost()(16) == pytest.approx(9.56)  # ... the planner's cost does not
    assert m.cpu_cost()(12) == pytest.approx((3.5 + 18.0) / 2)
    one_size = m.model_copy(update={"points": m.points[:1]})
    assert one_size.wall_cost() == m.wall.linear()  # no slope from one size: the fit


def test_fit_keeps_costs_non_negative() -> None:
    assert Fit.of([1, 2, 4], [3.0, 5.0, 9.0]) == Fit(slope=2.0, intercept=1.0)
    assert Fit.of([1, 2], [2.0, 1.0]).slope == 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"top_k": 0}, "top_k: Input should be greater than or equal to 1"),
        (
            {"format": "v0"},
            "format: Input should be 'moe-mesh-profile/1', 'moe-mesh-profile/2' or 'moe-mesh-profile/3'",
        ),
        (
            {"transports": {"grpc": {"fit": fit(0, 1), "service_call_cpu": fit(0, -1)}}},
            "transports.grpc.service_call_cpu.intercept",
        ),
        ({"moe_layers": []}, "moe_layers: List should have at least 1 item"),
        ({"transports": {"grpc": {"skipped": "no"}}}, "transports: no transport was measured"),
        ({"transports": {"grpc": {"fit": fit(-1.0, 0.0)}}}, "transports.grpc.fit.slope"),
        ({"te": None}, "te: Input should be"),
        ({"extra": 1}, "extra: Extra inputs are not permitted"),
    ],
)
def test_bad_profile_names_file_and_field(tmp_path: Path, overrides: dict, message: str) -> None:
    path = write_profile(tmp_path, **overrides)
    with pytest.raises(PlanError) as e:
        read_profile(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_unreadable_profile(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the profile"):
        read_profile(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text("{")
    with pytest.raises(PlanError, match="p.json: not valid JSON"):
        read_profile(tmp_path / "p.json")
    (tmp_path / "p.json").write_text(json.dumps([1]))
    with pytest.raises(PlanError, match="expected a JSON object"):
        read_profile(tmp_path / "p.json")


def test_a_format_3_profile_bounds_a_round_by_the_memory_bandwidth(tmp_path: Path) -> None:
    path = write_profile(tmp_path, format=FORMAT, memory_bandwidth=2e10)
    profile = read_profile(path)
    assert profile.format == "moe-mesh-profile/3"
    c = costs(profile, "grpc")
    assert (c.bandwidth, c.expert_bytes) == (2e10, profile.expert_bytes)
    older = costs(read_profile(write_profile(tmp_path, format="moe-mesh-profile/2")), "grpc")
    assert older.bandwidth == 0.0  # not measured: no bound
