"""Service discovery: the Registry protocol and the records services publish.

Expert services register themselves (with their experts, model id, weights checksum and region in
`meta`) and deregister on shutdown; routers watch expert services and gateways watch routers.
Implementations: `consul.ConsulRegistry` (a real Consul agent, or the embedded Consul-compatible
server `moe_mesh.local.registry.EmbeddedConsul` that `moe-mesh up` runs),
`kubernetes.KubernetesRegistry` (EndpointSlices of headless Services; Kubernetes registers) and,
for tests, `tests/support/memory_registry.py` (in-process).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from common.errors import InvalidArgumentError, MoeMeshError

if TYPE_CHECKING:  # common.server imports grpc, which registry clients need not
    from common.server import Deadline

EXPERT_SERVICE = "moe-mesh-expert"
ROUTER_SERVICE = "moe-mesh-router"


@dataclass(frozen=True)
class Instance:
    """One registered service instance."""

    service: str  # EXPERT_SERVICE or ROUTER_SERVICE
    id: str  # unique per instance, stable for its lifetime
    host: str
    port: int
    tags: tuple[str, ...] = ()
    meta: Mapping[str, str] = field(
        default_factory=dict
    )  # model_id, weights_checksum, experts, region, fast_path
    tls: bool = False  # its gRPC endpoint speaks (mutual) TLS: health checks must too

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Membership:
    """A snapshot of the passing instances of a service.

    `stale` is True when the registry could not be reached: `instances` is then the last known
    membership, which callers keep serving from.
    """

    instances: tuple[Instance, ...]
    index: int
    stale: bool = False

    @staticmethod
    def stale_from(last: Membership | None) -> Membership:
        """What a watch yields while the registry does not answer: the last known one, marked stale."""
        return Membership(last.instances if last else (), last.index if last else 0, stale=True)


META_MAX_PAIRS, META_KEY_MAX_LEN, META_VALUE_MAX_LEN = 64, 128, 512
_META_KEY = re.compile(r"[A-Za-z0-9_-]+")


def meta_problem(meta: dict[str, Any]) -> str | None:
    """Why Consul would reject this service meta (its documented limits), or None if it is fine.

    Checked by the embedded registry and MemoryRegistry so a mesh that works on them does not fail on a real agent.
    """
    if len(meta) > META_MAX_PAIRS:
        return f"Meta has {len(meta)} pairs; Consul allows {META_MAX_PAIRS}"
    for key, value in meta.items():
        if not isinstance(key, str) or not _META_KEY.fullmatch(key) or len(key) > META_KEY_MAX_LEN:
            return f"Meta key {key!r} must be 1-{META_KEY_MAX_LEN} of [A-Za-z0-9_-]"
        if key.startswith("consul-"):
            return f"Meta key {key!r} uses the reserved prefix 'consul-'"
        if not isinstance(value, str) or len(value) > META_VALUE_MAX_LEN:
            return (
                f"Meta value of {key!r} must be a string of at most {META_VALUE_MAX_LEN} characters"
            )
    return None


class Registry(Protocol):
    async def register(
        self,
        instance: Instance,
        check_interval_s: float = 2.0,
        deregister_critical_after_s: float = 30.0,
    ) -> None:
        """Register `instance` with a gRPC health check against its endpoint."""

    async def deregister(self, instance_id: str) -> None: ...

    def watch(self, service: str) -> AsyncIterator[Membership]:
        """Yield the current passing membership at once, then again on every change (blocking queries).

        Never ends by itself and never raises on registry errors: it backs off with jitter and
        yields the last known membership with `stale=True` while the registry is unreachable.
        """

    async def close(self) -> None: ...


REGISTRIES = ("none", "consul", "kubernetes")


def open_registry(kind: str, address: str | None = None, tls=None) -> Registry | None:
    """The registry a service was configured with: None for "none"; a Consul client (a real agent
    or `moe-mesh up`'s embedded one; address defaults to CONSUL_HTTP_ADDR); or Kubernetes'
    EndpointSlices (address: the API server, default in-cluster), whose endpoints are described
    over gRPC with `tls` (the mesh's common.tls.MeshTls, None for plaintext)."""
    if kind == "none":
        return None
    if kind == "kubernetes":
        from common.registry.kubernetes import open_kubernetes

        return open_kubernetes(address, tls)
    if kind == "consul":
        from common.registry.consul import ConsulRegistry

        try:
            return ConsulRegistry(address)
        except ValueError as e:  # a malformed address, an unreadable token file
            raise InvalidArgumentError("registry", str(e)) from None
    raise ValueError(f"unknown registry {kind!r}; expected one of {', '.join(REGISTRIES)}")


REFRESH_S = 10.0
DEREGISTER_S = 1.0  # at least this long to deregister on stop, whatever grace is left


def registration_hooks(
    server, registry: Registry | None, make_instance, refresh_s: float = REFRESH_S
):
    """Attach register-on-ready / deregister-on-stop to a common.server.GrpcServer.

    The registration is repeated every `refresh_s` (registering is idempotent), so a registry that
    restarted and forgot its services learns this one again without a restart here.
    """
    if registry is None:
        return
    state: dict = {}
    log = logging.getLogger(__name__)

    async def refresh() -> None:
        while True:
            await asyncio.sleep(refresh_s)
            try:
                await registry.register(state["instance"])
            except MoeMeshError as e:
                log.warning("could not refresh the registration: %s", e)

    async def register() -> None:
        instance = make_instance()
        await registry.register(instance)
        state["instance"] = instance  # what stopping deregisters: nothing, if this failed
        state["task"] = asyncio.create_task(refresh(), name="registry-refresh")

    async def deregister(deadline: Deadline) -> None:
        # Within the stop's deadline, but at least DEREGISTER_S, so a grace of 0 still deregisters
        # from a registry that answers; one that does not (the client's own timeout is 10 s) must
        # not hold the stop past what an orchestrator waits before SIGKILL.
        if "task" in state:
            state["task"].cancel()
            await asyncio.gather(state["task"], return_exceptions=True)
        try:
            if "instance" in state:
                async with asyncio.timeout(max(DEREGISTER_S, deadline.remaining())):
                    await registry.deregister(state["instance"].id)
        except (MoeMeshError, TimeoutError) as e:
            # The registry may be gone; shutting down must not depend on it (its health check
            # will mark this instance critical and it is deregistered after the critical timeout).
            log.warning("could not deregister: %s", str(e) or "the registry did not answer in time")
        finally:
            await registry.close()

    server.on_ready.append(register)
    server.on_stop.append(deregister)
