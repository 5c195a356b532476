"""MkDocs hooks for the docs site (mkdocs.yml `hooks:`): the CLI reference page is generated from the
parsers while the site builds, and the "Design" section lists whatever pages docs/design/ holds.

The CLI page is made at build time rather than committed because its defaults depend on the host
(`profile --router-threads` is the core count) and flags change with the code; `make test` builds
the site with `--strict`, so a command whose help breaks the page fails there.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

from moe_mesh.dev import clidoc

CLI_PAGE = "reference/cli.md"
DESIGN = "Design"


def _title(page: Path) -> str:
    """A page's first heading, else its file name."""
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("-", " ").replace("_", " ")


def design_pages(docs_dir: Path) -> list[dict[str, str]]:
    """docs/design/*.md as nav entries, its index first."""
    pages = sorted((docs_dir / "design").glob("*.md"), key=lambda p: (p.stem != "index", p.name))
    return [{_title(p): p.relative_to(docs_dir).as_posix()} for p in pages]


def on_config(config):
    """Fill the nav's Design section from the folder (dropped while the folder has no page)."""
    nav = config["nav"]
    for i, entry in enumerate(nav):
        if isinstance(entry, dict) and DESIGN in entry:
            pages = design_pages(Path(config["docs_dir"]))
            if pages:
                nav[i] = {DESIGN: pages}
            else:
                del nav[i]
            break
    return config


def on_files(files, config):
    files.append(File.generated(config, CLI_PAGE, content=clidoc.render()))
    return files
