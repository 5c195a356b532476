"""The CLI reference page: every `moe-mesh` command with its description, usage and flags, read
from the argparse parsers `moe_mesh.cli` builds, so it cannot drift from `--help`.

    python -m moe_mesh.dev.clidoc              # print the page (Markdown)

The docs site generates it when it is built (moe_mesh/dev/docsite.py, an MkDocs hook).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator

from moe_mesh.cli import build_parser
from moe_mesh.dev.configdoc import escape


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), summary: str = ""
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(words after `moe-mesh`, one-line help, parser) of every command that runs something, in
    `--help` order; a command that only groups others (`deploy`) yields its subcommands."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, summary, parser
        return
    for group in groups:
        helps = {a.dest: a.help or "" for a in group._choices_actions}
        for name, sub in group.choices.items():
            yield from commands(sub, (*path, name), helps.get(name, ""))


def _flags(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """`--out OUT`, `--reflection`, `--no-reflection`, or a positional's name."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    value = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
    return ", ".join(f"`{o}{value}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    value = action.default
    if action.required:
        return "required"
    # A flag derived from a settings model (common/cli.py) parses to None, so that a value left out
    # is told apart; its help names the model's default.
    said = re.search(r"\((required|default: none|default ([^;)]+))", action.help or "")
    if value is None and said:
        return "required" if said[1] == "required" else "-" if said[2] is None else f"`{said[2]}`"
    if value in (None, argparse.SUPPRESS, "", []) or (action.nargs == 0 and value is False):
        return "-"
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return f"`{value}`"


def section(words: tuple[str, ...], summary: str, parser: argparse.ArgumentParser) -> list[str]:
    """One command: heading, what it does, usage, and a row per flag."""
    formatter = parser._get_formatter()
    lines = [f"## moe-mesh {' '.join(words)} {{#{'-'.join(words)}}}", ""]
    if summary:
        lines += [escape(summary[0].upper() + summary[1:]) + ".", ""]
    if parser.description and parser.description.rstrip(".").lower() != summary.lower():
        lines += [escape(parser.description), ""]
    lines += ["```", parser.format_usage().strip(), "```", ""]
    rows = [
        a for a in parser._actions if a.help != argparse.SUPPRESS and "-h" not in a.option_strings
    ]
    if rows:
        lines += ["| flag | default | what it does |", "| --- | --- | --- |"]
        for action in rows:
            help_text = formatter._expand_help(action) if action.help else ""
            lines.append(
                f"| {_flags(action, formatter)} | {_default(action)} | {escape(help_text)} |"
            )
        lines.append("")
    return lines


def render() -> str:
    """The whole page."""
    parser = build_parser()
    found = list(commands(parser))
    lines = [
        "# CLI reference",
        "",
        "<!-- Generated from moe_mesh.cli's parsers (moe_mesh/dev/clidoc.py) when the site is built. -->",
        "",
        "`moe-mesh COMMAND --help` prints the same; `moe-mesh --version` prints the version. Every "
        "command ends with the same [exit codes](exit-codes.md). The `serve-*` commands take one "
        "flag per field of their settings model, each also read from an environment variable: "
        "[Configuration](../configuration.md) lists them with their variables and types. Defaults "
        "shown are the ones on the host the site was built on (`profile --router-threads` is its "
        "core count).",
        "",
        "| command | what it does |",
        "| --- | --- |",
        *(
            f"| [`moe-mesh {' '.join(w)}`](#{'-'.join(w)}) | {escape(summary)} |"
            for w, summary, _ in found
        ),
        "",
    ]
    for words, summary, sub in found:
        lines += section(words, summary, sub)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
