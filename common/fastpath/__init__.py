"""The fast path for activations between routers and expert services: frames over UCX.

The control plane (Describe, health, errors, registration) stays gRPC; the fast path carries only
expert calls, with the same checks and error classes, and every caller falls back to gRPC when it
fails. `frame` is the wire format (no UCX), `ucx` the runtime and frame I/O, `server` the listener
an expert service runs, `client` the endpoint pool a router calls through.
"""

from __future__ import annotations

import os
import re

FAST_PATH_MODES = ("auto", "ucx", "off")
MESH_ENV = "MOE_MESH_FAST_PATH"  # one switch for every service of a mesh, e.g. off


def mesh_fast_path() -> str:
    """A service's fast_path default: the mesh-wide MOE_MESH_FAST_PATH, else auto."""
    return os.environ.get(MESH_ENV, "auto").strip().lower() or "auto"


def ucx_url(host: str, port: int) -> str:
    return f"ucx://[{host}]:{port}" if ":" in host else f"ucx://{host}:{port}"


def parse_ucx_url(urls: str | list[str] | tuple[str, ...]) -> tuple[str, int] | None:
    """(host, port) of the first ucx:// entry among advertised fast paths, None if there is none."""
    for url in [urls] if isinstance(urls, str) else urls:
        m = re.fullmatch(r"ucx://(?:\[([^\]]+)\]|([^:/\[\]]+)):(\d{1,5})", url.strip())
        if m and 0 < int(m.group(3)) < 65536:
            return m.group(1) or m.group(2), int(m.group(3))
    return None
