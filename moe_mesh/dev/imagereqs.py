"""deploy/compose/requirements-cpu.txt: every package the CPU image installs, resolved and pinned.

    python -m moe_mesh.dev.imagereqs                  # resolve again and rewrite the file
    python -m moe_mesh.dev.imagereqs --torch-index '' # offline from PyTorch's index: a CPU torch
                                                      # wheel in pip's --find-links stands in

pip resolves the project's hard dependencies (no extra: the image has no fast path) under
constraints.txt with PyTorch's CPU index beside PyPI, as a dry run (`pip install --dry-run
--ignore-installed --report`), so nothing is installed and the result does not depend on the
environment it runs in; only the interpreter's Python version and platform (3.11, Linux x86-64 like
the image) enter the markers. The image installs the list as it is; tests/test_images.py fails when
it holds a CUDA package or disagrees with constraints.txt.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from common.cli import add_settings_arguments, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "deploy" / "compose" / "requirements-cpu.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROJECT = "moe-mesh"  # installed from its own wheel, after the list

HEADER = """\
# Every package of the CPU image (deploy/compose/Dockerfile), resolved from pyproject.toml's hard
# dependencies under constraints.txt with PyTorch's CPU index: torch's `+cpu` build, no CUDA
# library, no fast path. Generated: python -m moe_mesh.dev.imagereqs (do not edit by hand).
"""


def pins(report: dict[str, typing.Any]) -> list[str]:
    """`name==version` of every package a pip installation report installs, the project itself
    left out, sorted by name as pip normalizes it."""
    found = {}
    for item in report["install"]:
        meta = item["metadata"]
        key = canonical(meta["name"])
        if key != PROJECT:
            found[key] = f"{meta['name']}=={meta['version']}"
    return [found[k] for k in sorted(found)]


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(torch_index: str) -> dict[str, typing.Any]:
    """pip's installation report for the project as the CPU image installs it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        command += ["--quiet", "--report", str(report), "-c", str(ROOT / "constraints.txt")]
        if torch_index:
            command += ["--extra-index-url", torch_index]
        subprocess.run([*command, str(ROOT)], check=True, timeout=1800)
        return json.loads(report.read_text())


def render(report: dict[str, typing.Any]) -> str:
    return HEADER + "".join(f"{line}\n" for line in pins(report))


class ImagereqsSettings(BaseModel):
    """`python -m moe_mesh.dev.imagereqs`'s flags."""

    model_config = ConfigDict(extra="forbid")

    torch_index: str = Field(
        CPU_INDEX,
        description="PyTorch's CPU wheel index, searched beside PyPI; '' for none (a CPU torch "
        "wheel in pip's --find-links then stands in)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_mesh.dev.imagereqs", description=__doc__)
    add_settings_arguments(p, ImagereqsSettings)
    settings = typing.cast(
        ImagereqsSettings, settings_from_args(ImagereqsSettings, p.parse_args(argv))
    )
    text = render(resolve(settings.torch_index))
    if not re.search(r"^torch==[^+]+\+cpu$", text, re.M):
        print("torch resolved to a build other than +cpu: check --torch-index", file=sys.stderr)
        return 1
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
