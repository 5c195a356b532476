"""Run moe-mesh services as real subprocesses on loopback for tests; each stops by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import runtime


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
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(self.ready_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Services started here share the cores with each other and with the tests.
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
        """SIGTERM (SIGCONT first in case a test paused it); `stop` waits for the exit."""
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
) -> list[ServiceProcess]:
    """One expert-service process per spec, started together, returned once all are ready."""
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
        return [p.wait_ready() for p in procs]
    except Exception:
        stop_all(procs)
        raise
