"""`up` hands the gateway's flags to the gateway process as the gateway's own CLI spells them."""

from __future__ import annotations

import argparse

from gateway import cli as gateway_cli
from moe_mesh.local.cli import GATEWAY_FLAGS, _pass_through, add_subcommands


def _up(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    return parser.parse_args(["up", "--checkpoint", "ckpt", *argv])


def test_given_flags_pass_through_and_booleans_take_no_value() -> None:
    args = _up("--allow-unknown-fields", "--no-disable-fastapi-docs", "--max-prompts", "8")
    passed = _pass_through(args, GATEWAY_FLAGS)
    assert passed == ["--max-prompts", "8", "--allow-unknown-fields", "--no-disable-fastapi-docs"]
    assert _pass_through(_up(), GATEWAY_FLAGS) == []  # unset: the gateway's defaults hold


def test_the_gateway_parses_what_up_passes() -> None:
    passed = _pass_through(_up("--allow-unknown-fields", "--max-prompts", "8"), GATEWAY_FLAGS)
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    parsed = parser.parse_args(["--checkpoint", "ckpt", *passed])
    assert parsed.allow_unknown_fields is True and parsed.max_prompts == 8
