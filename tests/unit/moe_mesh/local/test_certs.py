"""`moe-mesh certs`: a CA and per-service certificates that serve and call, name this machine,
keep keys owner-only, and reuse the CA for certificates added later."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.errors import InvalidArgumentError
from common.tls import MeshTls
from moe_mesh.local import certs
from tests.support.cli import moe_mesh


def test_certificates_chain_to_the_ca_and_name_the_service_and_this_machine(tmp_path) -> None:
    made = certs.create(tmp_path, ["router"], hosts=["router.mesh.svc", "10.0.0.7"], days=30)
    f = made["router"]
    MeshTls.load(f.cert, f.key, f.ca)  # checks the chain, the key and the validity
    cert = x509.load_pem_x509_certificate(f.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {
        "router",
        "localhost",
        "router.mesh.svc",
    }
    assert set(names.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")
    }
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert 29 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 31
    for key in (f.key, tmp_path / certs.CA_KEY_FILE):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_the_ca_is_reused_and_existing_certificates_kept_unless_forced(tmp_path) -> None:
    first = certs.create(tmp_path, ["router"])["router"]
    ca, router = first.ca.read_bytes(), first.cert.read_bytes()
    later = certs.create(tmp_path, ["router", "expert"])
    assert later["router"].cert.read_bytes() == router
    assert first.ca.read_bytes() == ca
    e = later["expert"]
    MeshTls.load(e.cert, e.key, e.ca)  # signed by the same CA
    certs.create(tmp_path, ["router"], force=True)
    assert first.cert.read_bytes() != router


def test_the_command_writes_every_service_and_refuses_bad_input(tmp_path) -> None:
    out = moe_mesh("certs", "--out", str(tmp_path / "c"))
    assert out.returncode == 0, out.stderr
    for service in certs.SERVICES:
        assert service in out.stdout and (tmp_path / "c" / f"{service}.pem").exists()
    bad = moe_mesh("certs", "--out", str(tmp_path / "d"), "--days", "0")
    assert bad.returncode == 2 and "days" in bad.stderr
    bad = moe_mesh("certs", "--out", str(tmp_path / "d"), "--service", "../x")
    assert bad.returncode == 2 and "service" in bad.stderr


def test_a_ca_kept_elsewhere_is_never_replaced_and_a_broken_one_is_named(tmp_path) -> None:
    made = certs.create(tmp_path, ["router"])["router"]
    (tmp_path / certs.CA_KEY_FILE).unlink()  # the CA key lives offline
    ca = made.ca.read_bytes()
    assert certs.create(tmp_path, ["router"])["router"] == made  # nothing to issue: fine
    with pytest.raises(InvalidArgumentError, match="has ca.pem but not ca-key.pem"):
        certs.create(tmp_path, ["router", "expert"])
    assert made.ca.read_bytes() == ca and not (tmp_path / "expert.pem").exists()
    (tmp_path / certs.CA_KEY_FILE).write_text("junk")
    with pytest.raises(InvalidArgumentError, match="not an unencrypted PEM"):
        certs.create(tmp_path, ["expert"])
