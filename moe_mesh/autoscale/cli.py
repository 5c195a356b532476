"""`moe-mesh autoscale`: scale a running mesh's expert groups on their measured load until Ctrl-C.

Two kinds of mesh:
  --ready-file F                 a mesh `moe-mesh up` started: every group it runs (an expert spec
                                 each), with the policy the flags give; replicas are started and
                                 retired through its launcher (`up --autoscale` runs the same loop
                                 inside the launcher)
  --compose-file F --plan P      a compose project rendered from plan P: the groups that have an
     --prometheus URL            `autoscale:` block, with their own policies, measured through the
                                 project's Prometheus and scaled with `docker compose up --scale`
Kubernetes and Nomad scale with their own autoscalers (`deploy render` writes their objects).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import typing
from pathlib import Path

from pydantic import Field

from common import telemetry as tm
from common.cli import add_settings_arguments, settings_from_args
from common.errors import InvalidArgumentError
from moe_mesh.autoscale.actuators import Compose, LocalMesh
from moe_mesh.autoscale.controller import Controller, summary
from moe_mesh.autoscale.policy import Autoscale
from moe_mesh.autoscale.signals import LocalSignals, PrometheusSignals
from moe_mesh.ops.ready import read_ready_file

RUN = ("ready_file", "compose_file", "plan", "prometheus", "compose_command")
OUTPUT = ("decisions_file", "metrics_port", "max_duration_s")


class AutoscaleSettings(Autoscale):
    """`moe-mesh autoscale`'s flags: the mesh, where decisions go, and (for a local mesh) the policy
    of every group."""

    ready_file: Path | None = Field(
        None,
        description="a mesh `moe-mesh up --ready-file` started",
        json_schema_extra={"metavar": "FILE"},
    )
    compose_file: Path | None = Field(
        None, description="a compose project `deploy render --target compose` wrote (with --plan "
        "and --prometheus)", json_schema_extra={"metavar": "FILE"}
    )  # fmt: skip
    plan: Path | None = Field(
        None, description="the plan the compose project was rendered from: its groups' autoscale "
        "blocks", json_schema_extra={"metavar": "FILE"}
    )  # fmt: skip
    prometheus: str | None = Field(
        None, description="the Prometheus that scrapes the compose project, e.g. "
        "http://127.0.0.1:9090", json_schema_extra={"metavar": "URL"}
    )  # fmt: skip
    compose_command: str = Field("docker compose", description="how to run compose")
    decisions_file: Path | None = Field(
        None, description="append each decision as a JSON line here instead of stdout",
        json_schema_extra={"metavar": "FILE"},
    )  # fmt: skip
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve the moe_autoscaler_* metrics on this loopback "
        "port (0: any free one)",
    )  # fmt: skip
    max_duration_s: float | None = Field(
        None, gt=0, description="stop after this many seconds; unset: at Ctrl-C"
    )

    def policy(self) -> Autoscale:
        return Autoscale(**{k: getattr(self, k) for k in Autoscale.model_fields})


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "autoscale",
        help="scale a running mesh's expert groups on their measured load",
        description="Scale every expert group between --min-replicas and --max-replicas to hold "
        "--target load per replica (HPA's algorithm: tolerance, stabilization windows, step "
        "limits), logging each decision as a JSON line (docs/operating/autoscaling.md).",
    )
    where = p.add_argument_group("the mesh")
    add_settings_arguments(where, AutoscaleSettings, only=RUN)
    add_settings_arguments(p.add_argument_group("output"), AutoscaleSettings, only=OUTPUT)
    policy = p.add_argument_group("policy of every group of a local mesh (a plan has its own)")
    add_settings_arguments(policy, AutoscaleSettings, only=list(Autoscale.model_fields))
    p.set_defaults(func=run_autoscale)


def controller_for(s: AutoscaleSettings, log, telemetry: tm.Telemetry = tm.OFF) -> Controller:
    """The controller the flags describe; InvalidArgumentError naming the flag that is wrong."""
    if (s.ready_file is None) == (s.compose_file is None):
        both = ", not both" if s.ready_file else ""
        raise InvalidArgumentError(
            "--ready-file", f"give a local mesh's --ready-file or a --compose-file{both}"
        )
    if problem := s.policy().problem():
        raise InvalidArgumentError("--target", problem.removeprefix("target: "))
    if s.ready_file is not None:
        if s.plan or s.prometheus:  # a local mesh's groups are its expert specs, not the plan's
            raise InvalidArgumentError("--plan", "--plan and --prometheus go with --compose-file")
        path = s.ready_file
        mesh = read_ready_file(path, "experts", "control")
        groups = {e["experts"]: s.policy() for e in mesh["experts"]}
        if not groups:
            raise InvalidArgumentError("--ready-file", f"{path} names no expert service to scale")
        signals = LocalSignals(lambda: read_ready_file(path, "experts"), s.policy().rate_window_s)
        return Controller(groups, signals, LocalMesh(path), log, telemetry)
    if s.plan is None or s.prometheus is None:
        raise InvalidArgumentError("--compose-file", "needs --plan and --prometheus")
    from moe_mesh.planning.deploy import EXPERT_SERVICE_PREFIX, PlanError, load_plan

    try:
        plan = load_plan(s.plan)
    except PlanError as e:  # the command's input is wrong: exit 2, as `deploy render` does
        raise InvalidArgumentError("--plan", str(e)) from None
    policies = {
        EXPERT_SERVICE_PREFIX + g.name: g.autoscale for g in plan.expert_groups if g.autoscale
    }
    if not policies:
        raise InvalidArgumentError("--plan", f"{s.plan} gives no expert group an autoscale block")
    jobs = {service: service for service in policies}  # compose's Prometheus job per service
    window = min(p.rate_window_s for p in policies.values())
    signals = PrometheusSignals(s.prometheus, window, jobs, gateway_job="gateway")
    return Controller(
        typing.cast(dict, policies),
        signals,
        Compose(s.compose_file, s.compose_command),
        log,
        telemetry,
    )


def run_autoscale(args: argparse.Namespace) -> int:
    s = typing.cast(AutoscaleSettings, settings_from_args(AutoscaleSettings, args))
    try:
        out = open(s.decisions_file, "a", buffering=1) if s.decisions_file else sys.stdout  # noqa: SIM115
    except OSError as e:
        raise InvalidArgumentError(
            "--decisions-file", f"{s.decisions_file}: {e.strerror}"
        ) from None
    telemetry = tm.Telemetry.create("autoscaler", metrics_port=s.metrics_port)

    def log(entry: dict) -> None:
        out.write(json.dumps(entry) + "\n")
        if out is not sys.stdout and (line := summary(entry)):  # changes on the terminal too
            print(line, file=sys.stderr, flush=True)

    try:  # errors and Ctrl-C end it as every command (moe_mesh/cli.py main)
        controller = controller_for(s, log, telemetry)
        if telemetry.metrics_address:
            print(
                f"==> autoscaler metrics on http://{telemetry.metrics_address}/metrics",
                file=sys.stderr,
            )
        print(f"==> autoscaling {', '.join(controller.groups)}; Ctrl-C to stop", file=sys.stderr)
        controller.run(threading.Event(), s.max_duration_s)
    finally:
        telemetry.shutdown()
        if out is not sys.stdout:
            out.close()
    return 0
