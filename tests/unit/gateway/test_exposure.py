"""gateway/exposure.py: a warning exactly when the public endpoints are open to other machines
without TLS or without API keys."""

from __future__ import annotations

import pytest

from gateway.exposure import exposure_warning, is_public


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"])
def test_loopback_is_not_public(host) -> None:
    assert not is_public(host)
    assert exposure_warning(host, tls=False, api_keys=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "gpu-7.lan"])
def test_every_other_address_or_name_is(host) -> None:
    assert is_public(host)


def test_every_interface_without_either_names_both_fixes() -> None:
    w = exposure_warning("0.0.0.0", tls=False, api_keys=False)
    assert w is not None and w.startswith(
        "the gateway's gRPC and HTTP endpoints listen on 0.0.0.0 (every interface) "
    )
    assert "--public-tls-cert" in w and "--api-key-file" in w and "MOE_GATEWAY_API_KEY" in w
    assert "--host 127.0.0.1" in w


def test_each_missing_half_is_named_alone() -> None:
    no_keys = exposure_warning("10.1.2.3", tls=True, api_keys=False)
    assert no_keys is not None and "--api-key-file" in no_keys and "--public-tls" not in no_keys
    assert "(not loopback)" in no_keys
    no_tls = exposure_warning("::", tls=False, api_keys=True)
    assert no_tls is not None and "--public-tls-cert" in no_tls and "--api-key-file" not in no_tls
    assert "in clear" in no_tls


def test_tls_and_keys_together_are_quiet() -> None:
    assert exposure_warning("0.0.0.0", tls=True, api_keys=True) is None
