"""`ConsulRegistry`: the Registry protocol on a Consul agent's HTTP API, via py-consul's asyncio client.

Works against a real agent and against the embedded registry of `moe-mesh up` (moe_mesh/local/registry.py) alike. Registration is an agent
service with a gRPC health check, so Consul (not the service) decides when an instance is passing;
watching is a loop of blocking queries on `/v1/health/service/<name>?passing`.

Connection settings follow the Consul CLI's environment variables, so one exported CONSUL_HTTP_ADDR
reaches every service: CONSUL_HTTP_ADDR ("host:port" or "http(s)://host:port"), CONSUL_HTTP_TOKEN
(or CONSUL_HTTP_TOKEN_FILE), CONSUL_HTTP_SSL, CONSUL_HTTP_SSL_VERIFY, CONSUL_CACERT, CONSUL_CAPATH,
CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY. Explicit arguments win over the environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import consul
import consul.aio
import consul.base
import consul.exceptions

from common.errors import InvalidArgumentError, PreconditionError, UnavailableError
from common.registry import Instance, Membership

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:8500"
# Errors that mean "the registry cannot answer right now"; anything else is a bug and propagates.
_REGISTRY_ERRORS = (
    consul.ConsulException,
    aiohttp.ClientError,
    OSError,
    TimeoutError,
    ValueError,
    KeyError,
    TypeError,
)


def _why(e: BaseException) -> str:
    """One line for a failed request: aiohttp's own text ("Cannot connect to host ..."), or the
    exception's class when it has none (a timeout)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def go_duration(seconds: float) -> str:
    """Seconds as a Go duration string, the format Consul expects for intervals and `wait`."""
    return f"{max(1, round(seconds * 1000))}ms"


@dataclass(frozen=True)
class ConsulConfig:
    """Where and how to reach the agent; `from_env` fills gaps from the Consul CLI's variables."""

    host: str = "127.0.0.1"
    port: int = 8500
    scheme: str = "http"
    token: str | None = None
    verify: bool = True  # verify the agent's TLS certificate (https only)
    ca_file: str | None = None
    ca_path: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @classmethod
    def from_env(
        cls,
        address: str | None = None,
        token: str | None = None,
        *,
        scheme: str | None = None,
        verify: bool | None = None,
        ca_file: str | None = None,
        ca_path: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ConsulConfig:
        env = os.environ if env is None else env
        raw = address or env.get("CONSUL_HTTP_ADDR") or DEFAULT_ADDRESS
        if raw.startswith("unix://"):
            raise ValueError(f"Consul address {raw!r}: unix sockets are not supported")
        parsed = urllib.parse.urlsplit(raw if "//" in raw else f"//{raw}")
        try:
            host, port = parsed.hostname, parsed.port or 8500
        except ValueError as e:  # a non-numeric port
            raise ValueError(
                f"Consul address {raw!r} is not host:port or http(s)://host:port"
            ) from e
        if not host:
            raise ValueError(f"Consul address {raw!r} is not host:port or http(s)://host:port")
        if scheme is None:
            # As in the Consul CLI, CONSUL_HTTP_SSL=true upgrades a bare host:port to https.
            ssl_env = env.get("CONSUL_HTTP_SSL", "").lower() in ("1", "true")
            scheme = parsed.scheme or ("https" if ssl_env else "http")
        if scheme not in ("http", "https"):
            raise ValueError(f"Consul address {raw!r}: scheme must be http or https")
        if token is None:
            token = env.get("CONSUL_HTTP_TOKEN") or None
            if token is None and (path := env.get("CONSUL_HTTP_TOKEN_FILE")):
                try:
                    with open(path) as f:
                        token = f.read().strip() or None
                except OSError as e:
                    raise ValueError(
                        f"CONSUL_HTTP_TOKEN_FILE={path} cannot be read: {e.strerror}"
                    ) from None
        if verify is None:
            verify = env.get("CONSUL_HTTP_SSL_VERIFY", "true").lower() not in ("0", "false")
        return cls(
            host=host,
            port=port,
            scheme=scheme,
            token=token,
            verify=verify,
            ca_file=ca_file or env.get("CONSUL_CACERT") or None,
            ca_path=ca_path or env.get("CONSUL_CAPATH") or None,
            client_cert=client_cert or env.get("CONSUL_CLIENT_CERT") or None,
            client_key=client_key or env.get("CONSUL_CLIENT_KEY") or None,
        )

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What aiohttp's `ssl=` gets: a context carrying CA and client certificate, or False to skip checks."""
        if self.scheme != "https":
            return True  # unused for http
        if not self.verify and not self.client_cert:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file, capath=self.ca_path)
        if not self.verify:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class _HTTPClient(consul.aio.HTTPClient):
    """py-consul's aiohttp adapter with a connector built the current way.

    py-consul 1.8.0 passes `verify_ssl`/`ssl_context` to aiohttp's TCPConnector, which aiohttp 3.14
    deprecates (a DeprecationWarning on every client, an error under our warnings policy), and
    reads responses without a context manager, which leaks the connection when a blocking query is
    cancelled. Both are replaced here; the get/put/... request builders are py-consul's.
    """

    def __init__(self, host: str, port: int, scheme: str, ssl_param: ssl.SSLContext | bool) -> None:
        consul.base.HTTPClient.__init__(self, host, port, scheme, verify=ssl_param is not False)
        if ":" in host:  # py-consul formats f"{scheme}://{host}:{port}", unusable for IPv6 literals
            self.base_uri = f"{scheme}://[{host}]:{port}"
        self.loop = None
        # No session-wide timeout: blocking queries legitimately last `wait`; callers bound each call.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl_param), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def _request(
        self, callback, method, uri, headers, data=None, connections_timeout=None, raw=False
    ):
        async with self._session.request(method, uri, headers=headers, data=data) as resp:
            body = await resp.read() if raw else await resp.text(encoding="utf-8")
            return callback(consul.base.Response(resp.status, resp.headers, body))


class _Consul(consul.aio.Consul):
    def __init__(self, config: ConsulConfig) -> None:
        self._ssl_param = config.ssl_context()
        # Explicit host/port/scheme/verify keep py-consul from consulting the environment itself.
        super().__init__(
            host=config.host, port=config.port, scheme=config.scheme, verify=config.verify
        )
        self.token = (
            config.token
        )  # py-consul lets CONSUL_HTTP_TOKEN override an explicit token; we do not

    def http_connect(self, host, port, scheme, verify=True, cert=None):
        return _HTTPClient(host, port, scheme, self._ssl_param)


def _instance(entry: dict[str, Any]) -> Instance:
    svc = entry["Service"]
    # Consul's convention: an empty service address means "the node's address".
    host = svc.get("Address") or entry.get("Node", {}).get("Address", "")
    return Instance(
        service=svc["Service"],
        id=svc["ID"],
        host=host,
        port=int(svc.get("Port") or 0),
        tags=tuple(svc.get("Tags") or ()),
        meta=dict(svc.get("Meta") or {}),
    )


class ConsulRegistry:
    """Registry on a Consul agent (or `EmbeddedConsul`).

    The HTTP session is created on first use, inside the running event loop, so constructing a
    registry is cheap and loop-agnostic. `wait_s` is the blocking-query wait; every call is also
    bounded client-side (`wait_s` plus Consul's wait/16 jitter plus `request_timeout_s`) so a
    silently dead agent cannot hang a watch. A watch reports its membership stale as soon as a
    query goes `stale_after_s` past that wait window unanswered (a frozen agent), not only once
    the call fails.
    """

    def __init__(
        self,
        address: str | None = None,
        token: str | None = None,
        *,
        scheme: str | None = None,
        verify: bool | None = None,
        ca_file: str | None = None,
        ca_path: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        wait_s: float = 10.0,
        request_timeout_s: float = 10.0,
        stale_after_s: float = 2.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.config = ConsulConfig.from_env(
            address,
            token,
            scheme=scheme,
            verify=verify,
            ca_file=ca_file,
            ca_path=ca_path,
            client_cert=client_cert,
            client_key=client_key,
        )
        self.wait_s = wait_s
        self.request_timeout_s = request_timeout_s
        self.stale_after_s = stale_after_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._consul: _Consul | None = None

    def _client(self) -> _Consul:
        if self._consul is None:
            self._consul = _Consul(self.config)
        return self._consul

    async def register(
        self,
        instance: Instance,
        check_interval_s: float = 2.0,
        deregister_critical_after_s: float = 30.0,
    ) -> None:
        """Register `instance` with a gRPC health check on its endpoint; re-registering an id replaces it.

        Raises UnavailableError if the agent cannot be reached, InvalidArgumentError if it rejects the
        registration (e.g. meta beyond Consul's limits: 64 keys, values up to 512 characters) and
        PreconditionError if its ACLs deny it.
        """
        check = consul.Check.grpc(
            instance.endpoint,
            go_duration(check_interval_s),
            # Under mutual TLS the agent presents its own certificate: Consul's
            # enable_agent_tls_for_checks, with a certificate of the mesh CA (docs/operating/security.md).
            use_tls=instance.tls or None,
            timeout=go_duration(min(check_interval_s, 5.0)),
            deregister=go_duration(deregister_critical_after_s),
        )
        try:
            async with asyncio.timeout(self.request_timeout_s):
                ok = await self._client().agent.service.register(
                    instance.service,
                    service_id=instance.id,
                    address=instance.host,
                    port=instance.port,
                    tags=list(instance.tags),
                    meta=dict(instance.meta),
                    check=check,
                    replace_existing_checks=True,
                )
        # e.g. meta beyond Consul's limits: retrying will not help
        except consul.exceptions.BadRequest as e:
            raise InvalidArgumentError("instance", f"registry rejected {instance.id}: {e}") from e
        except (consul.exceptions.ACLPermissionDenied, consul.exceptions.ACLDisabled) as e:
            raise PreconditionError(
                f"registry {self.config.address} denied registering {instance.id} "
                f"(check CONSUL_HTTP_TOKEN): {e}"
            ) from e
        except _REGISTRY_ERRORS as e:
            raise UnavailableError(
                f"cannot register {instance.id} at {self.config.address} ({_why(e)}): is a "
                "Consul agent running there? (--registry-address, CONSUL_HTTP_ADDR)"
            ) from e
        if not ok:
            raise UnavailableError(f"{self.config.address} refused to register {instance.id}")

    async def deregister(self, instance_id: str) -> None:
        """Remove `instance_id` (unknown ids are fine); raises UnavailableError if the agent is unreachable."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._client().agent.service.deregister(instance_id)
        except _REGISTRY_ERRORS as e:
            raise UnavailableError(
                f"cannot deregister {instance_id} at {self.config.address}: {_why(e)}"
            ) from e

    async def _query(self, service: str, index: int) -> tuple[int, tuple[Instance, ...]]:
        # index 0 makes py-consul omit both `index` and `wait`: a plain read that returns at once.
        bound = (self.wait_s * 17 / 16 if index else 0.0) + self.request_timeout_s
        async with asyncio.timeout(bound):
            raw_index, entries = await self._client().health.service(
                service, index=index or None, wait=go_duration(self.wait_s), passing=True
            )
        instances = tuple(sorted((_instance(e) for e in entries or ()), key=lambda i: i.id))
        return int(raw_index), instances  # py-consul hands the X-Consul-Index header back as a str

    async def instances(self, service: str) -> tuple[Instance, ...]:
        """The passing instances of `service` now (one plain read); UnavailableError naming the
        agent where it cannot be read."""
        try:
            return (await self._query(service, 0))[1]
        except _REGISTRY_ERRORS as e:
            raise UnavailableError(
                f"registry {self.config.address} unreachable: {_why(e)}"
            ) from None

    async def watch(self, service: str) -> AsyncIterator[Membership]:
        """See `Registry.watch`. Each iterator keeps its own index; after an error the next query is
        a plain read so a recovered (maybe restarted, index reset) agent is seen at once."""
        index, last, stale = 0, None, False
        backoff = self.backoff_initial_s
        while True:
            query = asyncio.ensure_future(self._query(service, index))
            try:
                if not stale:
                    # Consul answers a blocking query by wait + wait/16; silence past that means trouble.
                    window = (self.wait_s * 17 / 16 if index else 0.0) + self.stale_after_s
                    done, _ = await asyncio.wait({query}, timeout=window)
                    if not done:
                        log.warning(
                            "registry %s has not answered for %.1fs while watching %s",
                            self.config.address,
                            window,
                            service,
                        )
                        stale = True
                        yield Membership.stale_from(last)
                new_index, instances = await query
            except _REGISTRY_ERRORS as e:
                if not stale:
                    log.warning(
                        "registry %s unreachable while watching %s: %s",
                        self.config.address,
                        service,
                        _why(e),
                    )
                    stale = True
                    yield Membership.stale_from(last)
                index = 0
                await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            finally:
                query.cancel()  # no-op once done; a closed watch must not leave its query behind
            backoff = self.backoff_initial_s
            if new_index <= 0:
                # Consul's rule: an index must be > 0; reset it (the plain reads that follow are paced below).
                index = 0
            elif new_index < index:
                # Consul's rule: an index going backwards (agent restarted, snapshot restored) resets it.
                log.info(
                    "registry index for %s went back from %d to %d; resetting",
                    service,
                    index,
                    new_index,
                )
                index = 0
            else:
                index = new_index
            if last is None or stale or instances != last.instances:
                if stale:
                    log.info("registry %s reachable again", self.config.address)
                stale = False
                last = Membership(instances, max(new_index, 0))
                yield last
            # A plain read comes next: pace it, a server stuck at index 0 must not spin us.
            if index == 0:
                await asyncio.sleep(random.uniform(0.5, 1.0) * self.backoff_initial_s)

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one). Stop watch iterators first."""
        if self._consul is not None:
            client, self._consul = self._consul, None
            await client.close()
