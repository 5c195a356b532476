"""`moe-mesh up` and `moe-mesh scale`: a whole mesh of processes on this machine, and its expert replicas."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from moe_mesh.common.cli import add_settings_arguments, flag
from moe_mesh.gateway.settings import GatewaySettings
from moe_mesh.router_service.settings import RouterSettings

GATEWAY_FLAGS = ("max_in_flight", "max_queued")
ROUTER_FLAGS = ("max_num_seqs", "colocate_budget")


def _pass_through(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [
        f for name in names if (v := getattr(args, name)) is not None for f in (flag(name), str(v))
    ]


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    _add_up(subparsers)
    _add_scale(subparsers)


def _add_up(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a whole mesh on this machine",
        description="Start expert services, router(s) and the gateway as separate "
        "processes on loopback; Ctrl-C or SIGTERM stops them all.",
    )
    p.add_argument(
        "--checkpoint", required=True, type=Path, help="HuggingFace-layout checkpoint directory"
    )
    p.add_argument(
        "--expert-services",
        type=int,
        default=4,
        help="expert groups, each its own service (default 4); 0 runs no expert service and "
        "colocates every expert in the routers (the monolithic mesh)",
    )
    p.add_argument(
        "--replicas", type=int, default=1, help="replicas of every expert group (default 1)"
    )
    p.add_argument("--routers", type=int, default=1, help="router replicas (default 1)")
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write the endpoints (gateway_grpc, gateway_http, routers, experts) as JSON here",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where child logs go (default .cache/mesh-<time>)",
    )
    # Passed through to the gateway and routers: declared once, by their settings models.
    add_settings_arguments(p, GatewaySettings, only=GATEWAY_FLAGS)
    add_settings_arguments(p, RouterSettings, only=ROUTER_FLAGS)
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAGS",
        help="more `serve-router` flags for every router, split like a shell does, e.g. "
        "--router-arg='--fast-path off' (repeatable)",
    )
    p.add_argument(
        "--trace-sample",
        type=float,
        default=None,
        metavar="RATIO",
        help="trace this share of requests (0-1) into RUN_DIR/<service>.spans.jsonl, for `moe-mesh "
        "trace show` (default: no traces; OTLP export follows the OTEL_* variables)",
    )
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    import time as _time

    from moe_mesh.local.launcher import run_up

    gateway_args = _pass_through(args, GATEWAY_FLAGS)
    router_args = _pass_through(args, ROUTER_FLAGS) + [
        word for text in args.router_arg for word in shlex.split(text)
    ]
    run_dir = args.run_dir or Path(".cache") / f"mesh-{_time.strftime('%Y%m%d-%H%M%S')}"
    if args.trace_sample is not None and not 0 <= args.trace_sample <= 1:
        print(
            f"moe-mesh up: error: --trace-sample must be in [0, 1], got {args.trace_sample}",
            file=sys.stderr,
        )
        return 2
    if args.expert_services < 0:
        print(
            f"moe-mesh up: error: --expert-services must be >= 0, got {args.expert_services}",
            file=sys.stderr,
        )
        return 2
    return run_up(
        args.checkpoint,
        args.expert_services,
        args.replicas,
        args.routers,
        args.ready_file,
        run_dir,
        gateway_args,
        router_args,
        args.trace_sample,
    )


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "scale",
        help="add or remove expert-service processes of a running local mesh",
        description="Run exactly --replicas expert-service processes serving --experts "
        "in a mesh started by `moe-mesh up` (0 removes them).",
    )
    p.add_argument(
        "--ready-file", type=Path, required=True, help="the file `moe-mesh up --ready-file` wrote"
    )
    p.add_argument("--experts", required=True, help="expert spec of the group, e.g. '*:0-1'")
    p.add_argument(
        "--replicas", type=int, required=True, help="processes that should serve it (>= 0)"
    )
    p.set_defaults(func=_run_scale)


def _run_scale(args: argparse.Namespace) -> int:
    import socket

    if not args.ready_file.exists():
        print(
            f"moe-mesh scale: error: {args.ready_file} does not exist (is the mesh up?)",
            file=sys.stderr,
        )
        return 2
    host, _, port = json.loads(args.ready_file.read_text())["control"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=300) as conn:
        conn.sendall(
            (json.dumps({"experts": args.experts, "replicas": args.replicas}) + "\n").encode()
        )
        reply = json.loads(conn.makefile().readline())
    if "error" in reply:
        print(f"moe-mesh scale: error: {reply['error']}", file=sys.stderr)
        return 2
    print(json.dumps(reply))
    return 0
