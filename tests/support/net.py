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
