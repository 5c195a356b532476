"""`moe-mesh up`: a whole mesh on this machine, every service its own process on loopback.

The launcher hosts the embedded registry (a Consul-compatible server, no external process) on a
background event loop; every child registers in it or follows it. Expert services start first
(experts split into groups by index, each group replicated), then routers, which discover the
expert services live, then the gateway, which discovers the routers. With no expert services the
routers colocate every expert (the monolithic mesh). Each child writes a ready
file once it serves; the launcher waits for all (bounded), prints the endpoints, writes them as
JSON (the ready file), and then watches: a child that exits is reported at once and leaves the
ready file. `moe-mesh scale` asks the launcher's loopback control endpoint to add or remove
expert-service processes; scale operations run one at a time, each sets an absolute replica count
(so repeating one changes nothing), and the ready file follows them, which is what `moe-mesh
status` reads. Ctrl-C / SIGTERM stops everything, gateway first, experts last, each with SIGTERM
(graceful drain) and SIGKILL after a timeout; so does a closed stdout. However the launcher itself
ends, SIGKILL included, its children end with it (they watch it: common/runtime.die_with_parent).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import runtime
from common.arch import load_spec
from common.placement import format_experts, parse_experts
from common.server import write_ready_file
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.local import certs, scaling
from moe_mesh.local.processes import tail
from moe_mesh.local.terminal import say, silence_stdout, stdout_closed

READY_TIMEOUT_S = 180.0
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
EXIT_BROKEN_PIPE = 141  # stdout's reader went away, as a shell reports SIGPIPE
STOP_TIMEOUT_S = 20.0


@dataclass
class Child:
    role: str  # "expert" | "router" | "gateway"
    name: str
    proc: subprocess.Popen
    ready_file: Path
    log_path: Path
    info: dict = field(default_factory=dict)
    retired: bool = False  # stopped on purpose by `moe-mesh scale`: its exit is not news

    def describe(self) -> str:
        return f"{self.name} (pid {self.proc.pid}, log {self.log_path})"


def expert_groups(num_experts: int, services: int) -> list[str]:
    """Split expert indices into `services` contiguous groups, every MoE layer alike: '*:0-1', '*:2-3', ..."""
    services = max(1, min(services, num_experts))
    bounds = [round(i * num_experts / services) for i in range(services + 1)]
    return [f"*:{a}-{b - 1}" if b - 1 > a else f"*:{a}" for a, b in zip(bounds, bounds[1:])]


class Launcher:
    def __init__(
        self,
        checkpoint: Path,
        run_dir: Path,
        expert_services: int,
        replicas: int,
        routers: int,
        gateway_args: list[str],
        router_args: list[str],
        trace_sample: float | None = None,
        ready_file: Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        tls_dir: Path | None = None,
        expert_args: list[str] | None = None,
    ) -> None:
        # Absolute: the ready file names them, and its readers run from other directories.
        checkpoint, run_dir = checkpoint.resolve(), run_dir.resolve()
        self.tls_dir = tls_dir and tls_dir.resolve()  # mutual TLS everywhere, certificates there
        self.expert_args = expert_args or []  # more serve-expert flags for every expert service
        self.checkpoint, self.run_dir, self.trace_sample = checkpoint, run_dir, trace_sample
        self.expert_services, self.replicas, self.routers = expert_services, replicas, routers
        self.gateway_args, self.router_args = gateway_args, router_args
        self.ready_file, self.ready_timeout_s = ready_file, ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.children: list[Child] = []
        self.endpoints: dict = {}
        self.extra: dict = {}  # more for the ready file (the autoscaler's log and metrics)
        self.spec = load_spec(checkpoint)
        self._lock = threading.Lock()  # children change from the control endpoint's thread too
        # One scale at a time: two interleaved ones would each count the replicas before the other's
        # changes landed, and the later request would be lost.
        self._scale_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="launcher-loop", daemon=True
        )
        self._registry = None
        self._control_server: asyncio.Server | None = None
        self.registry_address = ""
        self.control_address = ""
        self._threads = "1"
        self._serial = 0
        # Set by Ctrl-C / SIGTERM: start-up gives up at once instead of reporting the children that
        # the same Ctrl-C stopped as crashes.
        self.stopping = threading.Event()
        run_dir.mkdir(parents=True, exist_ok=True)

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start_services(self) -> tuple[str, str]:
        from moe_mesh.local.registry import EmbeddedConsul

        # Its health checks present a mesh certificate, as Consul's enable_agent_tls_for_checks.
        self._registry = EmbeddedConsul(
            tls=certs.mesh_tls(self.tls_dir, "registry") if self.tls_dir else None
        )
        registry = await self._registry.start()
        self._control_server = control = await asyncio.start_server(
            lambda r, w: scaling.control(r, w, self.scale), "127.0.0.1", 0
        )
        host, port = control.sockets[0].getsockname()[:2]
        return registry, f"{host}:{port}"

    def _expert_child(self, spec: str) -> Child:
        self._serial += 1
        return self._spawn(
            "expert",
            f"expert-{self._serial}",
            [
                "-m",
                "expert_service",
                "--checkpoint",
                str(self.checkpoint),
                "--experts",
                spec,
                "--compute-threads",
                self._threads,
                "--registry",
                "consul",
                *self._tls_args("expert"),
                *self.expert_args,
            ],
        )

    def _tls_args(self, service: str) -> list[str]:
        return certs.flags(self.tls_dir, service) if self.tls_dir else []

    def scale(self, experts: str, replicas: int, force: bool = False) -> dict:
        """Run exactly `replicas` expert-service processes serving `experts` (0 removes them all).
        A scale-down that leaves some expert with no replica raises scaling.OnlyCopyError unless
        `force`; the replicas stopped drain their calls either way."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        want = format_experts(parse_experts(experts, self.spec))
        with self._scale_lock:
            with self._lock:
                live = [c for c in self.children if c.proc.poll() is None and not c.retired]
            serving = [c for c in live if c.role == "expert" and c.info.get("experts") == want]
            if replicas < len(serving) and not force:
                kept = [e for c in live if c.role == "expert" and (e := c.info.get("experts"))]
                kept = [k for k in kept if k != want] + [want] * replicas
                routers = [c.info["address"] for c in live if c.role == "router" and c.info]
                colocated = self._on_loop(scaling.colocated_specs(routers, self.endpoints))
                scaling.check_copies(self.spec, want, kept, colocated)
            added = [self._expert_child(experts) for _ in range(replicas - len(serving))]
            try:
                self._wait_ready(added)
            except (RuntimeError, TimeoutError):
                self._retire(added)  # half a scale-up must not linger as unready processes
                raise
            removed = serving[replicas:] if replicas < len(serving) else []
            self._retire(removed)
            self.publish()
        return {
            "experts": want,
            "replicas": replicas,
            "added": [c.info["address"] for c in added],
            "removed": [c.info["address"] for c in removed],
        }

    def _retire(self, children: list[Child]) -> None:
        """Stop children on purpose (their exit is not news): SIGTERM to drain, SIGKILL after the timeout."""
        for c in children:
            c.retired = True
        self._terminate(children)

    def stop_registry(self) -> None:
        """Stop the embedded registry (services keep serving from their last known membership)."""
        self._on_loop(self._registry.stop())

    def _spawn(self, role: str, name: str, argv: list[str]) -> Child:
        """Start `python argv... --metrics-port 0 [tracing] --ready-file F` with its output in a log file."""
        ready = self.run_dir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log_path = self.run_dir / f"{name}.log"
        # Router and expert services share this host's cores (common/runtime.py).
        env = runtime.shared_cores_env(
            {
                **os.environ,
                "CONSUL_HTTP_ADDR": self.registry_address,
                runtime.PARENT_PID_ENV: str(os.getpid()),
            }
        )
        # Every child serves metrics (for `moe-mesh stats`); with tracing, each writes its own span file.
        telemetry = ["--metrics-port", "0"]
        if self.trace_sample:
            telemetry += [
                "--trace-file",
                str(self.run_dir / f"{name}.spans.jsonl"),
                "--trace-sample",
                str(self.trace_sample),
            ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, *argv, *telemetry, "--ready-file", str(ready)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        child = Child(role, name, proc, ready, log_path)
        with self._lock:
            self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(children)
        while pending:
            if self.stopping.is_set():
                raise Interrupted()
            for c in list(pending):
                if c.ready_file.exists():
                    c.info = json.loads(c.ready_file.read_text())
                    pending.remove(c)
                elif c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.describe()} exited with code {c.proc.returncode} while starting:\n"
                        f"{tail(c.log_path, 15)}"
                    )
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"not ready after {self.ready_timeout_s:g}s: "
                    f"{', '.join(c.describe() for c in pending)}"
                )
            time.sleep(0.05)

    def start_control_plane(self) -> None:
        """The embedded registry and the `scale` endpoint, on the launcher's own event loop thread."""
        if self.tls_dir is not None:
            made = certs.create(self.tls_dir, certs.SERVICES)
            print(f"==> mutual TLS with the certificates in {self.tls_dir} ({len(made)} services)")
        self._thread.start()
        self.registry_address, self.control_address = self._on_loop(self._start_services())

    def start(self) -> dict:
        self.start_control_plane()
        # No expert services: the monolithic mesh, every expert colocated in each router.
        groups = (
            expert_groups(self.spec.num_experts, self.expert_services)
            if self.expert_services
            else []
        )
        monolithic = [] if groups else ["--colocate", "*:*"]
        total = len(groups) * self.replicas + self.routers
        # Share the cores instead of every process assuming it owns them all (see common/runtime.py).
        self._threads = str(max(1, (os.cpu_count() or 1) // total))
        ckpt = ["--checkpoint", str(self.checkpoint), "--registry", "consul"]
        experts = [self._expert_child(g) for g in groups for _ in range(self.replicas)]
        print(
            f"==> embedded registry on {self.registry_address}; starting {len(experts)} expert services "
            f"({len(groups)} groups x {self.replicas} replicas)",
            flush=True,
        )
        # All at once: routers load their dense weights while the experts load theirs, each
        # waiting in the registry for what it needs (for as long as `up` waits for all of them).
        wait = ["--connect-timeout-s", f"{self.ready_timeout_s:g}"]
        tls = self._tls_args("router")
        argv = ["-m", "router_service", *ckpt, *monolithic, *wait, *tls, *self.router_args]
        routers = [self._spawn("router", f"router-{i}", argv) for i in range(self.routers)]
        print(f"==> starting {len(routers)} router(s)", flush=True)
        gateway = self._spawn(
            "gateway",
            "gateway",
            ["-m", "gateway", *ckpt, *wait, *self._tls_args("gateway"), *self.gateway_args],
        )
        print("==> starting the gateway", flush=True)
        self._wait_ready([*experts, *routers, gateway])
        self.endpoints = {
            "gateway_grpc": gateway.info["address"],
            "gateway_http": gateway.info["http_address"],
            "metrics": {"gateway": gateway.info.get("metrics")},  # publish() adds the rest
            "trace_files": [str(self.run_dir / f"{c.name}.spans.jsonl") for c in self.children]
            if self.trace_sample
            else [],
            "checkpoint": str(self.checkpoint),
            "registry": self.registry_address,
            "control": self.control_address,
            "run_dir": str(self.run_dir),
            **self.extra,
        }
        if self.tls_dir is not None:  # what clients of this mesh (status, generate) present
            f = certs.files(self.tls_dir, "client")
            self.endpoints["tls"] = {"ca": str(f.ca), "cert": str(f.cert), "key": str(f.key)}
        self.publish()
        return self.endpoints

    def publish(self) -> None:
        """Refresh the routers, expert services and pids in `endpoints` from the live children and
        rewrite the ready file (atomically), so `moe-mesh status` follows scale operations and
        deaths."""
        with self._lock:
            live = [c for c in self.children if c.proc.poll() is None and not c.retired]
        # c.info is empty until the child is ready
        experts = [c for c in live if c.role == "expert" and c.info]
        routers = [c for c in live if c.role == "router" and c.info]
        self.endpoints["routers"] = [c.info["address"] for c in routers]
        self.endpoints.setdefault("metrics", {})["routers"] = [
            c.info.get("metrics") for c in routers
        ]
        self.endpoints.update(
            experts=[
                {
                    "address": c.info["address"],
                    "experts": c.info.get("experts", ""),
                    "pid": c.proc.pid,
                }
                for c in experts
            ],
            pids={c.name: c.proc.pid for c in live},
        )
        self.endpoints.setdefault("metrics", {})["experts"] = [
            c.info.get("metrics") for c in experts
        ]
        if self.ready_file is not None:
            self.ready_file.parent.mkdir(parents=True, exist_ok=True)
            write_ready_file(self.ready_file, self.endpoints, indent=2)

    def watch(self, stop: list) -> bool:
        """Report children that exit; return when asked to stop, when the gateway or every router is
        gone, or when stdout's reader has gone (then True)."""
        reported: set[str] = set()
        while not stop[0]:
            if stdout_closed():
                print("!!> stdout was closed; stopping the mesh", file=sys.stderr, flush=True)
                silence_stdout()
                return True
            with self._lock:
                children = list(self.children)
            died = [
                c
                for c in children
                if c.name not in reported and not c.retired and c.proc.poll() is not None
            ]
            for c in died:
                reported.add(c.name)
                print(
                    f"!!> {c.role} {c.describe()} exited with code {c.proc.returncode}:\n{tail(c.log_path, 15)}",
                    file=sys.stderr,
                    flush=True,
                )
            if died:
                with (
                    self._scale_lock
                ):  # a scale in progress publishes too; do not interleave the writes
                    self.publish()
            gone = {c.role for c in children if c.proc.poll() is not None and not c.retired}
            if "gateway" in gone or all(
                c.proc.poll() is not None for c in children if c.role == "router"
            ):
                print("!!> the mesh cannot serve any more; stopping", file=sys.stderr, flush=True)
                return False
            time.sleep(0.2)
        return False

    def _terminate(self, children: list[Child]) -> None:
        group = [c for c in children if c.proc.poll() is None]
        for c in group:
            c.proc.send_signal(signal.SIGTERM)  # graceful: NOT_SERVING, deregister, drain, exit
        deadline = time.monotonic() + self.stop_timeout_s
        for c in group:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"!!> {c.describe()} did not stop in {self.stop_timeout_s:g}s; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                c.proc.kill()
                c.proc.wait()

    def stop(self) -> None:
        for role in ("gateway", "router", "expert"):
            self._terminate([c for c in self.children if c.role == role])
        if self._thread.is_alive():
            if self._registry is not None:
                self._on_loop(self._registry.stop())
            if self._control_server is not None:
                self._control_server.close()
                self._on_loop(self._control_server.wait_closed())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived while the mesh was starting."""


def run_up(
    checkpoint: Path,
    expert_services: int,
    replicas: int,
    routers: int,
    ready_file: Path | None,
    run_dir: Path,
    gateway_args: list[str],
    router_args: list[str],
    trace_sample: float | None = None,
    tls_dir: Path | None = None,
    expert_args: list[str] | None = None,
    autoscale: Autoscale | None = None,
) -> int:
    launcher = Launcher(
        checkpoint, run_dir, expert_services, replicas, routers, gateway_args, router_args,
        trace_sample, ready_file, tls_dir=tls_dir, expert_args=expert_args,
    )  # fmt: skip
    stop: list = [False]

    def on_signal(signum, frame) -> None:
        stop[0] = signum
        launcher.stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code, autoscaler = 1, None
    try:
        if autoscale is not None:  # every group between its bounds, once the mesh serves
            from moe_mesh.autoscale.embedded import Embedded

            autoscaler = Embedded(launcher, autoscale, run_dir, say)
            launcher.extra["autoscaler"] = autoscaler.endpoints
        endpoints = launcher.start()
        if autoscaler is not None:
            autoscaler.start()
        lines = [
            f"==> mesh up (logs in {run_dir})",
            f"    gateway gRPC   {endpoints['gateway_grpc']}",
            f"    gateway HTTP   {'https' if tls_dir else 'http'}://{endpoints['gateway_http']}/v1"
            "   (OpenAI-compatible)",
            *([f"    CA             {endpoints['tls']['ca']}"] if tls_dir else []),
            *(f"    router         {r}" for r in endpoints["routers"]),
            *(
                f"    expert service {e['address']}  experts {e['experts']}"
                for e in endpoints["experts"]
            ),
            *([f"    autoscaler     decisions in {autoscaler.log_path}"] if autoscaler else []),
            "==> serving; Ctrl-C to stop",
        ]
        if not all(say(line) for line in lines):
            return (code := EXIT_BROKEN_PIPE)
        code = EXIT_BROKEN_PIPE if launcher.watch(stop) else 1
    except Interrupted:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"moe-mesh up: error: {e}", file=sys.stderr)
    finally:
        # Stop first: a print to a closed stdout must not skip it.
        say("==> stopping the mesh")
        if autoscaler is not None:
            autoscaler.stop()
        launcher.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if stop[0]:
        return EXIT_INTERRUPTED if stop[0] == signal.SIGINT else 0
    return code
