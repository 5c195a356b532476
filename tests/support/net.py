"""Loopback addresses for tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def bound_port(listen: bool = False) -> Iterator[int]:
    """A loopback port bound here while the block runs, so no other process can take it: never
    listened on (connections are refused), or with `listen` taken as a user's other server takes
    one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if listen:
            s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    """A loopback port nobody listens on: bound, then released, for a service to bind next (the
    `closed_port` fixture holds one that must stay closed)."""
    with bound_port() as port:
        return port


def asgi_post_scope(path: str, body: bytes) -> dict:
    """The ASGI scope of a JSON POST of `body` to `path`, for driving an app by hand where a client
    cannot (a disconnect at a chosen moment)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
