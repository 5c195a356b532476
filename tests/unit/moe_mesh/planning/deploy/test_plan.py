"""Plan files' `autoscale:` blocks and devices: bad bounds and values, and devices a scheduler
cannot reserve (auto, unknown names, a --device flag in args), are refused at load, with the field
named."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_mesh.planning import deploy
from moe_mesh.planning.deploy.plan import gpu_index
from tests.support.plans import EXAMPLE_PLAN, example_raw, plan_of


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


def _set(where: str, field: str, value):
    """A mutation setting `field` of the router or of expert group 1 to `value`."""

    def mutate(raw: dict) -> None:
        (raw["router"] if where == "router" else raw["expert_groups"][1])[field] = value

    return mutate


REFUSED_DEVICES = [
    (
        _set("router", "device", "auto"),
        "router.device: auto is not allowed in a plan: a scheduler must",
    ),
    (_set("group", "device", "auto"), "expert_groups[1].device: auto is not allowed in a plan"),
    (_set("router", "device", "gpu"), "router.device: must be cpu, cuda or cuda:N, got 'gpu'"),
    (
        _set("group", "device", "gpu"),
        "expert_groups[1].device: must be cpu, cuda or cuda:N, got 'gpu'",
    ),
    (_set("group", "device", "cuda:x"), "expert_groups[1].device: must be cpu, cuda or cuda:N"),
    # A flag would run on a GPU nobody reserved: the renderers reserve from the field.
    (
        _set("router", "args", ["--device", "cuda"]),
        "router.args: set router.device instead of --device",
    ),
    (
        _set("group", "args", ["--device=cuda"]),
        "expert_groups[1].args: set the group's device instead",
    ),
]


# Bad bounds, and a device a scheduler cannot reserve.
@pytest.mark.parametrize(
    "mutate, message", BAD + REFUSED_DEVICES, ids=[m for _, m in BAD + REFUSED_DEVICES]
)
def test_bad_bounds_and_devices_are_refused_at_plan_load_with_the_field_named(
    tmp_path: Path, mutate, message: str
) -> None:
    raw = example_raw()
    mutate(raw)
    with pytest.raises(deploy.PlanError) as e:
        plan_of(raw, tmp_path)
    assert message in str(e.value)


def test_devices_default_to_the_cpu_and_keep_a_cuda_index(tmp_path: Path) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    assert plan.router.device == "cpu" and {g.device for g in plan.expert_groups} == {"cpu"}
    raw = example_raw()
    raw["router"]["device"] = "CUDA:1"  # the services' spelling rules: case-insensitive
    raw["expert_groups"][0]["device"] = "cuda"
    plan = plan_of(raw, tmp_path)
    assert (plan.router.device, plan.expert_groups[0].device) == ("cuda:1", "cuda")
    assert (gpu_index(plan.router.device), gpu_index("cuda"), gpu_index("cpu")) == (1, None, None)
