"""moe_mesh/dev/imagereqs.py turns pip's installation report into the CPU image's pinned list: every
package but the project itself, sorted by normalized name, torch's local version kept."""

from __future__ import annotations

import pytest

from moe_mesh.dev import imagereqs


def _report(*packages: tuple[str, str]) -> dict:
    return {"install": [{"metadata": {"name": n, "version": v}} for n, v in packages]}


def test_pins_every_package_but_the_project_sorted_by_normalized_name() -> None:
    report = _report(
        ("torch", "2.13.0+cpu"),
        ("moe-mesh", "0.1.0"),
        ("PyYAML", "6.0.3"),
        ("typing_extensions", "4.16.0"),
        ("Jinja2", "3.1.6"),
    )
    assert imagereqs.pins(report) == [
        "Jinja2==3.1.6",
        "PyYAML==6.0.3",
        "torch==2.13.0+cpu",
        "typing_extensions==4.16.0",
    ]
    text = imagereqs.render(report)
    assert text.startswith(imagereqs.HEADER) and text.endswith("typing_extensions==4.16.0\n")


@pytest.mark.parametrize(
    ("name", "want"),
    [("PyYAML", "pyyaml"), ("typing_extensions", "typing-extensions"), ("a.b__c", "a-b-c")],
)
def test_names_compare_as_pip_compares_them(name: str, want: str) -> None:
    assert imagereqs.canonical(name) == want


def test_a_resolution_that_is_not_the_cpu_build_writes_nothing(monkeypatch, tmp_path) -> None:
    out = tmp_path / "requirements-cpu.txt"
    monkeypatch.setattr(imagereqs, "OUT", out)
    monkeypatch.setattr(imagereqs, "resolve", lambda index: _report(("torch", "2.13.0")))
    assert imagereqs.main(["--torch-index", ""]) == 1
    assert not out.exists()
    monkeypatch.setattr(imagereqs, "resolve", lambda index: _report(("torch", "2.13.0+cpu")))
    assert imagereqs.main([]) == 0
    assert out.read_text().endswith("\ntorch==2.13.0+cpu\n")
