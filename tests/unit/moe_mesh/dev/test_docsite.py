"""The docs site's hooks: the CLI page is added to the build, and the Design section lists the pages
docs/design/ holds (and disappears while it holds none)."""

from __future__ import annotations

from mkdocs.commands.build import build
from mkdocs.config import load_config

from moe_mesh.dev import docsite


def _config(tmp_path, nav):
    return {"docs_dir": str(tmp_path), "nav": nav}


def test_the_design_section_lists_the_folder_index_first(tmp_path) -> None:
    (tmp_path / "design").mkdir()
    (tmp_path / "design" / "zeta.md").write_text("# Zeta derivation\n\ntext\n")
    (tmp_path / "design" / "alpha.md").write_text("no heading\n")
    (tmp_path / "design" / "index.md").write_text("# Design notes\n")
    config = docsite.on_config(_config(tmp_path, [{"Home": "index.md"}, {"Design": []}]))
    assert config["nav"] == [
        {"Home": "index.md"},
        {
            "Design": [
                {"Design notes": "design/index.md"},
                {"alpha": "design/alpha.md"},
                {"Zeta derivation": "design/zeta.md"},
            ]
        },
    ]


def test_an_empty_design_folder_leaves_no_section(tmp_path) -> None:
    config = docsite.on_config(_config(tmp_path, [{"Home": "index.md"}, {"Design": []}]))
    assert config["nav"] == [{"Home": "index.md"}]


def test_a_build_renders_the_generated_cli_page(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(
        docsite.clidoc, "render", lambda: "# CLI reference\n\n| flag |\n| --- |\n| `--x` |\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the CLI](reference/cli.md).\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\nstrict: true\nhooks: ['{docsite.__file__}']\n"
        "nav: [{Home: index.md}, {CLI: reference/cli.md}, {Design: []}]\n"
    )
    build(load_config(str(tmp_path / "mkdocs.yml"), site_dir=str(tmp_path / "site")))
    html = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "<code>--x</code>" in html
