"""`moe-mesh probe`: one gRPC health check; imports grpc only when it runs."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args

if TYPE_CHECKING:
    from common.tls import MeshTls


def probe(
    target: str, service: str = "", timeout_s: float = 2.0, tls: MeshTls | None = None
) -> tuple[bool, str]:
    """One standard gRPC health Check (over mutual TLS with `tls`): (serving, status or error)."""
    # Here, not at the top: `python -m moe_mesh.planning.deploy render` loads this module and
    # needs no grpc.
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


FILE: dict = {"metavar": "FILE"}


class ProbeSettings(BaseModel):
    """`moe-mesh probe`'s arguments."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        description="the service's gRPC address", json_schema_extra={"metavar": "HOST:PORT"}
    )
    service: str = Field("", description="service name to check ('': the whole server)")
    timeout_s: float = Field(
        2.0, gt=0, description="give up after this many seconds", json_schema_extra={"metavar": "S"}
    )
    tls_cert: Path | None = Field(
        None,
        description="certificate to present (a service of a mesh under mutual TLS)",
        json_schema_extra=FILE,
    )
    tls_key: Path | None = Field(None, description="its private key", json_schema_extra=FILE)
    tls_ca: Path | None = Field(
        None, description="CA the service's certificate must chain to", json_schema_extra=FILE
    )
    tls_server_name: str | None = Field(
        None,
        description="name the service's certificate must carry",
        json_schema_extra={"metavar": "NAME"},
    )


def add_probe_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `probe` on the moe-mesh CLI: exit 0 when the gRPC health check says SERVING, else 1."""
    p = subparsers.add_parser(
        "probe",
        help="gRPC health check of one service (exit 0 when SERVING)",
        description="Ask a service's standard gRPC health service; exit 0 when it "
        "answers SERVING, 1 otherwise (container health checks use it).",
    )
    add_settings_arguments(p, ProbeSettings, flags={"address": "address"})
    p.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    # Here, not at the top: common.tls loads grpc and cryptography (see probe()).
    from common.tls import MeshTls, SecuritySettings

    s = typing.cast(ProbeSettings, settings_from_args(ProbeSettings, args))
    if s.tls_cert or s.tls_key:
        tls = MeshTls.from_settings(settings_from_args(SecuritySettings, args))
    else:  # a public TLS endpoint: check it, present nothing
        tls = MeshTls.ca_only(s.tls_ca) if s.tls_ca else None
    serving, status = probe(s.address, s.service, s.timeout_s, tls)
    print(
        f"{s.address}{' ' + s.service if s.service else ''}: {status}",
        file=sys.stdout if serving else sys.stderr,
    )
    return 0 if serving else 1
