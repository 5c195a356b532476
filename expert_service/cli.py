"""`moe-mesh serve-expert` (also `python -m expert_service`): serve a set of experts until SIGTERM.

Flags mirror ExpertSettings fields; a flag left out falls back to its MOE_EXPERT_* variable, then to
the field's default, so deployments may configure by flags, environment or both.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.arch import checkpoint_spec
from common.cli import add_settings_arguments, exit_code, settings_from_args
from common.errors import MoeMeshError
from expert_service.settings import ExpertSettings

PROG = "moe-mesh serve-expert"
DESCRIPTION = (
    "Serve the FFN weights of a set of (layer, expert) pairs of a MoE checkpoint over gRPC "
    "(moe_mesh.v1.ExpertService), with dynamic batching across callers."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve-expert flags: one per ExpertSettings field (common/cli.py), plus --ready-file."""
    add_settings_arguments(parser, ExpertSettings)
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="once serving, atomically write JSON {address, pid, model_id, ...} to this file",
    )


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve-expert` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    parser = subparsers.add_parser(
        "serve-expert", help="serve a set of experts over gRPC", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=run_serve_expert)


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser `python -m expert_service` uses: the same flags as `moe-mesh serve-expert`."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run_serve_expert)
    return parser


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_serve_expert(args: argparse.Namespace) -> int:
    """Load the experts, serve until SIGTERM/SIGINT, drain, exit 0; bad configuration exits 2 with one line."""
    # INFO, as the router and gateway log: what a load chose (kernels, layouts) and packing progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s expert %(levelname)s %(message)s")
    try:
        settings = settings_from_args(ExpertSettings, args)
        checkpoint_spec(settings.checkpoint)
    except MoeMeshError as e:
        return _error(str(e))
    import uvloop  # the heavy imports (torch, grpc) wait until the flags are known to be valid

    if settings.compute_threads:
        import torch

        torch.set_num_threads(settings.compute_threads)
    try:
        uvloop.run(serve(settings, args.ready_file))
    # bad --experts spec, broken or missing checkpoint, no ucxx for --fast-path ucx, port in use
    except (MoeMeshError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


async def serve(settings: ExpertSettings, ready_file: Path | None) -> None:
    """Load, serve until SIGTERM/SIGINT, drain in-flight calls, stop."""
    from common.server import serve_app
    from expert_service.app import ExpertApp

    await serve_app(await ExpertApp.create(settings), ready_file)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
