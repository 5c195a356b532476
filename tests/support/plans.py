"""Utilization records as `moe-mesh placement show --json` writes them, for `moe-mesh plan` tests;
the example deploy plan and variants of its `autoscale:` blocks and devices, for the
renderers' tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

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


def fit(slope: float, intercept: float) -> dict:
    return {"slope": slope, "intercept": intercept}


def measured(wall: dict, cpu: dict | None = None, threads: int = 1) -> dict:
    cpu = cpu or wall
    return {
        "wall": wall,
        "cpu": cpu,
        "threads": threads,
        "points": [{"x": 1.0, "wall_s": wall["slope"] + wall["intercept"], "cpu_s": 0.0}],
    }


def profile_dict(layers: int = 2, experts: int = 8, **overrides) -> dict:
    """A `moe-mesh profile` result with round costs (seconds; Tc against bytes): Ta = 1 ms + 0.1 ms
    per sequence on 2 threads, Te = 1 ms + 0.1 ms per token on 1, Tc = 0.5 ms one way over grpc."""
    raw = {
        "format": "moe-mesh-profile/1",
        "checkpoint": "/tmp/ckpt",
        "model_id": "mixtral-small",
        "family": "mixtral",
        "dtype": "float32",
        "hidden_size": 1024,
        "num_layers": layers,
        "moe_layers": list(range(layers)),
        "num_experts": experts,
        "top_k": 2,
        "bytes_per_token": 4096,
        "expert_bytes": MIB,
        "dense_bytes": 4 * MIB,
        "cores": 2,
        "context": 128,
        "ta": measured(fit(1e-4, 1e-3), threads=2),
        "te": measured(fit(1e-4, 1e-3)),
        "dense": None,
        "head": measured(fit(0.0, 0.0), threads=2),
        "expert_load_shares": {str(i): [1 / experts] * experts for i in range(layers)},
        "transports": {"grpc": {"fit": fit(0.0, 5e-4), "points": []}},
    }
    raw.update(overrides)
    return raw


def write_profile(tmp_path: Path, **overrides) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict(**overrides)))
    return path


def write_inventory(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


# A 2-core node kind, like this host (deploy/inventory.example.yaml).
SMALL_NODE = {"name": "small", "cores": 2, "memory": "8GiB", "cost_per_hour": 0.1, "available": 1}


def search_args(tmp_path: Path, *extra: str) -> list[str]:
    """`plan --search` over a written profile, a skewed record and one SMALL_NODE."""
    inventory = write_inventory(tmp_path, yaml.safe_dump({"kinds": [SMALL_NODE]}))
    return [
        "plan",
        "--search",
        "--profile",
        str(write_profile(tmp_path)),
        "--utilization",
        str(write_record(tmp_path, skewed())),
        "--inventory",
        str(inventory),
        "--base",
        str(EXAMPLE_PLAN),
        *extra,
    ]


def example_raw() -> dict:
    """deploy/plan.example.yaml as the mapping it holds (its hot group autoscales on token rows)."""
    return yaml.safe_load(EXAMPLE_PLAN.read_text())


def plan_of(raw: dict, tmp_path: Path):
    """`raw` loaded as `moe-mesh deploy render` loads a plan file."""
    from moe_mesh.planning import deploy

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return deploy.load_plan(path)


# Unlike the example's: busy, both windows, other steps, a tolerance of its own, no TPOT guard.
BUSY = {
    "min_replicas": 2,
    "max_replicas": 6,
    "metric": "busy",
    "tolerance": 0.05,
    "scale_up_window_s": 30,
    "scale_down_window_s": 120,
    "max_step_up": 2,
    "max_step_down": 1,
    "step_period_s": 60,
    "interval_s": 10,
}


def busy_plan(tmp_path: Path):
    """The example with its cold group autoscaled on busy time too (3 replicas to start)."""
    raw = example_raw()
    raw["expert_groups"][1].update(replicas=3, autoscale=BUSY)
    return plan_of(raw, tmp_path)


def static_plan(tmp_path: Path):
    """The example with no group autoscaled."""
    raw = example_raw()
    raw["expert_groups"][0].pop("autoscale")
    return plan_of(raw, tmp_path)


K8S_VERSION = "1.37.0"  # the API schemas kubernetes-validate checks renders against, offline


def k8s_objects(plan) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, from every file `deploy render --target kubernetes` writes."""
    from moe_mesh.planning import deploy

    out = {}
    for text in deploy.render(plan, "kubernetes").values():
        for obj in yaml.safe_load_all(text):
            out[obj["kind"], obj["metadata"]["name"]] = obj
    return out


def gpu_raw() -> dict:
    """The example with its router on cuda:1 (compose reserves GPU 1) and its hot group on cuda
    (any one GPU); the cold group and the gateway stay on the CPU."""
    raw = example_raw()
    raw["router"]["device"] = "cuda:1"
    raw["expert_groups"][0]["device"] = "cuda"
    return raw
