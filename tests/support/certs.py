"""Certificates for TLS tests: a mesh CA and another one, made once per directory."""

from __future__ import annotations

from pathlib import Path

from moe_mesh.common.tls import MeshTls
from moe_mesh.local import certs


def mesh_tls(directory: Path, service: str) -> MeshTls:
    f = certs.files(directory, service)
    return MeshTls.load(f.cert, f.key, f.ca)


def tls_flags(directory: Path, service: str) -> dict[str, Path]:
    """A service's settings fields for its certificate in `directory`."""
    f = certs.files(directory, service)
    return {"tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca}


def tls_args(directory: Path, service: str) -> list[str]:
    """A service process's flags for its certificate in `directory`."""
    f = certs.files(directory, service)
    return ["--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca)]
