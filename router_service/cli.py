"""`moe-mesh serve-router` (also `python -m router_service`): one router process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.arch import checkpoint_spec
from common.cli import add_settings_arguments, exit_code, settings_from_args
from common.errors import MoeMeshError

FLAGS = {
    "expert_endpoints": "--expert",  # repeatable: one expert service each
    "enable_chunked_prefill": "--chunked-prefill",  # and --no-chunked-prefill
    "enable_prefix_caching": "--prefix-caching",  # and --no-prefix-caching
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per RouterSettings field (common/cli.py), plus --ready-file."""
    from router_service.settings import RouterSettings

    add_settings_arguments(p, RouterSettings, flags=FLAGS)
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write {address, pid} as JSON here once serving",
    )


def run(args: argparse.Namespace) -> int:
    from router_service.settings import RouterSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        settings = settings_from_args(RouterSettings, args, required=["checkpoint"], flags=FLAGS)
        checkpoint_spec(settings.checkpoint)
    except MoeMeshError as e:
        print(f"moe-mesh serve-router: error: {e}", file=sys.stderr)
        return exit_code(e)
    import uvloop  # the heavy imports (torch, grpc) wait until the flags are known to be valid

    from common.server import serve_app
    from router_service.app import RouterApp

    if settings.compute_threads:
        import torch

        torch.set_num_threads(settings.compute_threads)

    async def main() -> None:
        await serve_app(await RouterApp.create(settings), args.ready_file)

    try:
        uvloop.run(main())
    except (MoeMeshError, OSError) as e:  # no expert service, mismatched weights, port in use
        print(f"moe-mesh serve-router: error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve-router",
        help="run one router service",
        description="Serve the model's dense part and dispatch experts to expert services.",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router_service", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
