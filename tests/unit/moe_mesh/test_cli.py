"""The `moe-mesh` parser: a known command builds only its own, and parses as the whole one does."""

from __future__ import annotations

import subprocess
import sys

from moe_mesh.cli import _COMMANDS, build_parser


def _commands(parser) -> list[str]:
    return list(parser._subparsers._group_actions[0].choices)


def test_a_command_builds_only_its_parser_and_parses_like_the_whole_one() -> None:
    assert _commands(build_parser()) == list(_COMMANDS)  # --help lists every command, in order
    assert _commands(build_parser("status")) == ["status"]
    assert _commands(build_parser("up")) == ["up", "scale"]  # siblings come with their module
    assert _commands(build_parser("no-such-command")) == list(_COMMANDS)  # argparse names them all
    argv = ["trace", "show", "a.jsonl", "--list"]
    assert vars(build_parser("trace").parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_status_imports_no_other_commands_module() -> None:
    probe = (
        "import sys; from moe_mesh.cli import build_parser; build_parser('status'); "
        "print(sorted(m for m in sys.modules if m.startswith(('moe_mesh.benchmark', "
        "'moe_mesh.planning', 'moe_mesh.local.launcher'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
