"""Certificates for TLS tests: a service's settings fields for its certificate."""

from __future__ import annotations

from pathlib import Path

from moe_mesh.local import certs


def tls_flags(directory: Path, service: str) -> dict[str, Path]:
    """A service's settings fields for its certificate in `directory`."""
    f = certs.files(directory, service)
    return {"tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca}
