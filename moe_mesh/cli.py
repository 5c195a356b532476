"""The `moe-mesh` command line. Each subcommand lives with the code it drives; this file only lists them:

serving        serve-expert, serve-router, serve-gateway   (the three services)
running local  up, scale, generate, certs                   (moe_mesh.local)
operating      status, placement show, stats, trace show    (moe_mesh.ops)
benchmarking   bench                                        (moe_mesh.benchmark)
planning       profile, plan, deploy render, probe          (moe_mesh.planning)
developing     create-checkpoint                            (moe_mesh.dev)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

import grpc

from moe_mesh.common import runtime
from moe_mesh.common.cli import exit_code
from moe_mesh.common.errors import MoeMeshError, UnavailableError

runtime.configure()  # the console script's entry: before anything imports torch


def build_parser() -> argparse.ArgumentParser:
    from moe_mesh.benchmark import cli as bench_cli
    from moe_mesh.dev import create_checkpoint
    from moe_mesh.expert_service import cli as expert_cli
    from moe_mesh.gateway import cli as gateway_cli
    from moe_mesh.local import certs, generate_cli
    from moe_mesh.local import cli as local_cli
    from moe_mesh.ops import client, placement, stats, traces
    from moe_mesh.planning import deploy, plan, profile
    from moe_mesh.router_service import cli as router_cli

    parser = argparse.ArgumentParser(
        prog="moe-mesh", description="Serve sparse MoE language models as a gRPC mesh."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    create_checkpoint.add_subcommand(subparsers)
    generate_cli.add_subcommand(subparsers)
    expert_cli.add_subcommand(subparsers)
    router_cli.add_subcommand(subparsers)
    gateway_cli.add_subcommand(subparsers)
    local_cli.add_subcommands(subparsers)
    certs.add_subcommand(subparsers)
    client.add_subcommand(subparsers)
    deploy.add_subcommand(subparsers)
    deploy.add_probe_subcommand(subparsers)
    plan.add_subcommand(subparsers)
    profile.add_subcommand(subparsers)
    placement.add_subcommand(subparsers)
    traces.add_subcommand(subparsers)
    stats.add_subcommand(subparsers)
    bench_cli.add_subcommand(subparsers)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("moe-mesh")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Exit codes, the same for every command (README, "Exit codes"): 0 done; 1 the mesh or the
    machine failed (a service died or could not start, a port is taken, a peer is unreachable, a
    request failed); 2 the command was wrong (a bad flag or value, a missing file, input refused);
    130 interrupted (Ctrl-C); 141 stdout closed (`| head`)."""
    parser = build_parser()
    parser.add_argument("--version", action="version", version=f"moe-mesh {version()}")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MoeMeshError as e:
        hint = (
            "; is the mesh up, and is the address (or --ready-file) the one `moe-mesh up` printed?"
            if isinstance(e, UnavailableError)
            else ""
        )
        print(f"moe-mesh: error: {e}{hint}", file=sys.stderr)
        return exit_code(e)
    except grpc.RpcError as e:  # a command's call to a service: one line, not gRPC's debug text
        print(f"moe-mesh: error: {_rpc_problem(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        from moe_mesh.local.launcher import EXIT_BROKEN_PIPE, silence_stdout

        silence_stdout()
        return EXIT_BROKEN_PIPE


def _rpc_problem(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (
            f"cannot reach the service ({code.name}: {details.splitlines()[0]}); is the mesh up, "
            "and is the address (or --ready-file) the one `moe-mesh up` printed?"
        )
    return f"{code.name if code else 'RPC failed'}: {details.splitlines()[0]}"


if __name__ == "__main__":
    sys.exit(main())
