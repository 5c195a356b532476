"""`moe-mesh profile`'s command line (moe_mesh/planning/profile.py): flags derived from
ProfileSettings, checked as they are parsed; measuring itself is run by
tests/e2e/test_plan_search.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from common.cli import settings_from_args
from moe_mesh.planning import profile
from moe_mesh.planning.profile_format import ProfileSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-mesh")
    profile.add_subcommand(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["profile", *argv])


def test_flags_give_the_settings_with_their_defaults() -> None:
    args = parse("--checkpoint", "ck", "--sizes", "16,1,4,4", "--experts", "a:1", "b:2")
    got = settings_from_args(ProfileSettings, args)
    assert got == ProfileSettings(checkpoint=Path("ck"), sizes=(1, 4, 16), experts=["a:1", "b:2"])
    assert got.transfer_tokens == (1, 8, 32, 128, 512) and got.repeats == 20
    assert got.router_threads == (os.cpu_count() or 1)  # every core, as the router


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --checkpoint"),
        (["--checkpoint", "ck", "--sizes", "1,x"], "expected integers >= 1 separated by ','"),
        (["--checkpoint", "ck", "--sizes", "0,2"], "got '0,2'"),
        (["--checkpoint", "ck", "--cpu-window-s", "601"], "--cpu-window-s: Input should be less"),
        (["--checkpoint", "ck", "--experts", "a:1", "--ready-file", "r"], "not allowed with"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_directory_without_config_json_exits_2_before_measuring(tmp_path, capsys) -> None:
    assert profile.run_profile(parse("--checkpoint", str(tmp_path))) == 2
    assert capsys.readouterr().err == (
        f"moe-mesh profile: error: --checkpoint {tmp_path}: no config.json\n"
    )
