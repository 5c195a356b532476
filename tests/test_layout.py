"""Layout rules that import-linter's contracts (pyproject.toml, run by `make test`) do not cover: no
module imports another module's private names; every folder imports under its own name, installed as
in the checkout; tests import only tests/support/ and mirror the code; the docs' directory table names
every module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("expert_service", "router_service", "gateway")
TOP = (*SERVICES, "common", "protos", "moe_mesh")  # the installed top-level packages
PACKAGES = (*SERVICES, "common", "moe_mesh")


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names imported from it, line) for every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = path.relative_to(ROOT).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x / from ..y import z
                base = here[: len(here) - node.level]
                module = ".".join([*base, module] if module else base)
            out.append((module, [a.name for a in node.names], node.lineno))
    return out


def _top(module: str) -> str:
    return module.split(".")[0]


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_no_module_imports_a_private_name_of_another_module() -> None:
    found = []
    for package in PACKAGES:
        for path in _modules(package):
            for module, names, line in _imports(path):
                if _top(module) not in PACKAGES:
                    continue
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                private += [
                    part
                    for part in module.split(".")
                    if part.startswith("_") and part != "__main__" and not part.startswith("__")
                ]
                if private:
                    found.append(f"{_where(path, line)} imports {', '.join(private)} from {module}")
    assert not found, "\n".join(found)


def test_every_import_of_our_code_names_a_file_at_that_path() -> None:
    """`import gateway.core` opens gateway/core.py: no folder is mapped under another name."""
    found = []
    for package in (*TOP, "tests", "bench"):
        for p in _modules(package):
            for module, names, line in _imports(p):
                if _top(module) not in (*TOP, "tests", "bench"):
                    continue
                base = ROOT.joinpath(*module.split("."))
                candidates = [base.with_suffix(".py"), base / "__init__.py"]
                candidates += [base / f"{n}.py" for n in names] + [base / n for n in names]
                if not any(c.exists() for c in candidates):
                    found.append(f"{_where(p, line)} imports {module}: no such file")
    assert not found, "\n".join(found)


def test_pyproject_installs_each_folder_under_its_own_name() -> None:
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in tool
    assert sorted(tool["packages"]["find"]["include"]) == sorted(f"{t}*" for t in TOP)


def test_the_import_contracts_catch_services_importing_each_other(tmp_path) -> None:
    """A planted `gateway -> router_service` import fails `lint-imports` with the independence
    contract named, so the contracts in pyproject.toml are read and enforced."""
    import shutil

    for top in (*TOP, "bench", "tests"):
        shutil.copytree(
            ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "node_modules")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    run = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    ok = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "gateway" / "planted.py").write_text("import router_service.core\n")
    bad = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Services never import each other" in bad.stdout
    assert "gateway.planted -> router_service.core" in bad.stdout


def test_tests_and_benchmarks_import_no_test_module() -> None:
    """Shared test code lives in tests/support/; a test module is never imported by another file."""
    found = [
        f"{_where(p, line)} imports {m}"
        for folder in ("tests", "bench")
        for p in _modules(folder)
        for m, _, line in _imports(p)
        if m.split(".")[0] == "tests" and m.split(".")[:2] != ["tests", "support"]
    ]
    assert not found, "\n".join(found)


def _unit_test_folders() -> set[str]:
    unit = ROOT / "tests" / "unit"
    return {p.parent.relative_to(unit).as_posix() for p in unit.rglob("test_*.py")}


def test_unit_tests_mirror_the_code() -> None:
    """tests/unit/<folder>/test_<name>.py tests the module, subpackage or .proto <name> of <folder>/."""
    found = []
    for folder in sorted(_unit_test_folders()):
        code = ROOT / folder
        if not (code / "__init__.py").is_file():
            found.append(f"tests/unit/{folder}/: {folder}/ is not a package")
            continue
        for test in sorted((ROOT / "tests" / "unit" / folder).glob("test_*.py")):
            name = test.stem.removeprefix("test_")
            if not (
                (code / f"{name}.py").is_file()
                or (code / name).is_dir()
                or any(code.rglob(f"{name}.proto"))
            ):
                found.append(f"tests/unit/{folder}/{test.name}: {folder}/ has no {name}")
    assert not found, "\n".join(found)


def test_the_rules_see_a_violation(tmp_path, monkeypatch) -> None:
    """The checks above read real imports: a planted bad module is caught by each of them."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for package in ("gateway", "common", "moe_mesh"):
        (tmp_path / package).mkdir()
    (tmp_path / "moe_mesh" / "bad.py").write_text("from .ops.tables import _hidden\n")
    (tmp_path / "gateway" / "gone.py").write_text("from common.nowhere import Thing\n")
    with pytest.raises(
        AssertionError, match="moe_mesh/bad.py:1 imports _hidden from moe_mesh.ops.tables"
    ):
        test_no_module_imports_a_private_name_of_another_module()
    with pytest.raises(
        AssertionError, match="gateway/gone.py:1 imports common.nowhere: no such file"
    ):
        test_every_import_of_our_code_names_a_file_at_that_path()
    (tmp_path / "tests" / "unit" / "gateway").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "gateway" / "test_nothing.py").write_text(
        "from tests.unit.gateway.test_core import helper\n"
    )
    with pytest.raises(
        AssertionError,
        match="tests/unit/gateway/test_nothing.py:1 imports tests.unit.gateway.test_core",
    ):
        test_tests_and_benchmarks_import_no_test_module()
    with pytest.raises(AssertionError, match="tests/unit/gateway/: gateway/ is not a package"):
        test_unit_tests_mirror_the_code()
    (tmp_path / "gateway" / "__init__.py").write_text("")
    with pytest.raises(AssertionError, match="test_nothing.py: gateway/ has no nothing"):
        test_unit_tests_mirror_the_code()


LAYOUT_PAGE = ROOT / "docs" / "development" / "layout.md"


def _layout_table() -> dict[str, str]:
    """directory -> its row of the directory table on the docs' layout page."""
    rows = {}
    for line in LAYOUT_PAGE.read_text().splitlines():
        if line.startswith("| `") and "/` |" in line:
            directory, _, text = line[3:].partition("` |")
            rows[directory.rstrip("/")] = text
    return rows


def _documented_folders() -> list[str]:
    """Every package folder of the code, plus the test and benchmark folders that hold modules."""
    packages = {
        p.parent.relative_to(ROOT).as_posix()
        for top in (*SERVICES, "common", "moe_mesh")
        for p in (ROOT / top).rglob("__init__.py")
    }
    return sorted(packages | {"tests", "tests/support", "tests/integration", "tests/e2e", "bench"})


def test_the_layout_page_names_every_module_and_only_real_ones() -> None:
    rows = _layout_table()
    for package in _documented_folders():
        assert package in rows, f"docs/development/layout.md has no row for {package}/"
        modules = {p.name for p in (ROOT / package).glob("*.py") if not p.name.startswith("__")}
        named = set(re.findall(r"`([a-z0-9_]+\.py)`", rows[package]))
        assert modules - named == set(), (
            f"{package}/: not in docs/development/layout.md: {sorted(modules - named)}"
        )
        assert named - modules == set(), (
            f"{package}/: docs/development/layout.md names missing files: {sorted(named - modules)}"
        )
    # tests/unit/ mirrors the code, so its row names folders, not files.
    assert "tests/unit" in rows, "docs/development/layout.md has no row for tests/unit/"
    named = set(re.findall(r"`([a-z0-9_/]+)/`", rows["tests/unit"]))
    assert named == _unit_test_folders(), (
        f"tests/unit/: the layout page names {sorted(named)}, the tree has {sorted(_unit_test_folders())}"
    )


def test_every_service_has_one_shape() -> None:
    """`await App.create(settings)`, then start / wait / stop(grace_s) / ready_info, as
    common.server.serve_app drives them."""
    import inspect

    from common.server import App
    from expert_service.app import ExpertApp
    from gateway.app import GatewayApp
    from router_service.app import RouterApp

    for cls in (ExpertApp, RouterApp, GatewayApp):
        assert inspect.iscoroutinefunction(cls.create), cls
        assert list(inspect.signature(cls.create).parameters)[:1] == ["settings"], cls
        for name in ("start", "wait", "stop", "ready_info"):
            want, got = getattr(App, name), getattr(cls, name)
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (
                cls,
                name,
            )
            assert list(inspect.signature(got).parameters) == list(
                inspect.signature(want).parameters
            ), (cls, name)
