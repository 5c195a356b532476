"""`moe-mesh profile`: measure the costs of MegaScale-Infer's ping-pong model on this machine
(docs/design/ping-pong-model.md) and write them as JSON for `moe-mesh plan --search`. What is
measured, and how, is docs/design/profiling.md; the measuring is moe_mesh/planning/profiling.py,
the file format and flags moe_mesh/planning/profile_format.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from common.cli import add_settings_arguments, settings_from_args
from moe_mesh.planning.deploy.plan import PlanError, write_output
from moe_mesh.planning.profile_format import ProfileSettings

PROG = "moe-mesh profile"
TARGET = ("experts", "ready_file")  # one or the other: the expert services timed against


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `profile` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "profile",
        help="measure Ta, Te and Tc of the ping-pong model for `moe-mesh plan --search`",
        description="Time the router's share of a MoE layer (Ta), the experts' share (Te), the "
        "transfer of activations per transport (Tc) and the CPU a Forward call costs the expert "
        "service and the caller, on this machine; fit each linearly and write JSON. Progress "
        "goes to stderr.",
    )
    add_settings_arguments(p, ProfileSettings, skip=TARGET)
    add_settings_arguments(p.add_mutually_exclusive_group(), ProfileSettings, only=TARGET)
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    settings = typing.cast(ProfileSettings, settings_from_args(ProfileSettings, args))
    if not (settings.checkpoint / "config.json").is_file():
        print(f"{PROG}: error: --checkpoint {settings.checkpoint}: no config.json", file=sys.stderr)
        return 2
    # Imported once the flags are valid: torch and the serving code take seconds to import, and
    # every `moe-mesh` command's parser is built from this module.
    from moe_mesh.planning.profiling import profile

    try:
        result = profile(settings)
        text = json.dumps(result.model_dump(mode="json"), indent=1) + "\n"
        write_output(text, settings.out)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if settings.out is not None:
        print(f"{PROG}: wrote {settings.out}", file=sys.stderr)
    return 0
