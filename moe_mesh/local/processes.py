"""Meshes and services as subprocesses, for benchmarks and tests: `moe-mesh up` as a context manager,
and single services (`python -m expert_service ...`) waited for through their ready files.

`running_up` starts `up` in a session of its own (its process group holds only what it started),
waits for its ready file (bounded), and on the way out sends `up` SIGTERM (it drains gateway, routers
and experts in order) and SIGKILLs the whole group after a bound.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common import runtime
from common.errors import UnavailableError

UP = (sys.executable, "-m", "moe_mesh", "up")
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0  # `up` gives each of its three roles 20 s to drain
POLL_S = 0.1


class UpExited(UnavailableError):
    """`up` exited before its mesh was ready; `returncode` 2 means it refused its flags."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass
class RunningMesh:
    """A started `moe-mesh up`: its process, ready file (read once ready) and log."""

    proc: subprocess.Popen
    ready_file: Path
    log_path: Path
    info: dict = field(default_factory=dict)  # the ready file's contents

    @property
    def pids(self) -> dict[str, int]:
        return dict(self.info.get("pids", {}))


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log, indented, for an error message."""
    try:
        return "\n".join("    " + x for x in path.read_text().splitlines()[-lines:])
    except OSError:
        return "    (no log)"


@contextmanager
def running_up(
    checkpoint: Path,
    flags: Sequence[str] = (),
    *,
    ready_file: Path,
    run_dir: Path,
    log_path: Path,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    command: Sequence[str] = UP,
) -> Iterator[RunningMesh]:
    """`moe-mesh up --checkpoint C --ready-file F --run-dir D FLAGS`, yielded once its ready file is
    written; stopped (`stop`) on the way out. UpExited when it exits first (its log's tail in the
    message), UnavailableError when it is not ready within `ready_timeout_s`."""
    ready_file.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [*command, "--checkpoint", str(checkpoint), "--ready-file", str(ready_file)]
    argv += ["--run-dir", str(run_dir), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    mesh = RunningMesh(proc, ready_file, log_path)
    try:
        _wait_ready(mesh, flags, ready_timeout_s)
        yield mesh
    finally:
        stop(proc, stop_timeout_s)


def _wait_ready(mesh: RunningMesh, flags: Sequence[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not mesh.ready_file.exists():  # written atomically (moe_mesh/ops/ready.py)
        if mesh.proc.poll() is not None:
            raise UpExited(
                f"`moe-mesh up {shlex.join(flags)}` exited with code {mesh.proc.returncode} "
                f"(log {mesh.log_path}):\n{tail(mesh.log_path)}",
                mesh.proc.returncode,
            )
        if time.monotonic() > deadline:
            raise UnavailableError(
                f"`moe-mesh up {shlex.join(flags)}` not serving after {timeout_s:g}s "
                f"(log {mesh.log_path})"
            )
        time.sleep(POLL_S)
    mesh.info = json.loads(mesh.ready_file.read_text())


def stop(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM `proc` (a session leader); after `timeout_s`, SIGKILL its whole process group.
    It is not reaped before the kill, so its pid (the group's id) cannot have been reused."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


class ServiceProcess:
    """`python -m <module> ... --ready-file F`, waited for until it has written F."""

    def __init__(
        self,
        module: str,
        args: list[str],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: variables set on top of this process's environment (e.g. UCX_TLS)."""
        self.name = name
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)  # a previous run's would read as ready at once
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(self.ready_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Services started here share the cores with each other and with their caller.
            env=runtime.shared_cores_env({**os.environ, **(env or {})}),
        )
        self.address = ""
        self.ready: dict = {}  # the ready file's contents

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)
        self.ready = json.loads(self.ready_file.read_text())
        self.address = self.ready["address"]
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM (SIGCONT first in case it was paused); `stop` waits for the exit."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited in time."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def stop_all(procs: list[ServiceProcess]) -> None:
    """Stop several at once: each takes ~0.5 s to shut down, most of it waiting."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()


def start_experts(
    checkpoint: Path,
    specs: list[str],
    workdir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> list[ServiceProcess]:
    """One expert-service process per spec, started together, returned once all are ready (each
    within `ready_timeout_s` of the last: services loading GBs of experts on shared cores take
    longer)."""
    # One torch thread each: several services share this host's cores (see bench/mesh_dispatch.py).
    procs = [
        ServiceProcess(
            "expert_service",
            ["--checkpoint", str(checkpoint), "--experts", spec, "--compute-threads", "1", *extra],
            workdir,
            f"expert{i}",
            env,
        )
        for i, spec in enumerate(specs)
    ]
    try:
        return [p.wait_ready(ready_timeout_s) for p in procs]
    except Exception:
        stop_all(procs)
        raise
