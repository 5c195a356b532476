"""`moe-mesh probe`: one gRPC health check; imports grpc only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.tls import MeshTls


def probe(
    target: str, service: str = "", timeout_s: float = 2.0, tls: MeshTls | None = None
) -> tuple[bool, str]:
    """One standard gRPC health Check (over mutual TLS with `tls`): (serving, status or error)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (
        grpc.secure_channel(target, tls.channel_credentials(), options=tls.channel_options())
        if tls is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def add_probe_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `probe` on the moe-mesh CLI: exit 0 when the gRPC health check says SERVING, else 1."""
    p = subparsers.add_parser(
        "probe",
        help="gRPC health check of one service (exit 0 when SERVING)",
        description="Ask a service's standard gRPC health service; exit 0 when it "
        "answers SERVING, 1 otherwise (container health checks use it).",
    )
    p.add_argument("address", metavar="HOST:PORT", help="the service's gRPC address")
    p.add_argument(
        "--service", default="", help="service name to check (default '': the whole server)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=2.0, help="give up after this many seconds (default 2)"
    )
    for name, what in [
        ("--tls-cert", "certificate to present (a service of a mesh under mutual TLS)"),
        ("--tls-key", "its private key"),
        ("--tls-ca", "CA the service's certificate must chain to"),
    ]:
        p.add_argument(name, type=Path, default=None, help=what)
    p.add_argument(
        "--tls-server-name", default=None, help="name the service's certificate must carry"
    )
    p.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    from common.cli import settings_from_args
    from common.tls import MeshTls, SecuritySettings

    if args.tls_cert or args.tls_key:
        tls = MeshTls.from_settings(settings_from_args(SecuritySettings, args))
    else:  # a public TLS endpoint: check it, present nothing
        tls = MeshTls.ca_only(args.tls_ca) if args.tls_ca else None
    serving, status = probe(args.address, args.service, args.timeout_s, tls)
    print(
        f"{args.address}{' ' + args.service if args.service else ''}: {status}",
        file=sys.stdout if serving else sys.stderr,
    )
    return 0 if serving else 1
