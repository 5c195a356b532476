"""moe_mesh/ops/hints.py: a failed command's error names the fix that applies."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.errors import (
    ExpertUnavailableError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from moe_mesh.cli import main
from moe_mesh.local import certs
from moe_mesh.ops.hints import API_KEY_ENV, hint

HANDSHAKE = (
    "ipv4:127.0.0.1:1: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
    "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED"
)


def test_a_refused_key_names_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    e = UnauthenticatedError("UNAUTHENTICATED: missing API key")
    assert hint(e) == (
        f"; put one of the keys in the gateway's --api-key-file in {API_KEY_ENV} "
        "(it is not set here)"
    )
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    assert hint(e).endswith("(it was refused)")


def test_missing_experts_name_status_and_scale() -> None:
    h = hint(ExpertUnavailableError(1, [7]))
    assert "`moe-mesh status --ready-file FILE`" in h and "`moe-mesh scale --ready-file" in h
    # as the gateway's details carry it to a client, in an UnavailableError
    assert h == hint(UnavailableError("UNAVAILABLE: no reachable replica for layer 1 expert(s) 7"))


def test_a_tls_failure_names_the_ca_flag_and_file() -> None:
    h = hint(UnavailableError(f"UNAVAILABLE: failed to connect to all addresses; {HANDSHAKE}"))
    assert h.startswith("; the TLS handshake failed:")
    assert "--tls-ca FILE" in h and "RUN_DIR/certs/ca.pem" in h


def test_unreachable_asks_about_the_address_and_tls_only_when_hung_up_on() -> None:
    plain = hint(UnavailableError("UNAVAILABLE: failed to connect: Connection refused"))
    assert "is the mesh up" in plain and "--tls-ca" not in plain
    closed = hint(UnavailableError("UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"))
    assert "is the mesh up" in closed and "--tls-ca FILE" in closed


def test_no_hint_where_none_applies_or_one_was_asked() -> None:
    assert hint(InvalidArgumentError("--max-tokens", "must be at least 1")) == ""
    assert hint(UnavailableError("is the gateway up?")) == ""


@pytest.fixture
def tls_gateway(tmp_path):
    """A gRPC server on TLS with a certificate of a CA of its own (health only)."""
    certs.create(tmp_path / "mesh")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = certs.mesh_tls(tmp_path / "mesh", "gateway").server_credentials()
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("ca", ["none", "another"])
def test_generate_at_a_tls_gateway_names_tls_ca(tls_gateway, tmp_path, capsys, ca) -> None:
    flags = ["--gateway", tls_gateway, "--prompt-token-ids", "1,2", "--max-tokens", "1"]
    if ca == "another":
        certs.create(tmp_path / "other")
        flags += ["--tls-ca", str(certs.files(tmp_path / "other", "client").ca)]
    assert main(["generate", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-mesh generate: error: ") and err.count("\n") == 1, err
    assert "--tls-ca FILE" in err, err
