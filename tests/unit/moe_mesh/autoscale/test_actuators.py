"""Compose scaling as the command line `docker compose` takes (no Docker engine runs here: a
stand-in `docker` records its arguments and answers as compose does), and its failures."""

import stat
from pathlib import Path

import pytest

from common.errors import UnavailableError
from moe_mesh.autoscale.actuators import Compose, LocalMesh


def fake_docker(tmp_path: Path, exit_code: int = 0) -> Path:
    script = tmp_path / "docker"
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{tmp_path}/argv"\n'
        f'[ {exit_code} -eq 0 ] || {{ echo "no such service: expert-warm" >&2; exit {exit_code}; }}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_compose_scales_one_service_without_touching_the_others(tmp_path):
    docker = fake_docker(tmp_path)
    Compose(tmp_path / "docker-compose.yml", f"{docker} compose").scale("expert-hot", 3)
    argv = (tmp_path / "argv").read_text().split()
    assert argv == [
        "compose", "-f", str(tmp_path / "docker-compose.yml"), "up", "--detach", "--no-recreate",
        "--no-deps", "--scale", "expert-hot=3", "expert-hot",
    ]  # fmt: skip


def test_compose_failures_name_the_command_and_its_last_line(tmp_path):
    docker = fake_docker(tmp_path, exit_code=1)
    with pytest.raises(UnavailableError, match="exited 1: no such service: expert-warm"):
        Compose(tmp_path / "c.yml", f"{docker} compose").scale("expert-warm", 2)
    with pytest.raises(UnavailableError, match="No such file"):
        Compose(tmp_path / "c.yml", str(tmp_path / "absent")).scale("expert-hot", 2)


def test_local_mesh_that_is_gone_is_unavailable(tmp_path):
    ready = tmp_path / "mesh.json"
    ready.write_text('{"control": "127.0.0.1:1"}')
    with pytest.raises(UnavailableError, match="control endpoint 127.0.0.1:1"):
        LocalMesh(ready).scale("*:0-3", 2)
