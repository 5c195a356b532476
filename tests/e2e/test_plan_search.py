"""`moe-mesh profile` on the tiny checkpoint (an expert service it starts and stops itself), then
`moe-mesh plan --search` on what it wrote, as a user runs them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from moe_mesh.planning import deploy
from tests.support import REPO
from tests.support.cli import moe_mesh
from tests.support.plans import EXAMPLE_PLAN


def test_profile_then_search(checkpoint, tmp_path: Path) -> None:
    path = checkpoint("mixtral")
    profile_file = tmp_path / "profile.json"
    start = time.monotonic()
    done = moe_mesh(
        "profile",
        "--checkpoint",
        path,
        "--out",
        profile_file,
        "--sizes",
        "1,4,16",
        "--transfer-tokens",
        "1,64",
        "--repeats",
        "3",
        "--share-tokens",
        "256",
        "--cpu-window-s",
        "0.2",
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 40
    assert "Ta b=16" in done.stderr and "Tc grpc" in done.stderr
    profile = json.loads(profile_file.read_text())
    assert profile["model_id"] == path.name and profile["moe_layers"]
    assert [p["x"] for p in profile["ta"]["points"]] == [1, 4, 16]
    assert profile["transports"]["grpc"]["fit"]["intercept"] >= 0
    assert len(profile["transports"]["grpc"]["points"]) == 2
    # It started the service, so it knows its pid: both ends' CPU per call are measured.
    grpc = profile["transports"]["grpc"]
    assert grpc["service_call_cpu"] is not None and grpc["router_call_cpu"] is not None
    assert all(p["cpu_calls"] >= 3 and p["service_cpu_s"] > 0 for p in grpc["points"])
    assert grpc["spread_points"][0]["experts"] > 1 and grpc["service_expert_cpu"] is not None
    ucx = profile["transports"]["ucx"]
    assert ucx.get("fit") is not None or ucx["skipped"]  # measured, or why not

    base = yaml.safe_load(EXAMPLE_PLAN.read_text())
    base["model"] = {"checkpoint": "/models/tiny", "model_id": path.name}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = profile["num_layers"], profile["num_experts"]
    record = {
        "model_id": path.name,
        "num_layers": spec[0],
        "num_experts": spec[1],
        "moe_layers": profile["moe_layers"],
        "window_s": 60.0,
        "expert_bytes": profile["expert_bytes"],
        "utilization": [[float(e + 1) for e in range(spec[1])] for _ in range(spec[0])],
    }
    (tmp_path / "window.json").write_text(json.dumps(record))
    searched = moe_mesh(
        "plan",
        "--search",
        "--profile",
        profile_file,
        "--utilization",
        tmp_path / "window.json",
        "--inventory",
        REPO / "deploy" / "inventory.example.yaml",
        "--base",
        tmp_path / "base.yaml",
        "--tpot-slo-ms",
        "1000",
        "--out",
        tmp_path / "plan.yaml",
        "--prediction-out",
        tmp_path / "prediction.json",
    )
    assert searched.returncode == 0, searched.stderr
    assert "tokens/s" in searched.stderr
    plan = deploy.load_plan(tmp_path / "plan.yaml")
    prediction = json.loads((tmp_path / "prediction.json").read_text())
    assert prediction["predicted_tokens_per_s"] > 0 and prediction["predicted_tpot_ms"] <= 1000
    assert plan.router.micro_batches == prediction["micro_batches"]
    rendered = moe_mesh(
        "deploy",
        "render",
        "--plan",
        tmp_path / "plan.yaml",
        "--target",
        "compose",
        "--out",
        tmp_path / "out",
    )
    assert rendered.returncode == 0, rendered.stderr
