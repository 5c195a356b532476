"""docs/configuration.md is the render of the settings models, and names every environment variable
the code reads."""

from __future__ import annotations

import re

from moe_mesh.cli import build_parser
from moe_mesh.dev import clidoc, configdoc
from tests.support import REPO

CODE = ("common", "router_service", "expert_service", "gateway", "moe_mesh")
# os.environ.get("X"), os.environ["X"], os.getenv("X"), os.environ.setdefault("X"), and constants
# naming a variable (`..._ENV = "X"`).
READ = re.compile(
    r"""(?:environ(?:\.get|\.setdefault)?\s*[\(\[]\s*|getenv\(\s*|_ENV\s*=\s*)"([A-Z][A-Z0-9_]+)\""""
)


def test_the_committed_page_is_the_render_of_the_settings_models() -> None:
    assert configdoc.DOC.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: run python -m moe_mesh.dev.configdoc"
    )


def test_every_variable_the_code_reads_is_documented() -> None:
    read = {
        name
        for folder in CODE
        for path in (REPO / folder).rglob("*.py")
        for name in READ.findall(path.read_text())
    }
    assert {"MOE_MESH_FAST_PATH", "GRPC_VERBOSITY", "UCX_RNDV_THRESH"} <= read  # the scan works
    page = configdoc.DOC.read_text()
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"read by the code, not in docs/configuration.md: {missing}"


def test_every_setting_has_its_variable_and_flag_on_the_page() -> None:
    page = configdoc.DOC.read_text()
    for _, _, model, renamed in configdoc._models():
        prefix = model.model_config["env_prefix"]
        for name in model.model_fields:
            assert f"`{prefix}{name.upper()}`" in page
            assert f"`{renamed.get(name, '--' + name.replace('_', '-'))}`" in page


def test_markdown_is_escaped_outside_code_spans_only() -> None:
    assert configdoc.escape("logs in .cache/mesh-<time>") == "logs in .cache/mesh-&lt;time\\>"
    assert configdoc.escape("experts '*:*' or a|b") == "experts '\\*:\\*' or a\\|b"
    assert configdoc.escape("`*:*` and RUN_DIR") == "`*:*` and RUN\\_DIR"
    assert configdoc.escape("two\nlines") == "two lines"


def test_every_flag_on_the_page_is_one_its_command_takes() -> None:
    parsers = {f"moe-mesh {' '.join(w)}": p for w, _, p in clidoc.commands(build_parser())}
    for command, _, model, renamed in configdoc._models():
        takes = {o for a in parsers[command]._actions for o in a.option_strings}
        named = {renamed.get(name, "--" + name.replace("_", "-")) for name in model.model_fields}
        assert named <= takes, f"{command}: the page names {sorted(named - takes)}"
