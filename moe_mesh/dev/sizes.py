"""Functions over 80 lines and files over 500 lines (the project's bounds: a function fits on a
screen, a file is a few hundred lines), outside tests/ and generated protobuf code.

    python -m moe_mesh.dev.sizes                          # list them; exit 1 when any
    python -m moe_mesh.dev.sizes --max-function-lines 60  # a stricter bound

A file that is a data table may opt out of the file bound with a comment line
`# sizes: long file: <why>` (the reason is required); its functions are still checked.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
# Not our hand-written code: tests, build outputs, environments, generated code.
SKIP_DIRS = {"tests", "build", "dist", "site", "node_modules", "__pycache__"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
OPT_OUT = re.compile(r"^#[ \t]*sizes:[ \t]*long file:[ \t]*\S", re.MULTILINE)


class SizesSettings(BaseModel):
    """The bounds `python -m moe_mesh.dev.sizes` checks."""

    model_config = ConfigDict(extra="forbid")

    max_function_lines: int = Field(
        80, ge=1, description="longest function or method allowed, in lines, def to last line"
    )
    max_file_lines: int = Field(500, ge=1, description="longest module allowed, in lines")


@dataclass(frozen=True)
class TooLong:
    path: str  # relative to the root scanned
    name: str  # qualified function name, or "" for the file itself
    lines: int

    def __str__(self) -> str:
        what = f"function {self.name}" if self.name else "file"
        return f"{self.path}: {what}: {self.lines} lines"


def source_files(root: Path) -> list[Path]:
    """Every hand-written .py file under `root`, sorted; hidden folders and SKIP_DIRS left out."""
    out = []
    for folder, dirs, files in os.walk(root):
        # Pruned in place, so os.walk never enters them (a virtualenv holds thousands of files).
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(folder) / n for n in files if n.endswith(".py") and not GENERATED.search(n)]
    return sorted(out)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def check_file(path: Path, root: Path, settings: SizesSettings) -> list[TooLong]:
    text = path.read_text()
    rel = path.relative_to(root).as_posix()
    found = []
    n = len(text.splitlines())
    if n > settings.max_file_lines and not OPT_OUT.search(text):
        found.append(TooLong(rel, "", n))
    for name, lines in _functions(ast.parse(text, rel)):
        if lines > settings.max_function_lines:
            found.append(TooLong(rel, name, lines))
    return found


def find(root: Path, settings: SizesSettings) -> list[TooLong]:
    return [t for path in source_files(root) for t in check_file(path, root, settings)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, SizesSettings)
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout to scan (default: this one)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_mesh.dev.sizes", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)  # each flag checked against SizesSettings as it is parsed
    settings = typing.cast(SizesSettings, settings_from_args(SizesSettings, args))
    found = find(args.root, settings)
    for t in found:
        print(t)
    print(
        f"{len(found)} over {settings.max_function_lines} lines a function "
        f"or {settings.max_file_lines} lines a file",
        file=sys.stderr,
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
