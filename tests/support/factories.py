"""Test helpers that build random-initialised checkpoints once per process and share them between tests."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from moe_mesh.dev.create_checkpoint import create_checkpoint

_cache: dict[tuple[Path, str], Path] = {}


def make_checkpoint(root: Path, arch: str, preset: str = "tiny", **kwargs: Any) -> Path:
    """Create a checkpoint in a fresh subdirectory of root (name derived from arch + kwargs) and return it.

    kwargs go to ``create_checkpoint``. The same (root, arch, preset, kwargs) returns the already-written
    directory, so session-scoped roots let many tests share one checkpoint.
    """
    spec = json.dumps({"arch": arch, "preset": preset, **kwargs}, sort_keys=True, default=str)
    key = (Path(root).resolve(), spec)
    if key in _cache:
        return _cache[key]
    # Readable prefix for debugging, hash so that long or similar kwargs never collide.
    readable = "-".join([arch, preset, *(f"{k}={v}" for k, v in sorted(kwargs.items()))])
    name = (
        re.sub(r"[^A-Za-z0-9_.=-]+", "_", readable)[:80]
        + "-"
        + hashlib.sha1(spec.encode()).hexdigest()[:8]
    )
    out = key[0] / name
    # tokenizer_config.json is written last, so it marks a complete checkpoint left by an earlier call.
    if not (out / "tokenizer_config.json").exists():
        create_checkpoint(out, arch, preset, **kwargs)
    _cache[key] = out
    return out


def realigned(src: Path, dst: Path, at: int = 0) -> Path:
    """A copy of checkpoint `src` whose safetensors data begin `at` bytes past a multiple of 64
    into each file (its header padded with spaces, as the format allows), which is where every
    tensor of a small model then lies: a new tensor's alignment at 0, a file's of another header
    length elsewhere."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        raw = f.read_bytes()
        if f.suffix == ".safetensors":
            header = raw[8 : 8 + int.from_bytes(raw[:8], "little")].rstrip(b" ")
            pad = (at - 8 - len(header)) % 64
            length = (len(header) + pad).to_bytes(8, "little")
            raw = length + header + b" " * pad + raw[8 + int.from_bytes(raw[:8], "little") :]
        (dst / f.name).write_bytes(raw)
    return dst
