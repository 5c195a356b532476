"""The warning a gateway (and `moe-mesh up`) gives when its public endpoints are open to other
machines without TLS or without API keys: a bind to 0.0.0.0 or :: (every interface) or to any
address that is not loopback."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_public(host: str) -> bool:
    """Whether other machines may reach `host`: every address but loopback's, and any name but
    localhost's (what a name resolves to can change)."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return False
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True


def exposure_warning(host: str, tls: bool, api_keys: bool) -> str | None:
    """One line naming what is missing and how to add it; None on loopback or when both are on."""
    if not is_public(host) or (tls and api_keys):
        return None
    where = "every interface" if host.strip("[]") in ("0.0.0.0", "::", "") else "not loopback"
    missing = [
        *([] if tls else ["TLS (--public-tls-cert/--public-tls-key, or --tls with `up`)"]),
        *([] if api_keys else ["API keys (--api-key-file, or MOE_GATEWAY_API_KEY)"]),
    ]
    exposed = {
        (False, False): "anyone who reaches it is served, in clear",
        (False, True): "keys, requests and replies travel in clear",
        (True, False): "anyone who reaches it is served",
    }[(tls, api_keys)]
    return (
        f"the gateway's gRPC and HTTP endpoints listen on {host} ({where}) without "
        f"{' and without '.join(missing)}: {exposed}; add them, or bind --host 127.0.0.1"
    )
