"""Expert backends over gRPC, and building a placement table from expert services' Describe replies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from common.errors import (
    DeadlineExceededError,
    NotFoundError,
    PreconditionError,
    UnavailableError,
)
from common.fastpath import parse_worker_url, worker_url
from common.fastpath.client import FastPathError
from common.moe import joined
from common.placement import format_experts
from common.server import peer_channel_options
from common.status import error_from_rpc
from common.tls import MeshTls, open_channel
from common.wire import decode, encode
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc
from router_service.experts.fastpath import FastPathConfig, FastPathLink

log = logging.getLogger(__name__)
# Room in a message for what is not activations: ids, counts, names, trace context.
MESSAGE_SLACK = 64 * 1024


@dataclass(frozen=True)
class Identity:
    """What router and expert services must agree on before exchanging activations."""

    model_id: str
    weights_checksum: str


class ExpertOutputs(list):
    """A backend call's outputs (one tensor per group), with the transport that carried them and
    the service's own time for the call (queue + compute; the rest of the round trip is transfer)."""

    def __init__(self, outputs, transport: str, service_s: float) -> None:
        super().__init__(outputs)
        self.transport = transport  # "ucx" | "grpc"
        self.service_s = service_s


Piece = list[tuple[int, tuple[int, torch.Tensor]]]  # (index of the call's group, (expert, rows))


def split_rows(groups: Sequence[tuple[int, torch.Tensor]], max_rows: int) -> list[Piece]:
    """`groups` in order, in pieces of at most `max_rows` rows (at least 1), a group split across
    pieces where it does not fit (expert FFNs are per row, so the rows' outputs do not change)."""
    max_rows = max(1, max_rows)
    pieces: list[Piece] = [[]]
    room = max_rows
    for i, (expert, rows) in enumerate(groups):
        start, n = 0, rows.shape[0]
        while True:
            if room == 0 and start < n:
                pieces.append([])
                room = max_rows
            take = min(room, n - start)
            pieces[-1].append((i, (expert, rows[start : start + take])))
            start, room = start + take, room - take
            if start == n:
                break
    return pieces


def joined_outputs(
    n_groups: int, pieces: list[Piece], outputs: list[ExpertOutputs]
) -> ExpertOutputs:
    """The outputs of one call's `pieces` as the call's: one tensor per group, in order."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
    for piece, output in zip(pieces, outputs):
        for (i, _), rows in zip(piece, output):
            parts[i].append(rows)
    return ExpertOutputs(
        [p[0] if len(p) == 1 else torch.cat(p) for p in parts],
        "ucx" if all(o.transport == "ucx" for o in outputs) else "grpc",
        max(o.service_s for o in outputs),  # the pieces ran side by side
    )


class RemoteExperts:
    """One expert service: a long-lived channel and, when the service offers it, a UCX fast path;
    one batched call per (layer, call), over UCX when it can, else (or after a fast-path failure,
    the same call) over gRPC; a call larger than a message goes in pieces, side by side."""

    local = False

    def __init__(
        self,
        address: str,
        identity: Identity,
        max_message_bytes: int,
        region: str = "",
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        fast_path: FastPathConfig | None = None,
        fast_paths: Sequence[str] = (),
        tls: MeshTls | None = None,
    ) -> None:
        self.address, self.region = address, region
        self.precision = ""  # what the service holds its experts in, once it said (Describe)
        self.identity = identity
        self.max_message_bytes = max_message_bytes  # this router's
        self.call_bytes = max_message_bytes  # a message to this service: under its limit too
        self.fast_path_config = fast_path
        self.fast_path = FastPathLink.offered(list(fast_paths), fast_path, max_message_bytes)
        self._warming: asyncio.Task | None = None
        self._warm()
        self.channel = open_channel(
            address, peer_channel_options(max_message_bytes), interceptors, tls
        )
        self.stub = expert_pb2_grpc.ExpertServiceStub(self.channel)
        self.outstanding = 0
        self._idle = asyncio.Event()  # set while no call is outstanding (leave() waits on it)
        self._idle.set()
        self.retired = False
        # The (layer, expert) pairs this router placed here: a check fails while the service
        # serves fewer (one restarted at this address on other experts).
        self.placed: frozenset[tuple[int, int]] = frozenset()
        self._calls: set[grpc.aio.UnaryUnaryCall] = set()

    def __repr__(self) -> str:
        return f"RemoteExperts({self.address})"

    async def describe(self, timeout_s: float) -> expert_pb2.DescribeResponse:
        try:
            return await self.stub.Describe(
                expert_pb2.DescribeRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.address) from e

    async def check(self, timeout_s: float) -> None:
        """The dispatcher's health check of this replica while it is ejected: Describe answers
        within `timeout_s` with this router's model and weights.

        Describe rather than gRPC's health Check: it is what start-up asked, and a service restarted
        on other weights at the same address must stay out (Check would pass it). It waits for the
        channel to be ready, so it passes as soon as the channel reconnects to a restarted service.
        The reply also says where the service's fast path listens now (see _follow_fast_path)."""
        if self.retired:
            raise UnavailableError(f"expert service {self.address} left the mesh")
        info = await self.describe(timeout_s)
        check_identity(self.address, info, self.identity)
        if missing := self.placed - {(k.layer, k.expert) for k in info.experts}:
            raise PreconditionError(
                f"expert service {self.address} no longer serves {format_experts(sorted(missing))}"
            )
        self.learn_limit(info.max_message_bytes)
        self._follow_fast_path(list(info.fast_paths))

    def offer_fast_path(self, urls: Sequence[str]) -> None:
        """The service's advertised fast paths (Describe.fast_paths), learned after construction."""
        if self.fast_path is None and not self.retired:
            self.fast_path = FastPathLink.offered(
                list(urls), self.fast_path_config, self.max_message_bytes
            )
            self._warm()

    def _follow_fast_path(self, urls: list[str]) -> None:
        """Use the fast path the service advertises now. A restarted service listens on a new UCX
        worker address: the link to the old one could only fail, each try costing a fallback (or, on
        a connect that times out, enough delay to lose a hedge race and be ejected again)."""
        link, target = self.fast_path, parse_worker_url(urls)
        if link is not None and (target is None or worker_url(*target) != link.url):
            log.info("expert service %s: its fast path is now %s", self.address, urls or "gone")
            link.close()  # calls in flight on it fall back to gRPC
            self.fast_path = None
        self.offer_fast_path(urls)

    def _warm(self) -> None:
        """Connect the fast path now: a first call that said hello itself would be slow enough to
        be hedged to another replica (another region, even)."""
        if self.fast_path is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop: the first call connects
            return
        if self._warming is not None:  # a link replaced while still connecting (_follow_fast_path)
            self._warming.cancel()
        self._warming = loop.create_task(self.fast_path.warm(), name=f"warm {self.address}")

    @property
    def transport(self) -> str:
        """What the next call would try first: "ucx" or "grpc"."""
        return "ucx" if self.fast_path is not None and self.fast_path.usable() else "grpc"

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> ExpertOutputs:
        if self.retired:
            raise UnavailableError(f"expert service {self.address} left the mesh")
        self.outstanding += 1
        self._idle.clear()
        try:
            max_rows = self._rows_per_message(groups)
            if sum(rows.shape[0] for _, rows in groups) <= max_rows:
                return await self._forward(layer, groups, timeout_s)
            # More than one message holds (a long prompt's prefill): a call per piece, all at once.
            pieces = split_rows(groups, max_rows)
            calls = [
                asyncio.ensure_future(self._forward(layer, [g for _, g in p], timeout_s))
                for p in pieces
            ]
            try:
                outputs = await asyncio.gather(*calls)
            except BaseException:  # the call fails over whole: its other pieces are not wanted
                for call in calls:
                    call.cancel()
                raise
            return joined_outputs(len(groups), pieces, outputs)
        except NotFoundError as e:
            # Placed here but not served: the service was restarted on other experts. A replica
            # failure, so the dispatcher ejects it and the call fails over.
            raise UnavailableError(str(e)) from e
        finally:
            self.outstanding -= 1
            if not self.outstanding:
                self._idle.set()

    def _rows_per_message(self, groups: Sequence[tuple[int, torch.Tensor]]) -> int:
        if not groups:
            return 0
        rows = groups[0][1]
        return (self.call_bytes - MESSAGE_SLACK) // (rows.shape[-1] * rows.element_size())

    def learn_limit(self, service_bytes: int) -> None:
        """The service's message size limit as it says it (0: not said): calls stay under it too.
        One below any service's setting (1 MiB) is not believed: it would send calls a row apiece."""
        if service_bytes >= 2**20:
            self.call_bytes = min(self.max_message_bytes, service_bytes)

    async def _forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None
    ) -> ExpertOutputs:
        """One message's call: over UCX when it can, else (or after a fast-path failure) gRPC."""
        counts = [rows.shape[0] for _, rows in groups]
        expert_ids = [e for e, _ in groups]
        hidden = joined([rows for _, rows in groups])  # one buffer already, in the usual case
        link = self.fast_path
        if link is not None and link.usable():
            start = time.monotonic()
            try:
                output, service_s = await link.forward(
                    self.identity.model_id,
                    self.identity.weights_checksum,
                    layer,
                    expert_ids,
                    counts,
                    hidden,
                    timeout_s,
                )
                return ExpertOutputs(output.split(counts), "ucx", service_s)
            except FastPathError:
                if self.retired:  # retire() closed the fast path: not a reason to fall back
                    raise UnavailableError(
                        f"expert service {self.address} left the mesh during the call"
                    ) from None
            if timeout_s is not None:  # the same call over gRPC, within what is left
                timeout_s = max(0.0, timeout_s - (time.monotonic() - start))
        return ExpertOutputs(*await self._grpc(layer, expert_ids, counts, hidden, timeout_s))

    async def _grpc(
        self,
        layer: int,
        expert_ids: list[int],
        counts: list[int],
        hidden: torch.Tensor,  # [sum(counts), hidden]
        timeout_s: float | None,
    ) -> tuple[list[torch.Tensor], str, float]:
        request = expert_pb2.ExpertForwardRequest(
            model_id=self.identity.model_id,
            weights_checksum=self.identity.weights_checksum,
            layer=layer,
            expert_ids=expert_ids,
            token_counts=counts,
            hidden=encode(hidden),
        )
        call = self.stub.Forward(request, timeout=timeout_s)
        self._calls.add(call)
        try:
            reply = await call
        except asyncio.CancelledError:
            if not self.retired or asyncio.current_task().cancelling():
                raise  # our caller was cancelled, not the call
            raise UnavailableError(
                f"expert service {self.address} left the mesh during the call"
            ) from None
        except grpc.aio.AioRpcError as e:
            if self.retired and e.code() == grpc.StatusCode.CANCELLED:
                raise UnavailableError(
                    f"expert service {self.address} left the mesh during the call"
                ) from e
            raise error_from_rpc(e, self.address) from e
        finally:
            self._calls.discard(call)
        return list(decode(reply.output, "output").split(counts)), "grpc", reply.service_seconds

    async def leave(self, drain_s: float) -> None:
        """The service left the mesh; the placement no longer lists it, so no new call chooses it.
        Its calls in flight may still answer for up to `drain_s`, then retire() cancels the rest.

        A replica scaled down deregisters first and answers what is in flight (expert_service/
        drain.py): cancelling those calls at once made each one a failover, and a cancelled call
        ejected the replica. A hung replica's calls are hedged meanwhile, and cancelled at `drain_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), drain_s)
        except TimeoutError:
            pass
        self.retire()

    def retire(self) -> None:
        """The service left the mesh: cancel the calls in flight to it (callers fail over at once) and
        refuse new ones. The channel stays open until close()."""
        self.retired = True
        if self.fast_path is not None:
            self.fast_path.close()  # UCX calls in flight fail now; retired, they do not fall back
        for call in list(self._calls):
            call.cancel()

    async def close(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            await asyncio.gather(self._warming, return_exceptions=True)
        if self.fast_path is not None:
            self.fast_path.close()
        await self.channel.close()


def check_identity(address: str, info: expert_pb2.DescribeResponse, identity: Identity) -> None:
    """PreconditionError naming the first of model id and weights checksum that differ."""
    for field in ("model_id", "weights_checksum"):
        if getattr(info, field) != getattr(identity, field):
            raise PreconditionError(
                f"expert service {address} serves {field} "
                f"{getattr(info, field)!r}; this router has {getattr(identity, field)!r}"
            )


async def connect(
    addresses: Sequence[str],
    identity: Identity,
    max_message_bytes: int,
    timeout_s: float,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    fast_path: FastPathConfig | None = None,
    tls: MeshTls | None = None,
) -> dict[tuple[int, int], list[RemoteExperts]]:
    """Describe every expert service (waiting up to timeout_s for each) and map pair -> replicas.

    A service serving another model or other weights fails start-up with PreconditionError naming it.
    """
    backends = [
        RemoteExperts(
            a, identity, max_message_bytes, interceptors=interceptors, fast_path=fast_path, tls=tls
        )
        for a in addresses
    ]
    deadline = time.monotonic() + timeout_s
    try:
        replies = await asyncio.gather(
            *(b.describe(max(0.1, deadline - time.monotonic())) for b in backends)
        )
    except (
        UnavailableError,
        DeadlineExceededError,
    ) as e:  # Describe waits for the service to listen
        await asyncio.gather(*(b.close() for b in backends))
        raise UnavailableError(
            f"expert service not reachable within {timeout_s:g}s (--connect-timeout-s): {e}"
        ) from e
    placement: dict[tuple[int, int], list[RemoteExperts]] = {}
    for backend, info in zip(backends, replies):
        check_identity(backend.address, info, identity)
        backend.region, backend.precision = info.region, info.precision
        backend.learn_limit(info.max_message_bytes)
        backend.offer_fast_path(list(info.fast_paths))
        pairs = [(k.layer, k.expert) for k in info.experts]
        backend.placed = frozenset(pairs)
        for pair in pairs:
            placement.setdefault(pair, []).append(backend)
        log.info(
            "expert service %s (region %r, %s) serves %s",
            backend.address,
            backend.region,
            backend.fast_path.url if backend.fast_path else "gRPC only",
            format_experts(pairs),
        )
    return placement
