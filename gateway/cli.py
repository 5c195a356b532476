"""`moe-mesh serve-gateway` (also `python -m gateway`): the public gRPC + OpenAI HTTP edge."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.cli import add_settings_arguments, exit_code, settings_from_args
from common.errors import MoeMeshError

FLAGS = {"routers": "--router"}  # repeatable: one router replica each


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per GatewaySettings field (common/cli.py), plus --ready-file."""
    from gateway.settings import GatewaySettings

    add_settings_arguments(p, GatewaySettings, flags=FLAGS)
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write {address, http_address, pid} as JSON here once serving",
    )


def run(args: argparse.Namespace) -> int:
    import uvloop

    from common.server import serve_app
    from gateway.app import GatewayApp
    from gateway.settings import GatewaySettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    try:
        settings = settings_from_args(GatewaySettings, args, flags=FLAGS)
    except MoeMeshError as e:
        print(f"moe-mesh serve-gateway: error: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        await serve_app(await GatewayApp.create(settings), args.ready_file)

    try:
        uvloop.run(main())
    except (MoeMeshError, OSError) as e:  # no router, port in use
        print(f"moe-mesh serve-gateway: error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve-gateway",
        help="run the public gRPC + OpenAI HTTP gateway",
        description="Serve moe_mesh.v1.Inference and the OpenAI-compatible HTTP API "
        "in front of router replicas.",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
