"""The `moe-mesh` command line. Each subcommand lives with the code it drives; this file only lists them:

serving        serve-expert, serve-router, serve-gateway   (the three services)
running local  up, scale, generate                          (moe_mesh.local)
operating      status, placement show, stats, trace show    (moe_mesh.ops)
benchmarking   bench                                        (moe_mesh.benchmark)
planning       profile, plan, deploy render, probe          (moe_mesh.planning)
developing     create-checkpoint                            (moe_mesh.dev)
"""

from __future__ import annotations

import argparse
import sys

from moe_mesh.common import runtime
from moe_mesh.common.errors import MoeMeshError

runtime.configure()  # the console script's entry: before anything imports torch


def build_parser() -> argparse.ArgumentParser:
    from moe_mesh.benchmark import cli as bench_cli
    from moe_mesh.dev import create_checkpoint
    from moe_mesh.expert_service import cli as expert_cli
    from moe_mesh.gateway import cli as gateway_cli
    from moe_mesh.local import cli as local_cli
    from moe_mesh.local import generate_cli
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoeMeshError as e:
        print(f"moe-mesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
