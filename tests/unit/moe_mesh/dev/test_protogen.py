"""The committed generated code is exactly what `make protos` produces."""

from __future__ import annotations

from pathlib import Path

from moe_mesh.dev.protogen import PROTO_DIR, REPO_ROOT, generate


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    committed = sorted((REPO_ROOT / PROTO_DIR).glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, c in zip(fresh, committed) if p.read_bytes() != c.read_bytes()]
    assert not stale, f"regenerate with `make protos`: {stale} differ"
