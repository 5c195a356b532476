"""What changes a group's replica count: the launcher of `moe-mesh up` (the same control endpoint
`moe-mesh scale` uses; it starts a replica, waits for it to serve, and retires one by draining it)
or a docker compose project (`docker compose up --scale`, which starts or stops containers of the
group's service and leaves the others alone)."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
from pathlib import Path
from typing import Protocol

from common.errors import UnavailableError
from moe_mesh.ops.ready import read_ready_file

SCALE_TIMEOUT_S = 300.0  # a scale-up waits for its new replicas to load and serve


class Actuator(Protocol):
    def scale(self, group: str, replicas: int) -> None:
        """Run exactly `replicas` replicas of `group`; UnavailableError when that failed."""
        ...


class LocalMesh:
    """The launcher's loopback control endpoint, named in its ready file. A group is its expert
    spec ('*:0-3')."""

    def __init__(self, ready_file: Path) -> None:
        self.ready_file = ready_file

    def scale(self, group: str, replicas: int) -> None:
        host, _, port = read_ready_file(self.ready_file, "control")["control"].rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=SCALE_TIMEOUT_S) as conn:
                conn.sendall((json.dumps({"experts": group, "replicas": replicas}) + "\n").encode())
                reply = json.loads(conn.makefile().readline() or "{}")
        except (OSError, ValueError) as e:
            raise UnavailableError(f"the launcher's control endpoint {host}:{port}: {e}") from None
        if "error" in reply or not reply:
            raise UnavailableError(
                f"scaling {group} to {replicas}: {reply.get('error', 'no reply')}"
            )


class Compose:
    """`COMMAND -f FILE up --detach --no-recreate --no-deps --scale SERVICE=N SERVICE`. A group is
    its compose service (`expert-<name>`)."""

    def __init__(self, compose_file: Path, command: str = "docker compose") -> None:
        self.compose_file, self.command = compose_file, shlex.split(command)

    def scale(self, group: str, replicas: int) -> None:
        argv = [*self.command, "-f", str(self.compose_file), "up", "--detach", "--no-recreate"]
        argv += ["--no-deps", "--scale", f"{group}={replicas}", group]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=SCALE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UnavailableError(f"{shlex.join(argv)}: {e}") from None
        if done.returncode:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UnavailableError(f"{shlex.join(argv)} exited {done.returncode}: {last[0]}")
