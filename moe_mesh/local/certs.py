"""`moe-mesh certs`: a private CA and one certificate per service, for a mesh under mutual TLS.

Each certificate serves and calls (both TLS usages), names the service and this machine
(localhost, 127.0.0.1, ::1) plus any --host given, and is signed by the CA. Keys are EC P-256,
written owner-only (0600). An existing CA in the directory is reused, so certificates for a new
service can be added later; existing service files are kept unless --force. A CA whose key is not
there (kept offline) is never replaced: the certificates already there are used as they are.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.errors import InvalidArgumentError
from common.tls import MeshTls

SERVICES = ("gateway", "router", "expert", "registry", "client")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
CA_FILE, CA_KEY_FILE = "ca.pem", "ca-key.pem"


@dataclass(frozen=True)
class ServiceFiles:
    cert: Path
    key: Path
    ca: Path


def files(directory: Path, service: str) -> ServiceFiles:
    """Where `service`'s certificate, key and the CA are in a certs directory."""
    return ServiceFiles(
        directory / f"{service}.pem", directory / f"{service}-key.pem", directory / CA_FILE
    )


def flags(directory: Path, service: str) -> list[str]:
    """The flags that give a service process its certificate in `directory`."""
    f = files(directory, service)
    return ["--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca)]


def mesh_tls(directory: Path, service: str) -> MeshTls:
    """A service's identity in `directory`, read and checked."""
    f = files(directory, service)
    return MeshTls.load(f.cert, f.key, f.ca)


def create(
    directory: Path,
    services: Iterable[str] = SERVICES,
    hosts: Iterable[str] = (),
    days: int = 365,
    force: bool = False,
    organization: str = "moe-mesh",
) -> dict[str, ServiceFiles]:
    """Write (or reuse) the CA and each service's certificate; returns the files per service."""
    if days < 1:
        raise InvalidArgumentError("days", f"must be at least 1, got {days}")
    services = list(dict.fromkeys(services))
    for service in services:
        if not service or "/" in service or service.startswith("."):
            raise InvalidArgumentError("service", f"{service!r} is not a file-name-safe name")
    directory.mkdir(parents=True, exist_ok=True)
    out = {s: files(directory, s) for s in services}
    missing = [s for s, f in out.items() if force or not (f.cert.exists() and f.key.exists())]
    if not missing:  # nothing to issue: the CA key may well be kept elsewhere
        return out
    ca_cert, ca_key = _ca(directory, organization, days)
    names = list(dict.fromkeys([*LOCAL_NAMES, *hosts]))
    for service in missing:
        paths = out[service]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(ca_cert, ca_key, key, service, [service, *names], days, organization)
        _write(paths.key, _key_pem(key), private=True)
        _write(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return out


def _ca(
    directory: Path, organization: str, days: int
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_FILE, directory / CA_KEY_FILE
    if cert_path.exists() and key_path.exists():
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            return x509.load_pem_x509_certificate(cert_path.read_bytes()), key  # type: ignore[return-value]
        except (ValueError, TypeError) as e:
            raise InvalidArgumentError(
                "certs", f"{directory}: {CA_FILE} or {CA_KEY_FILE} is not an unencrypted PEM ({e})"
            ) from None
    if cert_path.exists():  # a CA whose key is kept elsewhere: never replace it
        raise InvalidArgumentError(
            "certs",
            f"{directory} has {CA_FILE} but not {CA_KEY_FILE}: certificates it lacks "
            "cannot be issued here",
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{organization} CA"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=max(days, 3650)))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    service: str,
    names: list[str],
    days: int,
    organization: str,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
            x509.NameAttribute(NameOID.COMMON_NAME, service),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in dict.fromkeys(names)]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Atomically, and a private key owner-only from its first byte."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser(
        "certs",
        help="create a CA and per-service certificates for mutual TLS",
        description="Write a private CA (reused when the directory has one) and a certificate "
        "and key per service into DIR, for `moe-mesh up --tls --certs-dir DIR` or for the "
        "--tls-cert/--tls-key/--tls-ca flags of each service.",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write them")
    p.add_argument(
        "--service",
        action="append",
        default=None,
        help=f"a certificate for this name (repeatable; default {', '.join(SERVICES)})",
    )
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="another DNS name or IP address every certificate names, e.g. a Kubernetes "
        "service name (repeatable; localhost, 127.0.0.1 and ::1 always)",
    )
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing service certificates")
    p.set_defaults(func=_run)


def _run(args) -> int:
    made = create(args.out, args.service or SERVICES, args.host, args.days, args.force)
    print(f"CA          {args.out / CA_FILE}   (key {args.out / CA_KEY_FILE}: keep it private)")
    for service, f in made.items():
        print(f"{service:<11} {f.cert}  {f.key}")
    return 0
