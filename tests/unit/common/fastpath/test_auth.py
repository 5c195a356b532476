"""The fast path's hello proof: a mesh certificate's key signs which server the hello is for, the
client's id and address and the time; anything else is refused with FrameError `hello`."""

from __future__ import annotations

import time

import pytest

from common.fastpath import frame as f
from common.fastpath.auth import MAX_SKEW_S, HelloSigner, HelloVerifier
from moe_mesh.local import certs

SERVER, NUMBER, CLIENT, ADDRESS = b"server-worker-address", 3, 12345, b"client-worker-address"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    mesh, other = tmp_path_factory.mktemp("mesh"), tmp_path_factory.mktemp("other")
    certs.create(mesh, ["router", "expert"])
    certs.create(other, ["router"])
    verifier = HelloVerifier(certs.mesh_tls(mesh, "expert"))
    return (
        HelloSigner.from_tls(certs.mesh_tls(mesh, "router")),
        HelloSigner.from_tls(certs.mesh_tls(other, "router")),
        verifier,
        mesh,
    )


def test_a_proof_of_the_mesh_passes_and_travels_in_the_hello(keys) -> None:
    signer, _, verifier, _ = keys
    proof = signer.proof(SERVER, NUMBER, CLIENT, ADDRESS)
    client_id, address, got = f.decode_hello(f.encode_hello(CLIENT, ADDRESS, proof=proof))
    verifier.check(got, SERVER, NUMBER, client_id, address)


def test_anything_else_is_refused(keys) -> None:
    signer, stranger, verifier, _ = keys
    good = signer.proof(SERVER, NUMBER, CLIENT, ADDRESS)
    cases = {
        "no mesh certificate proof": (b"", SERVER, NUMBER, CLIENT, ADDRESS),
        "truncated": (good[:40], SERVER, NUMBER, CLIENT, ADDRESS),
        "not issued by the mesh CA": (
            stranger.proof(SERVER, NUMBER, CLIENT, ADDRESS),
            SERVER,
            NUMBER,
            CLIENT,
            ADDRESS,
        ),
        # the same proof, replayed to another server, another server number, or for another client
        "bad signature": (good, b"another-server", NUMBER, CLIENT, ADDRESS),
    }
    for message, args in cases.items():
        with pytest.raises(f.FrameError, match=message):
            verifier.check(*args)
    for args in [(good, SERVER, 4, CLIENT, ADDRESS), (good, SERVER, NUMBER, 7, ADDRESS)]:
        with pytest.raises(f.FrameError, match="bad signature"):
            verifier.check(*args)
    with pytest.raises(f.FrameError, match="bad signature"):
        verifier.check(good, SERVER, NUMBER, CLIENT, b"somebody-else")
    tampered = good[:-1] + bytes([good[-1] ^ 1])
    with pytest.raises(f.FrameError, match="unauthenticated"):
        verifier.check(tampered, SERVER, NUMBER, CLIENT, ADDRESS)


def test_an_old_proof_is_refused(keys) -> None:
    signer, _, _, mesh = keys
    proof = signer.proof(SERVER, NUMBER, CLIENT, ADDRESS)
    expert = certs.mesh_tls(mesh, "expert")
    later = HelloVerifier(expert, clock=lambda: time.time() + MAX_SKEW_S + 5)
    with pytest.raises(f.FrameError, match="s off"):
        later.check(proof, SERVER, NUMBER, CLIENT, ADDRESS)
