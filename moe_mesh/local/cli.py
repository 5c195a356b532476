"""`moe-mesh up` and `moe-mesh scale`: a whole mesh of processes on this machine, and its expert replicas."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from common.cli import add_settings_arguments, flag, settings_from_args
from common.errors import InvalidArgumentError
from common.hub import resolve_checkpoint
from gateway.settings import GatewaySettings
from moe_mesh.ops.ready import read_ready_file
from router_service.settings import RouterSettings

# The gateway's public address (the other services take free loopback ports) and its limits.
GATEWAY_FLAGS = (
    "host",
    "grpc_port",
    "http_port",
    "served_model_name",
    "max_in_flight",
    "max_queued",
    "api_key_file",
)
ROUTER_FLAGS = ("max_num_seqs", "colocate_budget")


def _pass_through(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [] if value is None else [value]:
            out += [flag(name), str(v)]
    return out


class _RouterFlags(argparse.ArgumentParser):
    """The router's parser, reporting a bad flag as one line instead of its whole usage."""

    def error(self, message: str):  # type: ignore[override]
        raise InvalidArgumentError("--router-arg", message)


def _check_flags(args: argparse.Namespace, router_args: list[str]) -> str | None:
    """The first problem with the flags, before any process starts (a child would find it late)."""
    for name, value, low in (
        ("--routers", args.routers, 1),
        ("--replicas", args.replicas, 1),
        ("--expert-services", args.expert_services, 0),
    ):
        if value < low:
            return f"{name} must be >= {low}, got {value}"
    if args.certs_dir is not None and not args.tls:
        return "--certs-dir needs --tls"
    if args.trace_sample is not None and not 0 <= args.trace_sample <= 1:
        return f"--trace-sample must be in [0, 1], got {args.trace_sample}"
    if args.grpc_port and args.grpc_port == args.http_port:
        return f"--grpc-port and --http-port are both {args.grpc_port}: the gateway needs two ports"
    if not (args.checkpoint / "config.json").is_file():
        return f"--checkpoint: {args.checkpoint} has no config.json (not a checkpoint directory)"
    from router_service import cli as router_cli

    # Every router flag, --router-arg's included, through the router's own parser and settings.
    parser = _RouterFlags(add_help=False)
    router_cli.add_arguments(parser)
    gateway = argparse.Namespace(
        checkpoint=args.checkpoint, **{n: getattr(args, n) for n in GATEWAY_FLAGS}
    )
    try:
        router, unknown = parser.parse_known_args(
            ["--checkpoint", str(args.checkpoint), *router_args]
        )
        if unknown:
            return f"--router-arg: unknown router flag(s) {' '.join(unknown)}"
        settings_from_args(GatewaySettings, gateway)
        settings_from_args(RouterSettings, router, flags=router_cli.FLAGS)
    except InvalidArgumentError as e:
        return str(e)
    return None


def _taken_port(args: argparse.Namespace) -> str | None:
    """A fixed gateway port something already listens on (the gateway binds it again later)."""
    from common.server import listen_socket

    host = args.host or GatewaySettings.model_fields["host"].default
    for name, port in (("--grpc-port", args.grpc_port), ("--http-port", args.http_port)):
        if port:
            try:
                listen_socket(host, port, f"the gateway ({name})").close()
            except OSError as e:
                return str(e)
    return None


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
        "--checkpoint",
        required=True,
        type=Path,
        help="HuggingFace-layout checkpoint directory, or a Hugging Face model id (org/name[@rev])",
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
        "--tls",
        action="store_true",
        help="mutual TLS on every connection of the mesh (and TLS on the gateway's public "
        "endpoints), with a CA and certificates `moe-mesh certs` writes into --certs-dir",
    )
    p.add_argument(
        "--certs-dir",
        type=Path,
        default=None,
        help="with --tls: the certificates to use, created there when missing "
        "(default RUN_DIR/certs)",
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
    # Absolute: the ready file names files under it (certificates, logs, spans) that client
    # commands read from wherever they run.
    run_dir = (
        args.run_dir or Path(".cache") / f"mesh-{_time.strftime('%Y%m%d-%H%M%S')}"
    ).absolute()
    args.checkpoint = resolve_checkpoint(args.checkpoint)  # an HF model id: its cached snapshot
    problem = _check_flags(args, router_args)
    if problem:
        print(f"moe-mesh up: error: {problem}", file=sys.stderr)
        return 2
    if problem := _taken_port(args):  # found now rather than after every other service started
        print(f"moe-mesh up: error: {problem}", file=sys.stderr)
        return 1
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
        (args.certs_dir or run_dir / "certs").absolute() if args.tls else None,
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

    host, _, port = read_ready_file(args.ready_file, "control")["control"].rpartition(":")
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
