"""Mesh TLS settings and files: all three or none, and every bad file is a one-line error naming
its field before any connection is tried."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from pydantic import ValidationError

from common.errors import InvalidArgumentError
from common.tls import MeshTls, SecuritySettings, load_identity
from moe_mesh.local import certs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    mesh, other = tmp_path_factory.mktemp("mesh"), tmp_path_factory.mktemp("other")
    certs.create(mesh, ["router", "expert"])
    certs.create(other, ["router"])
    return mesh, other


def test_the_three_files_come_together_or_not_at_all(tmp_path) -> None:
    assert SecuritySettings().tls_cert is None
    assert MeshTls.from_settings(SecuritySettings()) is None
    with pytest.raises(ValidationError, match="tls_cert given without tls_ca, tls_key"):
        SecuritySettings(tls_cert=tmp_path / "c.pem")


def test_a_good_identity_loads(dirs) -> None:
    mesh, _ = dirs
    f = certs.files(mesh, "router")
    tls = MeshTls.from_settings(SecuritySettings(tls_cert=f.cert, tls_key=f.key, tls_ca=f.ca))
    assert tls is not None and tls.cert.startswith(b"-----BEGIN CERTIFICATE")
    assert tls.channel_options() == []
    named = MeshTls.load(f.cert, f.key, f.ca, "router")
    assert named.channel_options() == [("grpc.ssl_target_name_override", "router")]


def test_bad_files_name_their_field(dirs, tmp_path) -> None:
    mesh, other = dirs
    r, e, o = certs.files(mesh, "router"), certs.files(mesh, "expert"), certs.files(other, "router")
    junk = tmp_path / "junk.pem"
    junk.write_text("not pem")
    cases = [
        ((tmp_path / "missing.pem", r.key, r.ca), "tls_cert", "cannot read"),
        ((junk, r.key, r.ca), "tls_cert", "not a PEM certificate"),
        ((r.cert, junk, r.ca), "tls_key", "not an unencrypted PEM private key"),
        ((r.cert, e.key, r.ca), "tls_key", "is not the key of"),
        ((r.cert, r.key, junk), "tls_ca", "not a PEM certificate"),
        ((o.cert, o.key, r.ca), "tls_cert", "is not signed by the CA"),
    ]
    for files, field, message in cases:
        with pytest.raises(InvalidArgumentError, match=message) as info:
            MeshTls.load(*files)
        assert info.value.field == field


def test_an_expired_certificate_is_refused(dirs, tmp_path) -> None:
    mesh, _ = dirs
    ca_key = serialization.load_pem_private_key((mesh / certs.CA_KEY_FILE).read_bytes(), None)
    ca = x509.load_pem_x509_certificate((mesh / certs.CA_FILE).read_bytes())
    r = certs.files(mesh, "router")
    old = x509.load_pem_x509_certificate(r.cert.read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(ca.subject)
        .public_key(old.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=10))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    path = tmp_path / "expired.pem"
    path.write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(InvalidArgumentError, match="expired on"):
        load_identity(path, r.key)


def test_a_client_of_public_endpoints_needs_only_the_ca(dirs) -> None:
    mesh, _ = dirs
    tls = MeshTls.ca_only(mesh / certs.CA_FILE)
    assert tls.cert == tls.key == b"" and tls.ca
    tls.channel_credentials()  # no certificate to present: still valid credentials
