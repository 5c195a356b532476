"""Utilization records as `moe-mesh placement show --json` writes them, for `moe-mesh plan` tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import REPO

EXAMPLE_PLAN = REPO / "deploy" / "plan.example.yaml"
MIB = 2**20
HOT = {
    (0, 1): 100.0,
    (1, 2): 95.0,
    (0, 5): 90.0,
    (1, 7): 80.0,
    (0, 3): 70.0,
    (1, 4): 60.0,
}  # hottest first


def skewed(layers: int = 2, experts: int = 8) -> list[list[float]]:
    rows = [[10.0] * experts for _ in range(layers)]
    for (layer, e), x in HOT.items():
        rows[layer][e] = x
    return rows


def write_record(tmp_path: Path, rows: list[list[float]], **overrides) -> Path:
    raw = {
        "model_id": "mixtral-small",
        "num_layers": len(rows),
        "num_experts": len(rows[0]),
        "moe_layers": list(range(len(rows))),
        "window_s": 60.0,
        "expert_bytes": MIB,
        "utilization": rows,
        "tokens_routed": [[0] * len(rows[0])] * len(rows),
        "routers": [{"address": "r:1"}],
        "services": [],
    }
    raw.update(overrides)
    path = tmp_path / "utilization.json"
    path.write_text(json.dumps(raw))
    return path
