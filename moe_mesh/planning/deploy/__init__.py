"""`moe-mesh deploy render` and `moe-mesh probe`: real deployments rendered from a plan, and their health probe.

A plan (YAML, see deploy/plan.example.yaml) names the image, the checkpoint, the gateway and router
replicas and the expert groups (an expert spec each, see common/placement.py). `render` turns it into
  compose: one docker-compose.yml (a Consul dev agent, gateway, router, one service per expert group,
           `deploy.replicas` each) and a .env.example (the image: deploy/compose/Dockerfile);
  nomad:   one job per expert group, and one job with the router and gateway groups;
  kubernetes: a Deployment, Service and PodDisruptionBudget per component, the model volume and the
           Job that fills it, discovery's RBAC, the gateway's Ingress (kubernetes.py).
`--image REGISTRY/NAME:TAG` replaces the plan's `image` in every target's files.
Each also gets a Prometheus scrape configuration (prometheus.py).
A group with `autoscale` bounds is scaled on its measured load by the orchestrator's own autoscaler:
  kubernetes: an autoscaling/v2 HorizontalPodAutoscaler on the group's Deployment (which then has
           no `replicas`), fed by the Prometheus Adapter, whose rules are rendered too;
  nomad:   a `scaling` block in the group's job for the Nomad Autoscaler, whose agent configuration
           (nomad-autoscaler.hcl) is rendered too;
  compose: nothing to render: `moe-mesh autoscale` drives `docker compose up --scale`.
The queries are moe_mesh/autoscale/queries.py's, the behaviour the plan's (autoscale/policy.py).
Every service runs with `--registry consul` (kubernetes: `--registry kubernetes` unless the plan's
`kubernetes.discovery` is consul): routers find expert services and gateways find routers there, so
the rendered files list no addresses. Output is deterministic (sorted keys, fixed order),
so committed examples can be compared byte for byte with a fresh render.

Imports neither torch nor grpc at import time: `probe` runs as a container health check every few seconds.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args
from moe_mesh.planning.deploy.compose import (
    EXPERT_SERVICE_PREFIX,
    HEADER,
    render_compose,
)
from moe_mesh.planning.deploy.kubernetes import render_kubernetes
from moe_mesh.planning.deploy.kubernetes_plan import Expose
from moe_mesh.planning.deploy.nomad import AUTOSCALER_CONFIG, Block, Interp, render_nomad
from moe_mesh.planning.deploy.plan import (
    ComposePlan,
    Constraint,
    ExpertGroup,
    GatewayPlan,
    ModelPlan,
    NomadPlan,
    Plan,
    PlanError,
    Resources,
    RouterPlan,
    expert_pairs,
    load_plan,
)
from moe_mesh.planning.deploy.probe import add_probe_subcommand, probe, run_probe

__all__ = [
    "EXPERT_SERVICE_PREFIX",
    "HEADER",
    "TARGETS",
    "Block",
    "ComposePlan",
    "Constraint",
    "ExpertGroup",
    "GatewayPlan",
    "Interp",
    "ModelPlan",
    "NomadPlan",
    "Plan",
    "PlanError",
    "Resources",
    "RouterPlan",
    "add_probe_subcommand",
    "add_subcommand",
    "drifted",
    "expert_pairs",
    "load_plan",
    "main",
    "probe",
    "render",
    "render_compose",
    "render_kubernetes",
    "render_nomad",
    "run_probe",
    "run_render",
    "write_rendered",
]

Target = Literal["compose", "nomad", "kubernetes"]
TARGETS: tuple[str, ...] = typing.get_args(Target)


def render(
    plan: Plan, target: str, image: str | None = None, expose: Expose | None = None
) -> dict[str, str]:
    """File name -> content for `target` ('compose', 'nomad' or 'kubernetes'); `image` (e.g.
    registry.example.com/moe-mesh:0.1.0) instead of the plan's, `expose` instead of the plan's
    `kubernetes.expose`."""
    if image is not None:
        plan = plan.model_copy(update={"image": image})
    if expose is not None:
        k8s = plan.kubernetes.model_copy(update={"expose": expose})
        plan = plan.model_copy(update={"kubernetes": k8s})
    if target == "compose":
        return render_compose(plan)
    if target == "nomad":
        return render_nomad(plan)
    if target == "kubernetes":
        return render_kubernetes(plan)
    raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")


def _rendered_by_us(path: Path) -> bool:
    try:
        with path.open() as f:
            return f.readline().startswith("# Rendered by `moe-mesh deploy render")
    except OSError:
        return False


def _ours(out: Path) -> list[Path]:
    """The nomad files a render may write: job files, and the autoscaler's configuration."""
    return sorted([*out.glob("*.nomad.hcl"), *out.glob(AUTOSCALER_CONFIG)])


def write_rendered(files: dict[str, str], out: Path, target: str) -> list[Path]:
    """Write the files; for nomad also remove job files an earlier render wrote for groups now gone
    (and the autoscaler's configuration once no group autoscales)."""
    out.mkdir(parents=True, exist_ok=True)
    if target == "nomad":
        for stale in _ours(out):
            if stale.name not in files and _rendered_by_us(stale):
                stale.unlink()
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def drifted(files: dict[str, str], out: Path, target: str) -> list[str]:
    """Files in `out` that differ from a fresh render (missing, changed, or stale job files)."""
    bad = [
        name
        for name, text in files.items()
        if not (out / name).is_file() or (out / name).read_text() != text
    ]
    if target == "nomad":
        bad += [p.name for p in _ours(out) if p.name not in files]
    return bad


# ---------------------------------------------------------------------------------------------- CLI


class RenderSettings(BaseModel):
    """`moe-mesh deploy render`'s flags."""

    model_config = ConfigDict(extra="forbid")

    plan: Path = Field(description="plan file (YAML)")
    target: Target = Field(
        description="compose: docker-compose.yml + .env.example + prometheus.yml; "
        "nomad: one job per expert group + one for router and gateway + prometheus.yml "
        "(+ nomad-autoscaler.hcl when a group autoscales); "
        "kubernetes: a Deployment, Service and PodDisruptionBudget per component (+ a "
        "HorizontalPodAutoscaler per autoscaled group and the Prometheus Adapter's rules) + the "
        "model volume and its fill Job + discovery's RBAC + the gateway's Ingress + the "
        "Prometheus ConfigMap"
    )
    out: Path = Field(description="directory to write into (created if missing)")
    image: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$",
        description="the moe-mesh image every service runs, REGISTRY/NAME:TAG (or "
        "NAME@sha256:DIGEST), e.g. after pushing it to the cluster's registry; default: the "
        "plan's `image`",
    )
    expose: Expose | None = Field(
        None,
        description="kubernetes: how clients reach the gateway, instead of the plan's "
        "`kubernetes.expose`: none (ClusterIP), ingress, loadbalancer (Service type LoadBalancer)",
    )
    check: bool = Field(
        False,
        description="write nothing; exit 1 when the files in --out differ from a fresh render",
    )


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `deploy render` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "deploy",
        help="render docker-compose / Nomad / Kubernetes deployments from a plan",
        description="Deployments rendered from a plan file (see deploy/plan.example.yaml).",
    )
    sub = p.add_subparsers(dest="deploy_command", required=True, metavar="COMMAND")
    r = sub.add_parser(
        "render",
        help="render a plan for a target",
        description="Render a plan into docker-compose files, Nomad jobs or Kubernetes manifests. "
        "Every service discovers the others through Consul (Kubernetes: through the API's "
        "EndpointSlices, unless the plan says consul); output is deterministic.",
    )
    add_settings_arguments(r, RenderSettings)
    r.set_defaults(func=run_render)


def run_render(args: argparse.Namespace) -> int:
    prog = "moe-mesh deploy render"
    s = typing.cast(RenderSettings, settings_from_args(RenderSettings, args))
    if s.expose is not None and s.target != "kubernetes":
        print(f"{prog}: error: --expose: only --target kubernetes has it", file=sys.stderr)
        return 2
    try:
        files = render(load_plan(s.plan), s.target, s.image, s.expose)
    except PlanError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if s.check:
        bad = drifted(files, s.out, s.target)
        for name in bad:
            print(f"{prog}: {s.out / name} differs from the render of {s.plan}", file=sys.stderr)
        return 1 if bad else 0
    for path in write_rendered(files, s.out, s.target):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m moe_mesh.planning.deploy {deploy,probe} ...`: the two subcommands without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="moe-mesh")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommand(subparsers)
    add_probe_subcommand(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
