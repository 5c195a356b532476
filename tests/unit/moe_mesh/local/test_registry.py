"""EmbeddedConsul (the registry `moe-mesh up` runs): Go durations, and what it refuses."""

from __future__ import annotations

import aiohttp
import pytest

from moe_mesh.local.registry import EmbeddedConsul, parse_duration


def test_go_durations_parse_like_consul():
    assert (
        parse_duration("5s") == 5.0
        and parse_duration("200ms") == 0.2
        and parse_duration("1m30s") == 90.0
    )
    assert parse_duration("10") == 10.0
    with pytest.raises(ValueError):
        parse_duration("5 parsecs")


async def test_embedded_rejects_what_it_cannot_check():
    server = EmbeddedConsul()
    address = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            bad = {"Name": "x", "Check": {"HTTP": "http://127.0.0.1:1/", "Interval": "1s"}}
            async with http.put(f"http://{address}/v1/agent/service/register", json=bad) as r:
                assert r.status == 400 and "GRPC" in await r.text()
            async with http.put(
                f"http://{address}/v1/agent/service/register", json={"ID": "x"}
            ) as r:
                assert r.status == 400
            async with http.get(f"http://{address}/v1/status/leader") as r:
                assert r.status == 200 and await r.json()
    finally:
        await server.stop()
