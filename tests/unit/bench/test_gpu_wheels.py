"""bench/gpu_wheels.py: the wheel list names every runtime need of pyproject.toml's dependencies
that the GPU machine's image lacks, each has a version to pin, and a folder's wheels are read back
by name (missing ones, duplicates, files that are not wheels)."""

from __future__ import annotations

import tomllib
import zipfile
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from bench import gpu_wheels
from bench.gpu_wheels import (
    CARRIED_ANYWAY,
    DEVICE_HAS,
    FOR_TESTS,
    NOT_NEEDED,
    ROOT,
    UCX,
    WHEELS,
    check_wheels,
    missing,
    normalize,
    pins,
    present,
    requirements,
    wheel_name,
)


def closure() -> set[str]:
    """Every distribution pyproject.toml's runtime dependencies need, transitively, as installed
    here (extras the dependencies name included; markers evaluated for this interpreter)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(d) for d in deps]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = (normalize(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for text in metadata.requires(req.name) or []:
            need = Requirement(text)
            extras = ["", *req.extras]
            if need.marker is None or any(need.marker.evaluate({"extra": e}) for e in extras):
                todo.append(need)
    return {name for name, _ in seen}


def test_every_runtime_need_the_device_lacks_is_carried() -> None:
    needs = closure()
    assert {"pydantic", "fastapi", "uvicorn", "py-consul", "opentelemetry-sdk"} <= needs
    lacking = needs - DEVICE_HAS - NOT_NEEDED
    named = {normalize(n) for n in WHEELS}
    assert lacking <= named, f"not in gpu_wheels.WHEELS: {sorted(lacking - named)}"
    # ... and nothing is carried that is neither needed and lacking nor carried for its version
    # or for the suite's CUDA tests.
    assert named - lacking == {normalize(n) for n in (*CARRIED_ANYWAY, *FOR_TESTS)}


def test_the_device_has_what_the_issue_says_and_lacks_what_it_says() -> None:
    for name in ("torch", "transformers", "grpcio", "uvloop", "safetensors", "httpx"):
        assert name in DEVICE_HAS
    for name in ("pydantic", "pydantic-settings", "fastapi", "uvicorn", "py-consul"):
        assert name not in DEVICE_HAS and name in WHEELS
    assert not set(NOT_NEEDED) & set(WHEELS)


def test_every_wheel_has_a_version_to_pin() -> None:
    reqs = requirements((*WHEELS, *UCX), pins())
    assert len(reqs) == len(WHEELS) + len(UCX)
    assert all(r.count("==") == 1 and not r.endswith("==") for r in reqs)
    assert "grpcio==1.85.1" in reqs  # the version protos/*_pb2_grpc.py were generated with
    with pytest.raises(KeyError, match="no-such-package"):
        requirements(("no-such-package",), {})


def test_pins_read_constraints_lines(tmp_path) -> None:
    path = tmp_path / "constraints.txt"
    path.write_text("# comment\nPyYAML==6.0.3  # why\ngrpcio_tools==1.85.1\nloose>=2\n")
    assert pins(path) == {"pyyaml": "6.0.3", "grpcio-tools": "1.85.1"}


def _wheel(folder, filename: str) -> None:
    with zipfile.ZipFile(folder / filename, "w") as z:
        z.writestr("x/METADATA", "Name: x\n")


def test_a_folder_is_read_back_by_distribution_name(tmp_path) -> None:
    assert wheel_name(tmp_path / "pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.whl") == (
        "pydantic-core"
    )
    assert present(tmp_path / "absent") == {}
    assert missing(tmp_path / "absent") == list(WHEELS)
    for name in WHEELS[1:]:
        _wheel(tmp_path, f"{name.replace('-', '_')}-1.0-py3-none-any.whl")
    assert missing(tmp_path) == [WHEELS[0]]
    assert check_wheels(tmp_path) == []
    _wheel(tmp_path, "pydantic-9.9-py3-none-any.whl")
    (tmp_path / "fastapi-0.0-py3-none-any.whl").write_text("an HTML error page")
    problems = check_wheels(tmp_path)
    assert any("two wheels of pydantic" in p for p in problems)
    assert any("fastapi-0.0-py3-none-any.whl is not a wheel" in p for p in problems)


def test_the_working_tree_is_measured_from_git() -> None:
    size = gpu_wheels.tree_bytes()
    assert (ROOT / "pyproject.toml").stat().st_size < size < gpu_wheels.LIMIT_BYTES
