"""Loopback addresses for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody listens on: bound, then released, for a service to bind next (the
    `closed_port` fixture holds one that must stay closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
