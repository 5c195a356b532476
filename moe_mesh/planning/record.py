"""The utilization record `moe-mesh placement show --json` writes, read and checked for the planners
(`moe-mesh plan` and its `--search`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.placement import Pair
from moe_mesh.planning.deploy.plan import PlanError


@dataclass(frozen=True)
class Record:
    """The parts of a utilization record the planner reads."""

    model_id: str
    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]
    window_s: float
    expert_bytes: int
    load: dict[Pair, float]  # MoE pairs only


def read_record(path: Path) -> Record:
    """Read and check a utilization record; every problem is a PlanError 'FILE: key: message'."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read the utilization record ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise PlanError(
            f"{path}: expected a JSON object as `moe-mesh placement show --json` writes"
        )

    def field(key: str, kind: type, low: float | None = None) -> Any:
        if key not in raw:
            raise PlanError(f"{path}: {key}: missing (`moe-mesh placement show --json` writes it)")
        return _checked(path, key, raw[key], kind, low)

    model_id = field("model_id", str)
    num_layers, num_experts = field("num_layers", int, 1), field("num_experts", int, 1)
    window_s, expert_bytes = field("window_s", float, 0), field("expert_bytes", int, 1)
    moe_layers = field("moe_layers", list)
    for i, layer in enumerate(moe_layers):
        _checked(path, f"moe_layers[{i}]", layer, int, 0)
        if layer >= num_layers or moe_layers.count(layer) > 1:
            raise PlanError(
                f"{path}: moe_layers[{i}]: layer {layer} is repeated or not below num_layers "
                f"{num_layers}"
            )
    if not moe_layers:
        raise PlanError(f"{path}: moe_layers: empty; the model has no routed experts to place")
    rows = field("utilization", list)
    if len(rows) != num_layers:
        raise PlanError(
            f"{path}: utilization: expected {num_layers} rows of {num_experts} experts, got "
            f"{len(rows)} rows"
        )
    for layer, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != num_experts:
            got = f"{len(row)} experts" if isinstance(row, list) else repr(row)
            raise PlanError(
                f"{path}: utilization[{layer}]: expected a row of {num_experts} experts, got {got}"
            )
    # Rows of dense layers are ignored whatever they hold: the router records nothing there.
    load = {
        (layer, e): _checked(path, f"utilization[{layer}][{e}]", rows[layer][e], float, 0)
        for layer in sorted(moe_layers)
        for e in range(num_experts)
    }
    return Record(
        model_id, num_layers, num_experts, tuple(sorted(moe_layers)), window_s, expert_bytes, load
    )


def _checked(path: Path, key: str, value: Any, kind: type, low: float | None = None) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    what = {str: "a string", int: "an integer", float: "a number", list: "a list"}[kind]
    if not ok or (low is not None and value < low):
        bound = f" >= {low:g}" if low is not None else ""
        raise PlanError(f"{path}: {key}: expected {what}{bound}, got {value!r}")
    return float(value) if kind is float else value
