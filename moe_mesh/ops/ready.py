"""The ready file `moe-mesh up` writes, as every client command reads it."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import InvalidArgumentError


def read_ready_file(path: Path, *needs: str) -> dict:
    """The mesh `path` describes, holding every key in `needs`; InvalidArgumentError naming
    --ready-file (exit 2) when it is missing, unreadable, or not a ready file of `moe-mesh up`."""

    def refuse(why: str) -> InvalidArgumentError:
        return InvalidArgumentError("--ready-file", f"{path} {why}")

    try:
        mesh = json.loads(path.read_text())
    except FileNotFoundError:
        raise refuse("does not exist (is the mesh up?)") from None
    except OSError as e:  # a directory, no permission
        raise refuse(f"cannot be read: {e.strerror}") from None
    except ValueError:  # not JSON, not text
        raise refuse("is not a ready file of `moe-mesh up` (not JSON)") from None
    if not isinstance(mesh, dict):
        raise refuse("is not a ready file of `moe-mesh up` (not a JSON object)")
    if missing := [k for k in needs if k not in mesh]:
        raise refuse(f"is not a ready file of `moe-mesh up` (no {', '.join(missing)})")
    return mesh
