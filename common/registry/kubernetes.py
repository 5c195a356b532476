"""`KubernetesRegistry`: the Registry protocol on Kubernetes' own EndpointSlices, no Consul.

Each expert group and the routers have a headless Service labelled `moe-mesh.io/service:
moe-mesh-expert` (or `moe-mesh-router`) with a port named `grpc`; the EndpointSlice controller
copies those labels onto the Service's slices, and readiness probes decide which endpoints are
ready. So registering is Kubernetes' job (register/deregister are no-ops here) and watching a
service is a list of its slices by label, then a watch from the list's resourceVersion (again
after the server ends a stream; a list again on 410 Gone).

A ready endpoint becomes an Instance once its meta is known: asked of the endpoint itself
(common/registry/k8s_meta.py), once per appearance, retried with backoff while it fails. While
the API server cannot be reached (or refuses), watches yield the last membership marked stale and
`problem` says why, in words naming the fix (a missing RBAC verb, a refused token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from common.errors import (
    InvalidArgumentError,
    MoeMeshError,
    PreconditionError,
    UnavailableError,
)
from common.registry import Instance, Membership
from common.registry.k8s_api import Gone, KubeApi, KubeConfig
from common.registry.k8s_meta import Describer, grpc_describer

log = logging.getLogger(__name__)
SERVICE_LABEL = "moe-mesh.io/service"
PORT_NAME = "grpc"


@dataclass(frozen=True)
class Endpoint:
    """One ready address of a slice: `name` is its Pod's (targetRef), else the address."""

    name: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def ready_endpoints(slices: Mapping[str, dict[str, Any]]) -> set[Endpoint]:
    """The ready endpoints of these EndpointSlices, on each slice's port named `grpc` (or its
    only port). `conditions.ready` unset counts as ready, as the API documents; terminating
    endpoints are never ready."""
    return {e for s in slices.values() for e in _slice_endpoints(s)}


def _slice_endpoints(obj: dict[str, Any]) -> Iterator[Endpoint]:
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return
    ports = obj.get("ports") or []
    named = [p for p in ports if p.get("name") == PORT_NAME]
    chosen = named or (ports if len(ports) == 1 else [])
    port = chosen[0].get("port") if chosen else None
    if not port:  # no grpc port, or null ("all ports", never a Service's)
        return
    for ep in obj.get("endpoints") or ():
        addresses = ep.get("addresses") or []
        if (ep.get("conditions") or {}).get("ready") is False or not addresses:
            continue
        name = (ep.get("targetRef") or {}).get("name") or addresses[0]
        yield Endpoint(name, addresses[0], int(port))  # consumers use the first address


class _View:
    """What one watch knows: its service's slices, their ready endpoints, and their meta."""

    def __init__(self, service: str, describe: Describer, backoff: tuple[float, float]) -> None:
        self.service, self._describe, self._backoff = service, describe, backoff
        self.slices: dict[str, dict[str, Any]] = {}
        self.endpoints: set[Endpoint] = set()
        self.meta: dict[Endpoint, dict[str, str]] = {}
        self.appearances: dict[Endpoint, int] = {}  # how often each has become ready
        self.pending: dict[Endpoint, asyncio.Task] = {}
        self.stale = False
        self.changed = asyncio.Event()

    def replace(self, items: list[dict[str, Any]]) -> None:
        self.slices = {s["metadata"]["name"]: s for s in items}
        self.stale = False
        self._update()

    def apply(self, event: dict[str, Any]) -> str | None:
        """Adopt a watch event; the resourceVersion to resume from."""
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        kind = event.get("type")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[meta["name"]] = obj
        elif kind == "DELETED":
            self.slices.pop(meta.get("name", ""), None)
        if kind != "BOOKMARK":
            self._update()
        return meta.get("resourceVersion")

    def fail(self) -> None:
        self.stale = True
        self.changed.set()

    def _update(self) -> None:
        now = ready_endpoints(self.slices)
        # A replica that was not ready (a restart) is asked again: its fast path may have moved.
        for gone in self.endpoints - now:
            self.meta.pop(gone, None)
            if task := self.pending.pop(gone, None):
                task.cancel()
        for new in now - self.endpoints:
            self.appearances[new] = self.appearances.get(new, 0) + 1
            self.pending[new] = asyncio.create_task(self._ask(new), name=f"describe-{new.address}")
        self.endpoints = now
        self.changed.set()

    async def _ask(self, ep: Endpoint) -> None:
        delay, warned = self._backoff[0], False
        while True:
            try:
                meta = await self._describe(self.service, ep.address)
                break
            # grpc's AioRpcError (not ready yet, TLS refused), a reply that does not parse: retried.
            except Exception as e:  # noqa: BLE001
                if not warned:
                    log.warning("cannot describe %s %s: %s", self.service, ep.address, e)
                    warned = True
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                delay = min(delay * 2, self._backoff[1])
        self.meta[ep] = meta
        self.pending.pop(ep, None)
        self.changed.set()

    async def settled(self, timeout_s: float) -> None:
        """Until the endpoints known now are described (or failed for `timeout_s`)."""
        if self.pending:
            await asyncio.wait(list(self.pending.values()), timeout=timeout_s)

    def instances(self, tls: bool) -> tuple[Instance, ...]:
        out = []
        for ep, meta in self.meta.items():
            n = self.appearances[ep]
            instance_id = f"{ep.name}@{ep.address}" + (f"~{n}" if n > 1 else "")
            out.append(
                Instance(self.service, instance_id, ep.host, ep.port, ("moe-mesh",), meta, tls)
            )
        return tuple(sorted(out, key=lambda i: i.id))

    async def close(self) -> None:
        for task in self.pending.values():
            task.cancel()
        await asyncio.gather(*self.pending.values(), return_exceptions=True)


class KubernetesRegistry:
    """Registry on EndpointSlices (see the module docstring). `address`: the API server's base URL
    (default in-cluster); `tls`: the mesh identity (common.tls.MeshTls) to describe endpoints with;
    `describe` replaces the gRPC describer (tests)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        tls=None,
        describe: Describer | None = None,
        env: Mapping[str, str] | None = None,
        request_timeout_s: float = 10.0,
        # A quiet watch is normal, so a hung API server shows only when a stream outlives this
        # plus request_timeout_s: resuming from the version every 30 s is cheap (no list).
        watch_timeout_s: float = 30.0,
        describe_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.config = KubeConfig.from_env(address, env)
        self.api = KubeApi(self.config, request_timeout_s)
        self.tls = tls is not None
        self._describe = describe or grpc_describer(tls, describe_timeout_s)
        self.watch_timeout_s, self.describe_timeout_s = watch_timeout_s, describe_timeout_s
        self.backoff = (backoff_initial_s, backoff_max_s)
        self.problem: str | None = None  # why the API server did not answer last, in words

    async def register(
        self,
        instance: Instance,
        check_interval_s: float = 2.0,
        deregister_critical_after_s: float = 30.0,
    ) -> None:
        """Nothing to do: Kubernetes adds a ready Pod to its Service's EndpointSlices."""

    async def deregister(self, instance_id: str) -> None:
        """Nothing to do: a terminating Pod leaves the ready endpoints by itself."""

    async def watch(self, service: str) -> AsyncIterator[Membership]:
        """See `Registry.watch`. The first membership waits (up to describe_timeout_s) for the
        endpoints listed first to be described, so a running group shows up whole."""
        view = _View(service, self._describe, self.backoff)
        follower = asyncio.create_task(self._follow(view), name=f"k8s-watch-{service}")
        last: Membership | None = None
        index = 0
        try:
            while True:
                await view.changed.wait()
                view.changed.clear()
                if view.stale:
                    if last is None or not last.stale:
                        last = Membership.stale_from(last)
                        yield last
                    continue
                if last is None:
                    await view.settled(self.describe_timeout_s)
                instances = view.instances(self.tls)
                if last is None or last.stale or instances != last.instances:
                    index += 1
                    last = Membership(instances, index)
                    yield last
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await view.close()

    async def _follow(self, view: _View) -> None:
        """List, then watch from the list's version, forever; list again on Gone and on errors."""
        selector = f"{SERVICE_LABEL}={view.service}"
        delay = self.backoff[0]
        while True:
            try:
                version, items = await self.api.list(selector)
                view.replace(items)
                if self.problem is not None:
                    log.info("Kubernetes API server %s answers again", self.config.base_url)
                self.problem, delay = None, self.backoff[0]
                while True:  # the server ends each stream after watch_timeout_s: resume
                    started = asyncio.get_running_loop().time()
                    stream = self.api.watch(selector, version, self.watch_timeout_s)
                    async with contextlib.aclosing(stream):  # closed on cancel: no open response
                        async for event in stream:
                            version = view.apply(event) or version
                    if asyncio.get_running_loop().time() - started < 1.0:
                        # A stream ended at once (a proxy that cuts them): do not spin on it.
                        await asyncio.sleep(self.backoff[1])
            except Gone as e:
                log.info("watch of %s expired (%s): listing again", view.service, e)
            # The rest: an answer that is not the API's shape (a proxy's page, a broken object).
            except (
                UnavailableError,
                PreconditionError,
                KeyError,
                TypeError,
                AttributeError,
                ValueError,
            ) as e:
                why = str(e)
                if not isinstance(e, MoeMeshError):
                    why = f"{self.config.base_url} answered a malformed EndpointSlice ({e!r})"
                if self.problem != why:
                    log.warning("while watching %s: %s", view.service, why)
                self.problem = why
                view.fail()
                await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
                delay = min(delay * 2, self.backoff[1])

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one). Stop watch iterators first."""
        await self.api.close()


def open_kubernetes(address: str | None, tls=None) -> KubernetesRegistry:
    """`--registry kubernetes`: InvalidArgumentError naming the field for a bad address."""
    try:
        return KubernetesRegistry(address, tls=tls)
    except ValueError as e:
        raise InvalidArgumentError("registry_address", str(e)) from None
