"""`moe-mesh up`: a whole mesh on this machine, every service its own process on loopback.

Expert services start first (experts split into groups by index, each group replicated), then
routers pointed at them, then the gateway pointed at the routers. Each child writes a ready file
once it serves; the launcher waits for all (bounded), prints the endpoints, writes them as JSON,
and then watches: a child that exits is reported at once. Ctrl-C / SIGTERM stops everything,
gateway first, experts last, each with SIGTERM (graceful drain) and SIGKILL after a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.arch import load_spec

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0


@dataclass
class Child:
    role: str  # "expert" | "router" | "gateway"
    name: str
    proc: subprocess.Popen
    ready_file: Path
    log_path: Path
    info: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.name} (pid {self.proc.pid}, log {self.log_path})"


def expert_groups(num_experts: int, services: int) -> list[str]:
    """Split expert indices into `services` contiguous groups, every MoE layer alike: '*:0-1', '*:2-3', ..."""
    services = max(1, min(services, num_experts))
    bounds = [round(i * num_experts / services) for i in range(services + 1)]
    return [f"*:{a}-{b - 1}" if b - 1 > a else f"*:{a}" for a, b in zip(bounds, bounds[1:])]


class Launcher:
    def __init__(self, checkpoint: Path, run_dir: Path, expert_services: int, replicas: int, routers: int,
                 gateway_args: list[str], router_args: list[str]) -> None:
        self.checkpoint, self.run_dir = checkpoint, run_dir
        self.expert_services, self.replicas, self.routers = expert_services, replicas, routers
        self.gateway_args, self.router_args = gateway_args, router_args
        self.children: list[Child] = []
        run_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, role: str, name: str, module: str, args: list[str]) -> Child:
        ready = self.run_dir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", module, *args, "--ready-file", str(ready)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child = Child(role, name, proc, ready, log_path)
        self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(children)
        while pending:
            for c in list(pending):
                if c.ready_file.exists():
                    c.info = json.loads(c.ready_file.read_text())
                    pending.remove(c)
                elif c.proc.poll() is not None:
                    raise RuntimeError(f"{c.describe()} exited with code {c.proc.returncode} while starting:\n"
                                       f"{_tail(c.log_path)}")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {READY_TIMEOUT_S:.0f}s: {', '.join(c.name for c in pending)}")
            time.sleep(0.05)

    def start(self) -> dict:
        spec = load_spec(self.checkpoint)
        groups = expert_groups(spec.num_experts, self.expert_services)
        total = len(groups) * self.replicas + self.routers
        # Share the cores instead of every process assuming it owns them all (see common/runtime.py).
        threads = str(max(1, (os.cpu_count() or 1) // total))
        ckpt = ["--checkpoint", str(self.checkpoint)]
        experts = [self._spawn("expert", f"expert-{g}-{r}", "expert_service",
                               [*ckpt, "--experts", spec_, "--compute-threads", threads])
                   for g, spec_ in enumerate(groups) for r in range(self.replicas)]
        print(f"==> starting {len(experts)} expert services ({len(groups)} groups x {self.replicas} replicas)",
              flush=True)
        self._wait_ready(experts)
        expert_flags = [f for c in experts for f in ("--expert", c.info["address"])]
        routers = [self._spawn("router", f"router-{i}", "router_service",
                               [*ckpt, *expert_flags, *self.router_args]) for i in range(self.routers)]
        print(f"==> starting {len(routers)} router(s)", flush=True)
        self._wait_ready(routers)
        gateway = self._spawn("gateway", "gateway", "gateway",
                              [*ckpt, *(f for c in routers for f in ("--router", c.info["address"])),
                               *self.gateway_args])
        print("==> starting the gateway", flush=True)
        self._wait_ready([gateway])
        return {
            "gateway_grpc": gateway.info["address"], "gateway_http": gateway.info["http_address"],
            "routers": [c.info["address"] for c in routers],
            "experts": [{"address": c.info["address"], "experts": c.info.get("experts", ""), "pid": c.proc.pid}
                        for c in experts],
            "pids": {c.name: c.proc.pid for c in self.children}, "run_dir": str(self.run_dir),
            "checkpoint": str(self.checkpoint),
        }

    def watch(self, stop: list[bool]) -> None:
        """Report children that exit; return when asked to stop or when the gateway or every router is gone."""
        reported: set[str] = set()
        while not stop[0]:
            for c in self.children:
                if c.name not in reported and c.proc.poll() is not None:
                    reported.add(c.name)
                    print(f"!!> {c.role} {c.describe()} exited with code {c.proc.returncode}:\n{_tail(c.log_path)}",
                          file=sys.stderr, flush=True)
            gone = {c.role for c in self.children if c.proc.poll() is not None}
            if "gateway" in gone or all(c.proc.poll() is not None for c in self.children if c.role == "router"):
                print("!!> the mesh cannot serve any more; stopping", file=sys.stderr, flush=True)
                return
            time.sleep(0.2)

    def stop(self) -> None:
        for role in ("gateway", "router", "expert"):
            group = [c for c in self.children if c.role == role and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    c.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    print(f"!!> {c.describe()} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it", file=sys.stderr)
                    c.proc.kill()
                    c.proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join("    " + line for line in path.read_text().splitlines()[-lines:])
    except OSError:
        return "    (no log)"


def run_up(checkpoint: Path, expert_services: int, replicas: int, routers: int, ready_file: Path | None,
           run_dir: Path, gateway_args: list[str], router_args: list[str]) -> int:
    launcher = Launcher(checkpoint, run_dir, expert_services, replicas, routers, gateway_args, router_args)
    stop = [False]

    def on_signal(signum, frame) -> None:
        stop[0] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        endpoints = launcher.start()
        print(f"==> mesh up (logs in {run_dir})")
        print(f"    gateway gRPC   {endpoints['gateway_grpc']}")
        print(f"    gateway HTTP   http://{endpoints['gateway_http']}/v1   (OpenAI-compatible)")
        for r in endpoints["routers"]:
            print(f"    router         {r}")
        for e in endpoints["experts"]:
            print(f"    expert service {e['address']}  experts {e['experts']}")
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(endpoints, indent=2))
            os.replace(tmp, ready_file)
        print("==> serving; Ctrl-C to stop", flush=True)
        launcher.watch(stop)
        return 0 if stop[0] else 1
    except (RuntimeError, TimeoutError) as e:
        print(f"moe-mesh up: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("==> stopping the mesh", flush=True)
        launcher.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
