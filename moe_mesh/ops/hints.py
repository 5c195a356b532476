"""The fix a failed client command's error points at, appended to its one line: a TLS failure names
the CA flag and file, an expert no replica serves the commands that show and restore one, a refused
API key the variable it comes from, an unreachable address the usual mistakes."""

from __future__ import annotations

import os

from common.errors import ExpertUnavailableError, UnauthenticatedError, UnavailableError

API_KEY_ENV = "MOE_MESH_API_KEY"  # the API key clients of a gateway send (generate, bench)
# What gRPC's details hold when the TLS handshake failed: a certificate not signed by the CA given
# ("Tls handshake failed ... CERTIFICATE_VERIFY_FAILED"), or a client speaking TLS to plaintext.
_TLS_WORDS = ("handshake", "certificate", "ssl_error", "tsi_")
CA = (
    "give the CA that signed the gateway's certificate with --tls-ca FILE (`moe-mesh up --tls` "
    "writes it to RUN_DIR/certs/ca.pem, and its ready file names it: --ready-file uses it)"
)
REACH = "is the mesh up, and is the address (or --ready-file) the one `moe-mesh up` printed?"


def hint(e: BaseException) -> str:
    """'; what to do' for error `e`, or '' when its message already asks (ends in a question)."""
    text = str(e)
    low = text.lower()
    if isinstance(e, UnauthenticatedError) or "UNAUTHENTICATED" in text:
        where = "is not set here" if not os.environ.get(API_KEY_ENV) else "was refused"
        return (
            f"; put one of the keys in the gateway's --api-key-file in {API_KEY_ENV} (it {where})"
        )
    if isinstance(e, ExpertUnavailableError) or "no reachable replica" in text:
        return (
            "; `moe-mesh status --ready-file FILE` lists the experts no replica serves, and "
            "`moe-mesh scale --ready-file FILE --experts SPEC --replicas N` starts replicas of "
            "their group"
        )
    if any(word in low for word in _TLS_WORDS):
        return f"; the TLS handshake failed: {CA}"
    if "?" in text:
        return ""
    if "socket closed" in low:  # a plaintext client at a TLS server is hung up on
        return f"; {REACH} If the gateway serves TLS, {CA}"
    if isinstance(e, UnavailableError) or "UNAVAILABLE" in text or "DEADLINE" in text:
        return f"; {REACH}"
    return ""
