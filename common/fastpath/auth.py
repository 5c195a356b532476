"""Who may use an expert service's fast path: a hello proves the caller holds a mesh certificate.

UCX has no TLS, so under mutual TLS a router's hello carries a proof: its certificate (DER) and a
signature, by the certificate's key, over the hello's facts (which server it is for, the client's
id and worker address, the time). The service checks the certificate was issued by its CA and is
valid, the signature, and that the time is within MAX_SKEW_S of its own clock; a hello that fails
is dropped, so the peer's calls never reach the core (it times out and the router falls back to
gRPC, which refuses it too). Binding the proof to the server's worker address and number keeps it
from being replayed to another service; the server opens its endpoint back to the signed client
address, so a replayed hello cannot open a session for the replayer.

Proof layout: timestamp (ms, u64), certificate length (u16), certificate DER, signature.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from common.fastpath.frame import FrameError
from common.tls import MeshTls

MAX_SKEW_S = 300.0  # hosts' clocks differ; NTP keeps them well within this
_PROOF = struct.Struct("<QH")
_CONTEXT = b"moe-mesh fast path hello\0"


def _statement(server: bytes, number: int, client_id: int, address: bytes, ms: int) -> bytes:
    return b"".join(
        [_CONTEXT, struct.pack("<HQQ", number, client_id, ms), _lv(server), _lv(address)]
    )


def _lv(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class HelloSigner:
    """The router's side: proofs signed with its mesh certificate's key."""

    cert_der: bytes
    key: object

    @classmethod
    def from_tls(cls, tls: MeshTls) -> HelloSigner:
        cert = x509.load_pem_x509_certificate(tls.cert)
        key = serialization.load_pem_private_key(tls.key, password=None)
        return cls(cert.public_bytes(serialization.Encoding.DER), key)

    def proof(self, server: bytes, number: int, client_id: int, address: bytes) -> bytes:
        ms = int(time.time() * 1000)
        signature = _sign(self.key, _statement(server, number, client_id, address, ms))
        return _PROOF.pack(ms, len(self.cert_der)) + self.cert_der + signature


class HelloVerifier:
    """The service's side: raises FrameError (field `hello`) for a hello it must not accept."""

    def __init__(self, tls: MeshTls, clock=time.time) -> None:
        self.ca = x509.load_pem_x509_certificate(tls.ca)
        self.clock = clock

    def check(
        self, proof: bytes, server: bytes, number: int, client_id: int, address: bytes
    ) -> None:
        if len(proof) <= _PROOF.size:
            raise FrameError("hello", "unauthenticated: no mesh certificate proof")
        ms, cert_len = _PROOF.unpack_from(proof)
        der = proof[_PROOF.size : _PROOF.size + cert_len]
        signature = proof[_PROOF.size + cert_len :]
        if len(der) != cert_len or not signature:
            raise FrameError("hello", "unauthenticated: truncated proof")
        now = self.clock()
        if abs(now - ms / 1000) > MAX_SKEW_S:
            raise FrameError(
                "hello", f"unauthenticated: proof time is {now - ms / 1000:+.0f} s off"
            )
        try:
            cert = x509.load_der_x509_certificate(der)
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature):
            raise FrameError(
                "hello", "unauthenticated: certificate not issued by the mesh CA"
            ) from None
        if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
            raise FrameError("hello", "unauthenticated: certificate outside its validity")
        try:
            _verify(
                cert.public_key(), signature, _statement(server, number, client_id, address, ms)
            )
        except (ValueError, TypeError, InvalidSignature):
            raise FrameError("hello", "unauthenticated: bad signature") from None


def _sign(key, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise TypeError(f"fast-path proofs cannot be signed with a {type(key).__name__}")


def _verify(key, signature: bytes, data: bytes) -> None:
    if isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    else:
        raise TypeError(type(key).__name__)
