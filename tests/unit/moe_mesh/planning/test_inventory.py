"""Inventory files for `moe-mesh plan --search`: the example, and errors naming file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_mesh.planning.deploy import PlanError
from moe_mesh.planning.inventory import load_inventory
from tests.support import REPO
from tests.support.plans import write_inventory

KIND = "  - {name: a, cores: 2, memory: 8GiB, cost_per_hour: 0.5, available: 2}\n"


def test_example_inventory_is_this_machine() -> None:
    inventory = load_inventory(REPO / "deploy" / "inventory.example.yaml")
    [kind] = inventory.kinds
    assert (kind.cores, kind.accelerators, kind.available) == (2, 0, 1)
    assert kind.memory_bytes == 24 * 2**30


@pytest.mark.parametrize(
    "text, message",
    [
        ("kinds: []\n", "kinds: List should have at least 1 item"),
        ("kinds:\n" + KIND.replace("cores: 2", "cores: 0"), "kinds[0].cores: Input should be"),
        ("kinds:\n" + KIND.replace("8GiB", "lots"), "kinds[0].memory: 'lots' is not a size"),
        ("kinds:\n" + KIND.replace("8GiB", "50%"), "kinds[0].memory: expected a size"),
        ("kinds:\n" + KIND.replace("cost_per_hour: 0.5", "cost_per_hour: -1"), "cost_per_hour"),
        ("kinds:\n" + KIND.replace("name: a", "name: 'a b'"), "kinds[0].name: String should"),
        ("kinds:\n" + KIND.replace(", available: 2", ""), None),  # available defaults to 1
        ("kinds:\n" + KIND.replace("memory: 8GiB", "memroy: 8GiB"), "kinds[0].memroy: Extra"),
        ("kinds:\n" + KIND + KIND, "kinds: duplicate kind name 'a'"),
        ("kinds: [\n", "not valid YAML"),
        ("- a\n", "expected a mapping with `kinds:`"),
    ],
)
def test_bad_inventory_names_file_and_field(tmp_path: Path, text: str, message: str | None) -> None:
    path = write_inventory(tmp_path, text)
    if message is None:
        assert load_inventory(path).kinds[0].available == 1
        return
    with pytest.raises(PlanError) as e:
        load_inventory(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_missing_inventory(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="missing.yaml: cannot read the inventory"):
        load_inventory(tmp_path / "missing.yaml")
