"""ConsulRegistry beyond the Registry protocol: Consul's index rules against a scripted server, and its
configuration from the environment."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from common.errors import InvalidArgumentError
from common.registry import Instance, Membership, open_registry
from common.registry.consul import ConsulConfig
from tests.support.registries import SERVICE, STEP_S, consul_client, ids


async def test_consul_client_index_rules_against_scripted_server():
    """Consul's documented index rules: echo the index back, reset it to 0 when it goes backwards
    or is not > 0, and yield only when the membership changes."""
    entry = {"Node": {"Node": "n", "Address": "127.0.0.1"}, "Checks": []}
    a = {
        **entry,
        "Service": {
            "ID": "a",
            "Service": SERVICE,
            "Tags": None,
            "Address": "",
            "Port": 1,
            "Meta": None,
        },
    }
    b = {
        **entry,
        "Service": {
            "ID": "b",
            "Service": SERVICE,
            "Tags": ["t"],
            "Address": "10.0.0.2",
            "Port": 2,
            "Meta": {"k": "v"},
        },
    }
    script = [(5, [a]), (7, [a]), (3, [a, b]), (4, [a, b]), (0, [b]), (6, [b])]
    sent: list[str | None] = []

    async def health(request: web.Request) -> web.Response:
        sent.append(request.query.get("index"))
        if not script:
            await asyncio.sleep(60)  # hold the last query, like a blocking query with nothing new
        index, body = script.pop(0)
        return web.json_response(body, headers={"X-Consul-Index": str(index)})

    app = web.Application()
    app.router.add_get(f"/v1/health/service/{SERVICE}", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    reg = consul_client(f"127.0.0.1:{sock.getsockname()[1]}")
    got: list[Membership] = []

    async def consume() -> None:
        async for m in reg.watch(SERVICE):
            got.append(m)

    consumer = asyncio.create_task(consume())
    try:
        async with asyncio.timeout(STEP_S):
            while len(sent) < 7:  # the 7th query is held: everything before it was handled
                await asyncio.sleep(0.01)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await reg.close()
        await runner.cleanup()
    assert [ids(m) for m in got] == [{"a"}, {"a", "b"}, {"b"}]
    assert got[0].instances[0].host == "127.0.0.1"  # empty service address -> the node's
    assert got[1].instances[1] == Instance(SERVICE, "b", "10.0.0.2", 2, ("t",), {"k": "v"})
    assert sent == [None, "5", "7", None, "4", None, "6"]


@pytest.mark.parametrize(
    "env, expect",
    [
        ({}, ("127.0.0.1", 8500, "http")),
        ({"CONSUL_HTTP_ADDR": "10.1.2.3:8600"}, ("10.1.2.3", 8600, "http")),
        ({"CONSUL_HTTP_ADDR": "https://consul.local:8501"}, ("consul.local", 8501, "https")),
        (
            {"CONSUL_HTTP_ADDR": "consul.local:8501", "CONSUL_HTTP_SSL": "true"},
            ("consul.local", 8501, "https"),
        ),
        ({"CONSUL_HTTP_ADDR": "[::1]:8500"}, ("::1", 8500, "http")),
    ],
)
def test_consul_config_from_environment(env, expect):
    c = ConsulConfig.from_env(env=env)
    assert (c.host, c.port, c.scheme) == expect


def test_consul_config_tls_and_token_sources(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {
        "CONSUL_HTTP_ADDR": "https://h:8501",
        "CONSUL_HTTP_TOKEN_FILE": str(token_file),
        "CONSUL_CACERT": "/ca.pem",
        "CONSUL_CLIENT_CERT": "/c.pem",
        "CONSUL_CLIENT_KEY": "/k.pem",
        "CONSUL_HTTP_SSL_VERIFY": "false",
    }
    c = ConsulConfig.from_env(env=env)
    assert (c.token, c.ca_file, c.client_cert, c.client_key, c.verify) == (
        "from-file",
        "/ca.pem",
        "/c.pem",
        "/k.pem",
        False,
    )
    assert (
        ConsulConfig.from_env(token="explicit", env={**env, "CONSUL_HTTP_TOKEN": "env"}).token
        == "explicit"
    )
    assert (
        ConsulConfig.from_env(address="http://x:1", env=env).address == "http://x:1"
    )  # explicit wins
    assert (
        ConsulConfig.from_env(
            env={"CONSUL_HTTP_ADDR": "https://h:1", "CONSUL_HTTP_SSL_VERIFY": "false"}
        ).ssl_context()
        is False
    )
    with pytest.raises(ValueError):
        ConsulConfig.from_env(env={"CONSUL_HTTP_ADDR": "h:notaport"})
    with pytest.raises(ValueError, match=r"CONSUL_HTTP_TOKEN_FILE=\S*nowhere cannot be read"):
        ConsulConfig.from_env(env={"CONSUL_HTTP_TOKEN_FILE": str(tmp_path / "nowhere")})


def test_a_service_given_a_malformed_registry_address_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="registry: Consul address 'not a url:xx'"):
        open_registry("consul", "not a url:xx")
