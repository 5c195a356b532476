"""A safetensors file's JSON header, read and bounds-checked without torch: what the checkpoint's
shape check (common/arch/shapes.py, before any service starts) and the loader
(common/safetensors_mmap.py) both read first."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from common.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header object, the offset its data starts at, the file's size); a file too short, a length
    past the file or the limit, or text that is not a JSON object is a CheckpointError naming it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    "corrupt safetensors header: file shorter than 8 bytes", file=str(path)
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"corrupt safetensors header: header length {header_len} exceeds the file "
                    f"size {size}",
                    file=str(path),
                )
            header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"corrupt safetensors header: not valid JSON ({e})", file=str(path)
        ) from e
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file: {e}", file=str(path)) from e
    if not isinstance(header, dict):
        raise CheckpointError("corrupt safetensors header: not a JSON object", file=str(path))
    return header, 8 + header_len, size
