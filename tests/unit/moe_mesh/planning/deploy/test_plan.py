"""Plan files' `autoscale:` blocks: bad bounds and values are refused at load, with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_mesh.planning import deploy
from tests.support.plans import example_raw, plan_of


def _autoscale(**fields):
    def mutate(raw: dict) -> None:
        raw["expert_groups"][0]["autoscale"].update(fields)

    return mutate


BAD = [
    (
        _autoscale(min_replicas=5, max_replicas=2),
        "expert_groups[0].autoscale.max_replicas: 2 is below min_replicas 5",
    ),
    (_autoscale(min_replicas=3), "expert_groups[0]: replicas 2 is outside autoscale's [3, 4]"),
    (
        _autoscale(max_replicas=0),
        "expert_groups[0].autoscale.max_replicas: Input should be greater",
    ),
    (
        _autoscale(target=None),
        "expert_groups[0].autoscale.target: metric token_rows needs a target",
    ),
    (_autoscale(tolerance=1), "expert_groups[0].autoscale.tolerance: Input should be less than 1"),
    (_autoscale(metric="queue"), "expert_groups[0].autoscale.metric: Input should be"),
    (_autoscale(max_replica=3), "expert_groups[0].autoscale.max_replica: Extra inputs"),
]


@pytest.mark.parametrize("mutate, message", BAD, ids=[m for _, m in BAD])
def test_bad_bounds_are_refused_at_plan_load_with_the_field_named(
    tmp_path: Path, mutate, message: str
) -> None:
    raw = example_raw()
    mutate(raw)
    with pytest.raises(deploy.PlanError) as e:
        plan_of(raw, tmp_path)
    assert message in str(e.value)
