"""Mutual TLS inside the mesh: one certificate, key and CA per service, used both ways.

A service with `tls_cert`, `tls_key` and `tls_ca` serves gRPC only to callers whose certificate
chains to `tls_ca` (mutual TLS), and presents its own certificate when it calls other services,
whose certificates must chain to the same CA and name the dialed host (or `tls_server_name`).
The files are read and checked once at start-up, so a wrong path, a key of another certificate
or an expired certificate is a one-line settings error rather than a failed handshake later.
`moe-mesh certs` writes a CA and per-service certificates for a local mesh.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from common.errors import InvalidArgumentError

TLS_FIELDS = ("tls_cert", "tls_key", "tls_ca")


class SecuritySettings(BaseSettings):
    """The fields every service's settings model inherits: its mesh identity, and reflection."""

    reflection: bool = Field(
        False,
        description="serve gRPC server reflection (lists every method to anyone who can "
        "connect; for debugging with grpcurl)",
    )

    tls_cert: Path | None = Field(
        None,
        description="PEM certificate of this service, signed by tls_ca; with tls_key and tls_ca "
        "it turns on mutual TLS for every gRPC connection of the mesh (and the fast path's "
        "handshake)",
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(
        None, description="PEM CA certificate that peers' certificates must be signed by"
    )
    tls_server_name: str | None = Field(
        None,
        description="name peers' certificates must carry instead of the dialed host (when "
        "certificates name services rather than addresses)",
    )
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve the gRPC health service (and nothing else) in plaintext on this "
        "port, with the statuses of the main port: for probes that cannot speak TLS, such as "
        "Kubernetes' native gRPC probe; unset: none",
    )

    @model_validator(mode="after")
    def _all_or_none(self) -> SecuritySettings:
        given = [f for f in TLS_FIELDS if getattr(self, f) is not None]
        if given and len(given) != len(TLS_FIELDS):
            missing = sorted(set(TLS_FIELDS) - set(given))
            raise ValueError(f"{', '.join(given)} given without {', '.join(missing)}")
        return self


@dataclass(frozen=True)
class MeshTls:
    """A service's mesh identity, read and checked: PEM bytes as gRPC wants them."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None

    @classmethod
    def from_settings(cls, settings: SecuritySettings) -> MeshTls | None:
        """None without TLS settings; InvalidArgumentError naming the field for a bad file."""
        if settings.tls_cert is None:
            return None
        assert settings.tls_key is not None and settings.tls_ca is not None
        return cls.load(
            settings.tls_cert, settings.tls_key, settings.tls_ca, settings.tls_server_name
        )

    @classmethod
    def load(cls, cert: Path, key: Path, ca: Path, server_name: str | None = None) -> MeshTls:
        cert_pem, key_pem, certificate = load_identity(cert, key)
        ca_pem = _read(ca, "tls_ca")
        authority = _certificate(ca_pem, "tls_ca")
        try:
            certificate.verify_directly_issued_by(authority)
        except (InvalidSignature, ValueError, TypeError) as e:  # InvalidSignature has no message
            raise InvalidArgumentError(
                "tls_cert", f"{cert} is not signed by the CA in {ca} ({type(e).__name__})"
            ) from None
        _check_validity(authority, "tls_ca", ca)
        return cls(cert_pem, key_pem, ca_pem, server_name)

    @classmethod
    def ca_only(cls, ca: Path) -> MeshTls:
        """A client of public TLS endpoints: it checks the server, presents no certificate."""
        ca_pem = _read(ca, "tls_ca")
        _certificate(ca_pem, "tls_ca")
        return cls(b"", b"", ca_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: callers must present a certificate of this CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.key or None,
            certificate_chain=self.cert or None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def load_identity(
    cert: Path, key: Path, fields: tuple[str, str] = ("tls_cert", "tls_key")
) -> tuple[bytes, bytes, x509.Certificate]:
    """A certificate and its key, checked to belong together and be valid now."""
    cert_pem, key_pem = _read(cert, fields[0]), _read(key, fields[1])
    certificate = _certificate(cert_pem, fields[0])
    private = _private_key(key_pem, fields[1])
    if _public_der(private.public_key()) != _public_der(certificate.public_key()):
        raise InvalidArgumentError(fields[1], f"{key} is not the key of {cert}")
    _check_validity(certificate, fields[0], cert)
    return cert_pem, key_pem, certificate


def public_server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """TLS without client certificates: a public endpoint, where callers prove themselves with
    API keys instead."""
    cert_pem, key_pem, _ = load_identity(cert, key, ("public_tls_cert", "public_tls_key"))
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def open_channel(
    address: str,
    options: list[tuple[str, Any]],
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    tls: MeshTls | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to a mesh service: mutual TLS with `tls`, plaintext without."""
    kwargs: dict[str, Any] = {"interceptors": list(interceptors) or None}
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, **kwargs)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=options + tls.channel_options(), **kwargs
    )


def _read(path: Path, field: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InvalidArgumentError(field, f"cannot read {path}: {e.strerror or e}") from None


def _certificate(pem: bytes, field: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise InvalidArgumentError(field, "not a PEM certificate") from None


def _private_key(pem: bytes, field: str) -> Any:
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            field, "not an unencrypted PEM private key (gRPC cannot use a passphrase)"
        ) from None


def _public_der(key: Any) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _check_validity(cert: x509.Certificate, field: str, path: Path) -> None:
    now = datetime.datetime.now(datetime.UTC)
    if now < cert.not_valid_before_utc:
        raise InvalidArgumentError(field, f"{path} is not valid before {cert.not_valid_before_utc}")
    if now > cert.not_valid_after_utc:
        raise InvalidArgumentError(field, f"{path} expired on {cert.not_valid_after_utc}")
