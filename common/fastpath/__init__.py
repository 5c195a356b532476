"""The fast path for activations between routers and expert services: frames over UCX.

The control plane (Describe, health, errors, registration) stays gRPC; the fast path carries only
expert calls, with the same checks and error classes, and every caller falls back to gRPC when it
fails. `frame` is the wire format (no UCX), `ucx` the runtime and frame I/O, `server` what an
expert service runs, `client` what a router calls through.

A service is reached by its UCX worker address, not a listening port: ucxx's listener takes no
bind address and would listen on every interface, while a worker address opens nothing (with
UCX_NET_DEVICES=lo its TCP transport stays on 127.0.0.1). The address travels as
`ucx-worker:<urlsafe base64>` in Describe.fast_paths and in the registry's Meta["fast_path"].
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import NamedTuple

FAST_PATH_MODES = ("auto", "ucx", "off")
MESH_ENV = "MOE_MESH_FAST_PATH"  # one switch for every service of a mesh, e.g. off
WORKER_SCHEME = "ucx-worker:"
# Consul refuses a Meta value over 512 characters; the advertisement must fit as a whole. A worker
# address is ~188 bytes with shared memory + TCP (252 characters encoded), 52 with UCX_TLS=tcp.
MAX_ADVERTISED_CHARS = 512
# A service or router bound to one of these keeps UCX's TCP transport on `lo` (see ucx.load_ucxx).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_SERVER = 0xFFFF  # servers on one worker are told apart by the low 16 bits of the hello tag


def mesh_fast_path() -> str:
    """A service's fast_path default: the mesh-wide MOE_MESH_FAST_PATH, else auto."""
    return os.environ.get(MESH_ENV, "auto").strip().lower() or "auto"


class Target(NamedTuple):
    """Where a client says hello: a UCX worker, and which of the servers on it (a process has one
    worker, and tests run several expert services in one process)."""

    address: bytes
    server: int


def worker_url(address: bytes, server: int) -> str:
    """The advertisement `ucx-worker:<base64 address>/<server>`; ValueError when it exceeds the
    Meta limit (many transports on a host with many devices: narrow UCX_TLS / UCX_NET_DEVICES)."""
    url = f"{WORKER_SCHEME}{base64.urlsafe_b64encode(address).decode()}/{server}"
    if len(url) > MAX_ADVERTISED_CHARS:
        raise ValueError(
            f"UCX worker address of {len(address)} bytes encodes to {len(url)} characters, over "
            f"the registry's {MAX_ADVERTISED_CHARS}; narrow UCX_TLS or UCX_NET_DEVICES"
        )
    return url


def parse_worker_url(urls: str | list[str] | tuple[str, ...]) -> Target | None:
    """The target of the first well-formed ucx-worker: entry among advertised fast paths, None if
    there is none (older services advertised ucx://host:port, which this router does not speak)."""
    for url in [urls] if isinstance(urls, str) else urls:
        url = url.strip()
        if not url.startswith(WORKER_SCHEME) or len(url) > MAX_ADVERTISED_CHARS:
            continue
        encoded, _, server = url[len(WORKER_SCHEME) :].partition("/")
        try:
            address = base64.urlsafe_b64decode(encoded.encode())
            number = int(server)
        except (binascii.Error, ValueError):
            continue
        if address and 0 < number <= MAX_SERVER:
            return Target(address, number)
    return None
