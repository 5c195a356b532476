"""`moe-mesh placement show`: the mesh-wide utilization record, its table and picture, and the command;
the placement of each router in it."""

from __future__ import annotations

import json
import re

import pytest

from common.errors import PreconditionError, UnavailableError
from moe_mesh.ops.coverage import pairs_of
from moe_mesh.ops.placement import (
    placement_record,
    render,
    shares,
    write_png,
)

LAYERS, EXPERTS, MOE = 3, 8, [1, 2]  # layer 0 is dense


def router_row(
    address: str, utilization: list[list[float]], placement: dict[str, str], **fields
) -> dict:
    """A `router_status` row as a router of the tiering era answers it."""
    row = dict(
        address=address,
        health="SERVING",
        model_id="tiny",
        running=0,
        waiting=0,
        steps=7,
        failovers=0,
        registry_stale=False,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        moe_layers=MOE,
        tokens_routed=[[int(v) * 10 for v in r] for r in utilization],
        utilization=utilization,
        window_s=60.0,
        region="eu",
        expert_bytes=1 << 20,
        colocated_bytes=2 << 20,
        budget_bytes=8 << 20,
        promotions=3,
        demotions=1,
        pinned_hot="",
        pinned_remote="",
        placement=placement,
        regions={b: ("us" if b.endswith(":7002") else "eu") for b in placement},
        precisions={"colocated": "bfloat16", "10.0.0.9:7001": "int4-g64", "10.0.0.9:7002": ""},
    )
    return row | fields


def util(seed: int) -> list[list[float]]:
    return [[0.0] * EXPERTS] + [
        [float((seed * 7 + layer * 3 + e * 5) % 11) for e in range(EXPERTS)] for layer in MOE
    ]


@pytest.fixture
def rows() -> list[dict]:
    a = router_row(
        "10.0.0.1:6000",
        util(1),
        {"colocated": "1:0; 2:3,4", "10.0.0.9:7001": "1-2:0-3", "10.0.0.9:7002": "1-2:4-7"},
        pinned_hot="1:0",
    )
    b = router_row(
        "10.0.0.2:6000",
        util(2),
        {"colocated": "2:5", "10.0.0.9:7002": "1-2:4-7", "10.0.0.9:7001": "1-2:0-3"},
        region="us",
        pinned_remote="1:7",
    )
    return [a, b]


def test_record_sums_utilization_over_routers_and_lists_each_service_once(rows) -> None:
    record = placement_record(rows)
    assert set(record) == {
        "model_id",
        "num_layers",
        "num_experts",
        "moe_layers",
        "window_s",
        "expert_bytes",
        "utilization",
        "tokens_routed",
        "routers",
        "services",
    }
    assert (record["model_id"], record["num_layers"], record["num_experts"]) == (
        "tiny",
        LAYERS,
        EXPERTS,
    )
    assert (
        record["moe_layers"] == MOE
        and record["window_s"] == 60.0
        and record["expert_bytes"] == 1 << 20
    )
    assert record["utilization"] == [
        [x + y for x, y in zip(ra, rb)] for ra, rb in zip(util(1), util(2))
    ]
    assert (
        record["tokens_routed"][1][2]
        == rows[0]["tokens_routed"][1][2] + rows[1]["tokens_routed"][1][2]
    )
    assert record["services"] == [
        {"address": "10.0.0.9:7001", "region": "eu", "precision": "int4-g64", "experts": "1-2:0-3"},
        {"address": "10.0.0.9:7002", "region": "us", "precision": "", "experts": "1-2:4-7"},
    ]
    assert record["routers"][1] == {
        "address": "10.0.0.2:6000",
        "region": "us",
        "colocated": "2:5",
        "precision": "bfloat16",
        "colocated_bytes": 2 << 20,
        "budget_bytes": 8 << 20,
        "promotions": 3,
        "demotions": 1,
        "pinned_hot": "",
        "pinned_remote": "1:7",
    }
    json.dumps(record)  # what `moe-mesh plan` reads


def test_failed_routers_are_skipped_and_none_left_is_an_error(rows, capsys) -> None:
    failed = {"address": "10.0.0.3:6000", "health": "UNAVAILABLE", "error": "UNAVAILABLE"}
    assert placement_record([failed, rows[0]])["utilization"] == util(1)
    assert "10.0.0.3:6000" in capsys.readouterr().err
    with pytest.raises(
        UnavailableError, match=r"10\.0\.0\.3:6000 \(UNAVAILABLE\).*10\.0\.0\.4:6000"
    ):
        placement_record(
            [failed, failed | {"address": "10.0.0.4:6000", "error": "DEADLINE_EXCEEDED"}]
        )
    with pytest.raises(PreconditionError, match="different models"):
        placement_record([rows[0], rows[1] | {"model_id": "other"}])


def heatmap_cells(text: str) -> dict[tuple[int, int], tuple[int, str]]:
    """(layer, expert) -> (percent, mark) parsed back from the rendered heatmap blocks."""
    cells: dict[tuple[int, int], tuple[int, str]] = {}
    experts: list[int] = []
    for line in text.splitlines():
        if line.startswith("layer"):
            experts = [int(e) for e in line.split()[1:]]
        elif experts and re.match(r"^ {0,4}\d+ ", line):
            layer = int(line[:5])
            for e, i in zip(experts, range(5, len(line), 5)):
                cell = line[i : i + 5].ljust(5)
                cells[layer, e] = (int(cell[:4]), cell[4].strip())
    return cells


def test_render_marks_the_hot_tier_and_each_layer_adds_up_to_100_percent(rows) -> None:
    record = placement_record(rows)
    text = render(record)
    assert "10.0.0.9:7001" in text and "1:0; 2:3,4" in text and "H colocated" in text
    cells = heatmap_cells(text)
    assert {layer for layer, _ in cells} == set(MOE)  # dense layers are not drawn
    hot = {p for p, (_, mark) in cells.items() if mark in "HP" and mark}
    assert hot == {(1, 0), (2, 3), (2, 4), (2, 5)}  # colocated on either router
    assert (
        cells[1, 0][1] == "P"
        and cells[1, 7][1] == "r"
        and cells[2, 3][1] == "H"
        and cells[1, 1][1] == ""
    )
    for layer in MOE:
        assert sum(cells[layer, e][0] for e in range(EXPERTS)) == 100
        total = sum(record["utilization"][layer])
        assert all(
            abs(cells[layer, e][0] - 100 * record["utilization"][layer][e] / total) < 1
            for e in range(EXPERTS)
        )
    assert max(map(len, text.splitlines())) <= 100


def test_render_wraps_many_experts_into_blocks_that_fit_100_columns() -> None:
    wide = [[0.0] * 40] + [[float(e % 9 + 1) for e in range(40)]] * 2
    row = router_row(
        "10.0.0.1:6000",
        wide,
        {"colocated": "1:33", "10.0.0.9:7001": "1-2:0-32,34-39; 2:33"},
        num_experts=40,
    )
    text = render(placement_record([row]))
    cells = heatmap_cells(text)
    assert len(cells) == 2 * 40 and {p for p, (_, m) in cells.items() if m} == {(1, 33)}
    assert max(map(len, text.splitlines())) <= 100
    assert shares([1.0, 1.0, 1.0]) == [34, 33, 33] and shares([0.0, 0.0]) == [0, 0]


def test_write_png_draws_layers_by_experts(rows, tmp_path) -> None:
    from PIL import Image

    path = tmp_path / "placement.png"
    write_png(placement_record(rows), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
    assert width > 2 * height  # 2 MoE layers x 8 experts: a wide picture

    tall = [[float(layer + e) for e in range(4)] for layer in range(16)]
    record = placement_record(
        [
            router_row(
                "10.0.0.1:6000",
                tall,
                {"colocated": "*:*"},
                num_layers=16,
                num_experts=4,
                moe_layers=list(range(16)),
            )
        ]
    )
    assert pairs_of("*:*", record) == {(layer, e) for layer in range(16) for e in range(4)}
    write_png(record, path)
    with Image.open(path) as image:
        width, height = image.size
    assert height > width
