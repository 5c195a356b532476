"""Loopback addresses for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody listens on: bound, then released (what a closed port or a fresh
    service's port looks like)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
