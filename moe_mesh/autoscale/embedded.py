"""`up --autoscale`: the control loop on a thread of the launcher, scaling through the launcher
itself (no control socket), its decisions in RUN_DIR/autoscale.jsonl and on the launcher's output,
its metrics on a loopback port the ready file names (`metrics.autoscaler`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Protocol

from common import telemetry as tm
from common.errors import UnavailableError
from moe_mesh.autoscale.controller import Controller, summary
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.autoscale.signals import LocalSignals


class Launcher(Protocol):
    endpoints: dict
    stopping: threading.Event  # set by Ctrl-C / SIGTERM

    def scale(self, experts: str, replicas: int) -> dict: ...


class _Through:
    """The launcher as an actuator: its own failures (a replica that would not start, a stop under
    way) are the controller's UnavailableError, logged with the decision."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def scale(self, group: str, replicas: int) -> None:
        if self.launcher.stopping.is_set():
            raise UnavailableError("the mesh is stopping")
        try:
            self.launcher.scale(group, replicas)
        except Exception as e:  # noqa: BLE001 - RuntimeError, TimeoutError, Interrupted
            why = str(e) or ("the mesh is stopping" if self.launcher.stopping.is_set() else repr(e))
            raise UnavailableError(f"scaling {group} to {replicas}: {why}") from None


class Embedded:
    """Made before the mesh starts (the ready file names its log and metrics from the first
    write), started once it serves: its groups are the expert services `up` started."""

    def __init__(self, launcher: Launcher, policy: Autoscale, run_dir: Path, say) -> None:
        self.launcher, self.policy, self.say = launcher, policy, say
        self.log_path = run_dir / "autoscale.jsonl"
        self.telemetry = tm.Telemetry.create("autoscaler", metrics_port=0)
        self.endpoints = {"log": str(self.log_path), "metrics": self.telemetry.metrics_address}
        self._log = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "a", buffering=1)  # noqa: SIM115 - closed by stop()
        launcher, policy = self.launcher, self.policy

        def log(entry: dict) -> None:
            self._log.write(json.dumps(entry) + "\n")
            if line := summary(entry):
                self.say(line)

        groups = {e["experts"]: policy for e in launcher.endpoints.get("experts", [])}
        signals = LocalSignals(lambda: dict(launcher.endpoints), policy.rate_window_s)
        controller = Controller(groups, signals, _Through(launcher), log, self.telemetry)
        self._thread = threading.Thread(
            target=controller.run, args=(self._stop,), name="autoscaler", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Before the mesh stops: a scale-up under way gives up (the launcher is stopping)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.telemetry.shutdown()
        if self._log is not None:
            self._log.close()
