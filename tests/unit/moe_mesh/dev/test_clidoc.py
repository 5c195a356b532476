"""The CLI reference page is read from the parsers: every command and every visible flag is on it,
with its help and default, and Markdown cannot swallow what the help says."""

from __future__ import annotations

import argparse

from moe_mesh.cli import build_parser
from moe_mesh.dev import clidoc


def _visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        option
        for action in parser._actions
        if action.help != argparse.SUPPRESS and "-h" not in action.option_strings
        for option in action.option_strings
    ]


def test_every_command_that_runs_something_has_a_section_in_help_order() -> None:
    words = [" ".join(w) for w, _, _ in clidoc.commands(build_parser())]
    assert words[:4] == ["checkpoint create", "generate", "serve-expert", "serve-router"]
    assert {"deploy render", "placement show", "trace show", "up", "bench"} <= set(words)
    assert "deploy" not in words  # a group of commands gets no section of its own
    page = clidoc.render()
    positions = [page.index(f"## moe-mesh {w} {{#{w.replace(' ', '-')}}}") for w in words]
    assert positions == sorted(positions)


def test_every_visible_flag_is_a_row_with_its_help_and_default() -> None:
    for words, _, parser in clidoc.commands(build_parser()):
        rows = [line for line in clidoc.section(words, "", parser) if line.startswith("| `")]
        for option in _visible_flags(parser):
            assert any(f"`{option}" in row.split(" | ")[0] for row in rows), (
                f"moe-mesh {' '.join(words)}: {option} missing"
            )
    bench = dict((w, p) for w, _, p in clidoc.commands(build_parser()))[("bench",)]
    rows = [line for line in clidoc.section(("bench",), "", bench) if "`--num-requests" in line]
    # a flag derived from a settings model (moe_mesh/benchmark/settings.py): its default is in its help
    assert rows == [
        "| `--num-requests NUM_REQUESTS` | `64` | requests per load level "
        "(default 64; env MOE\\_MESH\\_BENCH\\_NUM\\_REQUESTS) |"
    ]


def test_hidden_flags_and_help_are_left_out() -> None:
    parser = argparse.ArgumentParser(prog="moe-mesh demo", description="Do a thing.")
    parser.add_argument("--shown", type=int, default=3, help="a count")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--switch", action="store_true", help="turn it on")
    parser.add_argument("--need", required=True, help="must be given")
    section = "\n".join(clidoc.section(("demo",), "do a thing", parser))
    assert "| `--shown SHOWN` | `3` | a count |" in section
    assert "| `--switch` | - | turn it on |" in section
    assert "| `--need NEED` | required | must be given |" in section
    assert "--hidden" not in section.split("```")[2]  # the table, after the usage block
    assert "-h, --help" not in section
    assert section.count("Do a thing") == 1  # the description repeats the summary: said once
