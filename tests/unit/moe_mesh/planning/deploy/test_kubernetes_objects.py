"""The objects around the Kubernetes Deployments (kubernetes_objects.py) for each choice the plan
offers: the model volume (a claim filled by a Job from Hugging Face or an image, an existing claim,
a hostPath), the gateway's exposure (Ingress, LoadBalancer, none); the fill and wait scripts run
here under sh; the plan refuses contradictory volume settings; `--image` reaches every target."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.hub import ALLOW_PATTERNS
from moe_mesh.planning import deploy
from moe_mesh.planning.deploy import kubernetes_objects
from tests.support.plans import EXAMPLE_PLAN, K8S_VERSION, example_raw, k8s_objects, plan_of

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="the scripts run under sh")


def _validated(plan: deploy.Plan) -> dict:
    import kubernetes_validate

    objects = k8s_objects(plan)
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return objects


def _with_volume(tmp_path: Path, **volume) -> deploy.Plan:
    raw = example_raw()
    raw["kubernetes"]["model_volume"] = volume
    return plan_of(raw, tmp_path)


def _fill(objects: dict) -> dict:
    [c] = objects["Job", "moe-mesh-model-fill"]["spec"]["template"]["spec"]["containers"]
    return c


def test_a_hugging_face_fill_downloads_only_what_the_mesh_reads(tmp_path: Path) -> None:
    plan = _with_volume(
        tmp_path, huggingface="org/name@v1", storage_class="fast-nfs", access_mode="ReadWriteMany"
    )
    objects = _validated(plan)
    claim = objects["PersistentVolumeClaim", "moe-mesh-model"]["spec"]
    assert claim["storageClassName"] == "fast-nfs" and claim["accessModes"] == ["ReadWriteMany"]
    c = _fill(objects)
    assert c["image"] == plan.image and c["command"][-2:] == ["org/name", "v1"]
    for pattern in ALLOW_PATTERNS:
        assert f"--include '{pattern}'" in c["command"][2]
    token = {e["name"]: e for e in c["env"]}["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "moe-mesh-hf-token", "key": "token", "optional": True}


def test_an_existing_claim_filled_by_hand_renders_neither_claim_nor_job(tmp_path: Path) -> None:
    objects = _validated(_with_volume(tmp_path, claim="models", create_claim=False))
    assert not [k for k in objects if k[0] in ("PersistentVolumeClaim", "Job")]
    pod = objects["Deployment", "router"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert pod["initContainers"][0]["name"] == "wait-for-model"  # for the marker written by hand


def test_a_host_path_needs_no_claim_job_or_wait(tmp_path: Path) -> None:
    plan = _with_volume(tmp_path, kind="host_path", host_path="/srv/models/m")
    objects = _validated(plan)
    assert "model.yaml" not in deploy.render(plan, "kubernetes")
    pod = objects["Deployment", "expert-hot"]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {
        "name": "model",
        "hostPath": {"path": "/srv/models/m", "type": "Directory"},
    }
    assert "initContainers" not in pod


@pytest.mark.parametrize(
    ("volume", "message"),
    [
        ({"kind": "host_path"}, "kind host_path needs host_path"),
        ({"host_path": "/x"}, "host_path is only read with kind host_path"),
        ({"huggingface": "a/b", "copy_from_image": "img"}, "not both"),
        ({"kind": "host_path", "host_path": "/x", "huggingface": "a/b"}, "filled on the nodes"),
        ({"huggingface": "not an id"}, "huggingface"),
        ({"size": "lots"}, "size"),
    ],
)
def test_contradictory_volume_settings_name_the_field(tmp_path: Path, volume, message) -> None:
    with pytest.raises(deploy.PlanError, match=message):
        _with_volume(tmp_path, **volume)


@pytest.mark.parametrize("expose", ["none", "loadbalancer"])
def test_exposure_without_an_ingress(tmp_path: Path, expose: str) -> None:
    raw = example_raw()
    raw["kubernetes"]["expose"] = expose
    objects = _validated(plan_of(raw, tmp_path))
    assert ("Ingress", "gateway") not in objects
    spec = objects["Service", "gateway"]["spec"]
    assert spec.get("type") == ("LoadBalancer" if expose == "loadbalancer" else None)
    assert objects["Service", "router"]["spec"]["clusterIP"] == "None"  # the others stay internal


def _run(command: list[str], fill: Path, tmp_path: Path, timeout: float = 20) -> str:
    """A rendered sh command with its fill directory moved under tmp_path."""
    script = command[2].replace(kubernetes_objects.FILL_DIR, str(fill))
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    r = subprocess.run(
        ["sh", "-c", script, *command[3:]],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_fill_job_writes_its_marker_last_and_runs_once(tmp_path: Path) -> None:
    """A stand-in `hf` records its arguments: the id and revision arrive as arguments (no shell
    quoting of plan text), the marker follows the download, a second run downloads nothing."""
    bin_dir, fill = tmp_path / "bin", tmp_path / "fill"
    bin_dir.mkdir(), fill.mkdir()
    (bin_dir / "hf").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    (bin_dir / "hf").chmod(0o755)
    c = _fill(k8s_objects(_with_volume(tmp_path, huggingface="org/name")))
    _run(c["command"], fill, tmp_path)
    [call] = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith(f"download org/name --revision main --local-dir {fill} --include ")
    assert (fill / kubernetes_objects.FILLED).exists()
    assert "already filled" in _run(c["command"], fill, tmp_path)
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_pods_wait_for_the_marker(tmp_path: Path) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    [wait] = kubernetes_objects.wait_for_model(plan)
    command = [*wait["command"][:-1], str(tmp_path)]
    with pytest.raises(subprocess.TimeoutExpired):  # no marker: it keeps waiting
        _run(command, tmp_path, tmp_path, timeout=1)
    (tmp_path / kubernetes_objects.FILLED).touch()
    assert _run(command, tmp_path, tmp_path) == ""


@pytest.mark.parametrize("target", deploy.TARGETS)
def test_render_image_replaces_the_plans_image_in_every_file(tmp_path: Path, target: str) -> None:
    image = "registry.example.com:5000/team/moe-mesh:0.2.0"
    argv = ["deploy", "render", "--plan", str(EXAMPLE_PLAN), "--target", target]
    assert deploy.main([*argv, "--out", str(tmp_path), "--image", image]) == 0
    text = "".join(p.read_text() for p in sorted(tmp_path.iterdir()))
    assert image in text and "moe-mesh:0.1.0" not in text
    if target == "kubernetes":
        for p in tmp_path.glob("*.yaml"):
            for obj in yaml.safe_load_all(p.read_text()):
                spec = obj.get("spec", {}).get("template", {}).get("spec", {})
                for c in spec.get("containers", []) + spec.get("initContainers", []):
                    assert c["image"] in (image, "moe-mesh-model:mixtral-small")
    # --check compares with the render of the same --image.
    assert deploy.main([*argv, "--out", str(tmp_path), "--check", "--image", image]) == 0


def test_render_refuses_an_image_reference_with_shell_or_spaces(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["deploy", "render", "--plan", str(EXAMPLE_PLAN), "--target", "compose"]
    with pytest.raises(SystemExit) as e:
        deploy.main([*argv, "--out", str(tmp_path), "--image", "x:1 $(id)"])
    assert e.value.code == 2 and "--image" in capsys.readouterr().err


def test_render_expose_overrides_the_plan_for_kubernetes_only(tmp_path: Path, capsys) -> None:
    argv = ["deploy", "render", "--plan", str(EXAMPLE_PLAN), "--out", str(tmp_path)]
    assert deploy.main([*argv, "--target", "kubernetes", "--expose", "loadbalancer"]) == 0
    objects = list(yaml.safe_load_all((tmp_path / "gateway.yaml").read_text()))
    assert [o["spec"].get("type") for o in objects if o["kind"] == "Service"] == ["LoadBalancer"]
    assert "Ingress" not in [o["kind"] for o in objects]  # the plan's ingress, replaced
    assert deploy.main([*argv, "--target", "compose", "--expose", "ingress"]) == 2
    assert "--expose: only --target kubernetes" in capsys.readouterr().err
