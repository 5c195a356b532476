"""Live expert placement from the registry: expert services that join start taking calls, those
that leave (or fail their health check) stop, without a restart.

Each membership change rebuilds the remote part of the placement table, which is swapped into
the dispatcher between layer calls. Calls in flight to a departed service may still answer for
LEAVE_DRAIN_S (a replica scaled down answers them), then those left are cancelled and fail over
to another replica; its channel is closed after a grace period. While the registry is
unreachable, the last known membership keeps serving and `stale` says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from common.arch import ModelSpec
from common.errors import InvalidArgumentError, PreconditionError, UnavailableError
from common.placement import Pair, format_experts, parse_experts
from common.registry import EXPERT_SERVICE, Instance, Membership, Registry
from common.registry.follow import Follower, follow
from common.tls import MeshTls
from router_service.experts.backends import ExpertBackend, LivePlacement
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.remote import Identity, RemoteExperts

log = logging.getLogger(__name__)
CLOSE_AFTER_S = 30.0
# How long a departed service's calls in flight may still answer before they fail over. A replica
# scaled down answers its calls in milliseconds; a hung one's calls are hedged well before this.
LEAVE_DRAIN_S = 1.0


class ExpertMembership:
    def __init__(
        self,
        spec: ModelSpec,
        identity: Identity,
        placement: LivePlacement,
        max_message_bytes: int,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        fast_path: FastPathConfig | None = None,
        tls: MeshTls | None = None,
    ) -> None:
        self.spec, self.identity, self.placement = spec, identity, placement
        self.fast_path, self.tls = fast_path, tls
        self.max_message_bytes, self.interceptors = max_message_bytes, interceptors
        self._follower: Follower[RemoteExperts] = Follower(self._connect, self._leave)
        self._leaving: set[asyncio.Task] = set()  # departed backends draining (held: not collected)
        self.backends = self._follower.clients  # instance id -> backend
        self._pairs: dict[str, list[Pair]] = {}  # instance id -> what it serves
        self.stale = False
        self.answered = False  # the registry has answered a query
        self.changes = 0
        self._changed = asyncio.Event()
        self._ignored: set[str] = set()
        self._task: asyncio.Task | None = None
        self._registry: Registry | None = None

    def apply(self, membership: Membership) -> None:
        """Adopt a membership snapshot: connect new services, drop departed ones, rebuild the placement."""
        self.stale = membership.stale
        self.answered |= not membership.stale
        wanted = {}
        for inst in membership.instances:
            if not self._compatible(inst):
                continue
            # One bad record must not stop the router following the rest.
            try:
                self._pairs[inst.id] = parse_experts(inst.meta.get("experts", ""), self.spec)
            except InvalidArgumentError as e:
                experts = inst.meta.get("experts", "")
                self._warn(inst, f"its expert list {experts!r} does not fit this model: {e}")
                continue
            wanted[inst.id] = inst
        self._follower.reconcile(wanted)
        self._pairs = {i: self._pairs[i] for i in self.backends}
        remote: dict[Pair, list[ExpertBackend]] = {}
        for instance_id, backend in sorted(self.backends.items(), key=lambda kv: kv[1].address):
            for pair in self._pairs[instance_id]:
                remote.setdefault(pair, []).append(backend)
        self.placement.set_remote(remote)
        self.changes += 1
        self._changed.set()

    def _connect(self, inst: Instance) -> RemoteExperts:
        region = inst.meta.get("region", "")
        log.info(
            "expert service %s (region %r) joined: %s",
            inst.endpoint,
            region,
            format_experts(self._pairs[inst.id]),
        )
        fast_path = inst.meta.get("fast_path", "")
        backend = RemoteExperts(
            inst.endpoint,
            self.identity,
            self.max_message_bytes,
            region,
            self.interceptors,
            self.fast_path,
            [fast_path] if fast_path else [],
            self.tls,
        )
        backend.placed = frozenset(self._pairs[inst.id])
        backend.precision = inst.meta.get("precision", "")
        limit = inst.meta.get("max_message_bytes", "")
        backend.learn_limit(int(limit) if limit.isdecimal() else 0)
        return backend

    def _leave(self, backend: RemoteExperts) -> None:
        log.info("expert service %s left", backend.address)
        task = asyncio.ensure_future(backend.leave(LEAVE_DRAIN_S))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)
        asyncio.get_running_loop().call_later(
            CLOSE_AFTER_S, lambda: asyncio.ensure_future(backend.close())
        )

    def _compatible(self, inst: Instance) -> bool:
        ok = (
            inst.meta.get("model_id") == self.identity.model_id
            and inst.meta.get("weights_checksum") == self.identity.weights_checksum
        )
        if not ok:
            self._warn(
                inst,
                f"it serves model {inst.meta.get('model_id')!r} / weights "
                f"{inst.meta.get('weights_checksum')!r}, this router {self.identity.model_id!r} / "
                f"{self.identity.weights_checksum!r}",
            )
        return ok

    def _warn(self, inst: Instance, why: str) -> None:
        if inst.id not in self._ignored:  # once per instance, not on every membership change
            self._ignored.add(inst.id)
            log.warning("ignoring expert service %s: %s", inst.endpoint, why)

    def missing(self) -> list[Pair]:
        every = [
            (layer, e) for layer in self.spec.moe_layer_ids for e in range(self.spec.num_experts)
        ]
        return self.placement.missing(every)

    async def start(self, registry: Registry, timeout_s: float) -> None:
        """Follow the registry; return once every expert has a replica, or raise after timeout_s."""
        self._registry = registry
        self._task = asyncio.create_task(
            follow(registry.watch(EXPERT_SERVICE), self.apply), name="expert-membership"
        )
        deadline = time.monotonic() + timeout_s
        while self.missing():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self.stop()
                if not self.answered:
                    why = getattr(registry, "problem", None)  # Kubernetes': RBAC, token, address
                    raise UnavailableError(
                        f"the registry did not answer in {timeout_s:g}s: "
                        + (
                            why
                            or "is its agent running where --registry-address (or "
                            "CONSUL_HTTP_ADDR) says?"
                        )
                    )
                raise PreconditionError(
                    f"after {timeout_s:g}s no registered expert service serves "
                    f"{format_experts(self.missing())} (and they are not colocated)"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._leaving):
            task.cancel()
        await asyncio.gather(*self._leaving, return_exceptions=True)
        if self._registry is not None:
            await self._registry.close()
        await asyncio.gather(*(b.close() for b in self.backends.values()))
