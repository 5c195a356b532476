"""`moe-mesh plan --search --calibrate-bench B --calibrate-status S`: fit the model's level to a
mesh measured running.

The profile measures each side alone (Ta and Te in one process, a call against one idle service).
A running mesh costs more than those parts: its processes wake each other through a scheduler,
take turns on shared cores, and the engine, the gateway and the clients do work per step the
profile does not see. On the 2-core host `moe-mesh bench` measured 0.60-0.72 of the decode rate
the model alone predicted, for the default mesh at B = 4 and for the chosen plan at B = 32 alike.
So the search predicts the mesh that was measured (its expert groups, m, transport, B and request
lengths, on one node of the inventory's first kind, as `moe-mesh up` runs it) and scales every
candidate's step by measured / predicted. The ranking is the model's; the level is the
measurement's. Both files come from the mesh the utilization record was taken on:
`moe-mesh bench --ready-file R --concurrency B --out B.json` (one closed-loop point) and
`moe-mesh status --ready-file R --json > S.json` after it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.arch import ModelSpec
from common.errors import InvalidArgumentError
from common.placement import ModelShape, Pair, parse_experts
from moe_mesh.ops.coverage import COLOCATED
from moe_mesh.planning.deploy.plan import PlanError
from moe_mesh.planning.inventory import Inventory
from moe_mesh.planning.profile_format import ProfileFile
from moe_mesh.planning.search import expert_shares, layer_shares
from moe_mesh.planning.simulate import Costs, Node, Workload, simulate


@dataclass(frozen=True)
class Observed:
    """One measured run: the mesh's shape and its decode time per token."""

    groups: tuple[tuple[Pair, ...], ...]  # the experts of each distinct service
    replicas: tuple[int, ...]  # services serving each group
    m: int
    transport: str
    batch: int
    workload: Workload
    tpot_s: float


@dataclass(frozen=True)
class Calibration:
    factor: float  # measured TPOT / the model's TPOT for the observed mesh
    predicted_tpot_s: float
    observed: Observed

    def record(self) -> dict:
        o = self.observed
        return {
            "factor": self.factor,
            "observed_tpot_ms": o.tpot_s * 1e3,
            "model_tpot_ms": self.predicted_tpot_s * 1e3,
            "observed_mesh": {
                "services": sum(o.replicas),
                "batch_size": o.batch,
                "micro_batches": o.m,
                "transport": o.transport,
                "input_len": o.workload.input_len,
                "output_len": o.workload.output_len,
            },
        }


def _read(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read {what} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from None


def _point(bench: Any, path: Path) -> dict[str, float]:
    """The one closed-loop point of a `moe-mesh bench` report, as the numbers calibration needs."""
    try:
        points = [p for s in bench["setups"] for p in s["points"]]
    except (KeyError, TypeError):
        points = None
    if points is None or len(points) != 1:
        raise PlanError(
            f"{path}: expected one load point of `moe-mesh bench` (one set-up, one --concurrency), "
            f"got {'no report' if points is None else len(points)}"
        )
    p = points[0]
    try:
        out = {
            "concurrency": float(p["concurrency"]),
            "completed": float(p["completed"]),
            "input_tokens": float(p["input_tokens"]),
            "output_tokens": float(p["output_tokens"]),
            "tpot_ms": float(p["tpot_ms"]["p50"]),
        }
    except (KeyError, TypeError, ValueError):
        out = {}
    if not out or min(out["concurrency"], out["completed"], out["tpot_ms"]) <= 0:
        raise PlanError(
            f"{path}: points[0]: needs a closed-loop point (--concurrency) with completed "
            "requests, their token counts and TPOT p50"
        )
    return out


def observed(bench_path: Path, status_path: Path, shape: ModelSpec | ModelShape) -> Observed:
    point = _point(_read(bench_path, "the benchmark report"), bench_path)
    status = _read(status_path, "the mesh status")
    routers = (status.get("routers") if isinstance(status, dict) else None) or []
    if len(routers) != 1:
        raise PlanError(
            f"{status_path}: routers: expected one router (`moe-mesh status --json`), got "
            f"{len(routers)}"
        )
    router = routers[0] if isinstance(routers[0], dict) else {}
    placement = router.get("placement") or {}
    placement = dict(placement) if isinstance(placement, dict) else {}
    if placement.pop(COLOCATED, ""):
        raise PlanError(
            f"{status_path}: routers[0].placement: experts colocated in the router; calibrate "
            "on an all-remote mesh (`moe-mesh up --colocate-budget 0`)"
        )
    if not placement:
        raise PlanError(f"{status_path}: routers[0].placement: no expert service")
    pipeline = router.get("micro_batches")
    m = pipeline.get("last") if isinstance(pipeline, dict) else None
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise PlanError(f"{status_path}: routers[0].micro_batches.last: missing")
    try:
        counts = Counter(tuple(parse_experts(spec, shape)) for spec in placement.values())
    except (InvalidArgumentError, AttributeError) as e:
        raise PlanError(f"{status_path}: routers[0].placement: {e}") from None
    transports = {r.get("transport") for r in router.get("replicas") or [] if isinstance(r, dict)}
    completed = point["completed"]
    return Observed(
        groups=tuple(counts),
        replicas=tuple(counts.values()),
        m=m,
        transport="ucx" if "ucx" in transports else "grpc",
        batch=int(point["concurrency"]),
        workload=Workload(
            round(point["input_tokens"] / completed), round(point["output_tokens"] / completed)
        ),
        tpot_s=point["tpot_ms"] / 1e3,
    )


def calibrate(
    profile: ProfileFile,
    costs: dict[str, Costs],
    load: dict[Pair, float],
    inventory: Inventory,
    seen: Observed,
) -> Calibration:
    """The model's TPOT for the observed mesh, on one node of the inventory's first kind."""
    if seen.transport not in costs:
        raise PlanError(
            f"the observed mesh used {seen.transport}, which the profile did not measure"
        )
    kind = inventory.kinds[0]
    owners = tuple(g for g, r in enumerate(seen.replicas) for _ in range(r))
    node = Node(kind.name, kind.cores, True, owners)
    per_expert = expert_shares(profile.moe_layers, seen.groups, load)
    step = simulate(
        costs[seen.transport],
        layer_shares(per_expert),
        list(seen.replicas),
        [node],
        seen.batch,
        seen.m,
        per_expert,
        seen.workload.prefill_tokens(seen.batch),
    )
    return Calibration(seen.tpot_s / step.seconds, step.seconds, seen)
