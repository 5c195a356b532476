"""The compose target's autoscaling: compose has no autoscaler object, so the rendered file points
at `moe-mesh autoscale` (the local controller) for the groups with `autoscale`, and only then."""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_mesh.planning import deploy
from tests.support import REPO

EXAMPLE_PLAN = REPO / "deploy" / "plan.example.yaml"


def test_compose_names_the_local_controller_for_autoscaled_groups_only(tmp_path: Path) -> None:
    example = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose")["docker-compose.yml"]
    assert "Autoscaled groups (expert-hot;" in example and "moe-mesh autoscale" in example
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["expert_groups"][0].pop("autoscale")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(raw))
    static = deploy.render(deploy.load_plan(tmp_path / "plan.yaml"), "compose")
    assert static["docker-compose.yml"].startswith("# Rendered by")
    assert "autoscale" not in static["docker-compose.yml"]
