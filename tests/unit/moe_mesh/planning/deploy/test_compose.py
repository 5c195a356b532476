"""The compose target's autoscaling: compose has no autoscaler object, so the rendered file points
at `moe-mesh autoscale` (the local controller) for the groups with `autoscale`, and only then.
Its devices: a service on CUDA reserves an NVIDIA GPU per replica (GPU N for cuda:N) and runs with
`--device cuda`; one on the CPU reserves none, and runs with `--device cpu` where the plan uses GPUs
(its image would show it every GPU) and without the flag otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from moe_mesh.planning import deploy
from tests.support import REPO
from tests.support.plans import gpu_raw, plan_of

EXAMPLE_PLAN = REPO / "deploy" / "plan.example.yaml"
COMPOSE_SCHEMA = REPO / "deploy" / "schema" / "compose-spec.json"


def test_compose_names_the_local_controller_for_autoscaled_groups_only(tmp_path: Path) -> None:
    example = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose")["docker-compose.yml"]
    assert "Autoscaled groups (expert-hot;" in example and "moe-mesh autoscale" in example
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["expert_groups"][0].pop("autoscale")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(raw))
    static = deploy.render(deploy.load_plan(tmp_path / "plan.yaml"), "compose")
    assert static["docker-compose.yml"].startswith("# Rendered by")
    assert "autoscale" not in static["docker-compose.yml"]


def _device_flag(service: dict) -> list[str]:
    command = service["command"]
    return [command[i + 1] for i, word in enumerate(command) if word == "--device"]


def test_cuda_services_reserve_a_gpu_and_cpu_ones_do_not(tmp_path: Path) -> None:
    doc = yaml.safe_load(
        deploy.render(plan_of(gpu_raw(), tmp_path), "compose")["docker-compose.yml"]
    )
    services = doc["services"]
    gpu = {"driver": "nvidia", "capabilities": ["gpu"]}
    wanted = {
        "router": [{**gpu, "device_ids": ["1"]}],  # cuda:1: the Docker host's GPU 1
        "expert-hot": [{**gpu, "count": 1}],  # cuda: any one
    }
    for name, devices in wanted.items():
        resources = services[name]["deploy"]["resources"]
        assert resources["reservations"]["devices"] == devices
        assert resources["reservations"]["cpus"] == resources["limits"]["cpus"]
        assert "devices" not in resources["limits"]
        # The container sees the reserved GPU as its device 0, whichever N the plan named.
        assert _device_flag(services[name]) == ["cuda"]
    for name in ("expert-cold", "gateway"):
        assert "devices" not in services[name]["deploy"]["resources"]["reservations"]
    assert _device_flag(services["expert-cold"]) == ["cpu"]  # never `auto` beside a GPU
    assert _device_flag(services["gateway"]) == []  # it computes nothing
    validator = jsonschema.Draft201909Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    assert [e.message for e in validator.iter_errors(doc)] == []
    # The schema checks the devices: a misspelt key is refused.
    services["router"]["deploy"]["resources"]["reservations"]["devices"][0]["capability"] = ["gpu"]
    assert len(list(validator.iter_errors(doc))) == 1


def test_a_cpu_plan_reserves_no_gpu() -> None:
    text = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose")["docker-compose.yml"]
    assert "devices" not in text and "nvidia" not in text and "--device" not in text
