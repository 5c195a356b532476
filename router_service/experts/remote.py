"""Expert backends over gRPC, and building a placement table from expert services' Describe replies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from moe_mesh.common.errors import PreconditionError, UnavailableError
from moe_mesh.common.placement import format_experts
from moe_mesh.common.server import channel_options
from moe_mesh.common.status import error_from_rpc
from moe_mesh.common.wire import decode, encode
from moe_mesh.protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """What router and expert services must agree on before exchanging activations."""

    model_id: str
    weights_checksum: str


class RemoteExperts:
    """One expert service: a long-lived channel; one batched Forward per (layer, call)."""

    local = False

    def __init__(
        self,
        address: str,
        identity: Identity,
        max_message_bytes: int,
        region: str = "",
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        self.address, self.region = address, region
        self.identity = identity
        self.channel = grpc.aio.insecure_channel(
            address,
            options=channel_options(max_message_bytes),
            interceptors=list(interceptors) or None,
        )
        self.stub = expert_pb2_grpc.ExpertServiceStub(self.channel)
        self.outstanding = 0
        self.retired = False
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

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        if self.retired:
            raise UnavailableError(f"expert service {self.address} left the mesh")
        counts = [rows.shape[0] for _, rows in groups]
        request = expert_pb2.ExpertForwardRequest(
            model_id=self.identity.model_id,
            weights_checksum=self.identity.weights_checksum,
            layer=layer,
            expert_ids=[e for e, _ in groups],
            token_counts=counts,
            hidden=encode(torch.cat([rows for _, rows in groups])),
        )  # [sum(counts), hidden]
        self.outstanding += 1
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
            self.outstanding -= 1
        return list(decode(reply.output, "output").split(counts))

    def retire(self) -> None:
        """The service left the mesh: cancel the calls in flight to it (callers fail over at once) and
        refuse new ones. The channel stays open until close()."""
        self.retired = True
        for call in list(self._calls):
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()


async def connect(
    addresses: Sequence[str],
    identity: Identity,
    max_message_bytes: int,
    timeout_s: float,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> dict[tuple[int, int], list[RemoteExperts]]:
    """Describe every expert service (waiting up to timeout_s for each) and map pair -> replicas.

    A service serving another model or other weights fails start-up with PreconditionError naming it.
    """
    backends = [
        RemoteExperts(a, identity, max_message_bytes, interceptors=interceptors) for a in addresses
    ]
    deadline = time.monotonic() + timeout_s
    try:
        replies = await asyncio.gather(
            *(b.describe(max(0.1, deadline - time.monotonic())) for b in backends)
        )
    except UnavailableError as e:
        await asyncio.gather(*(b.close() for b in backends))
        raise UnavailableError(f"expert service not reachable within {timeout_s}s: {e}") from e
    placement: dict[tuple[int, int], list[RemoteExperts]] = {}
    for backend, info in zip(backends, replies):
        for field in ("model_id", "weights_checksum"):
            if getattr(info, field) != getattr(identity, field):
                raise PreconditionError(
                    f"expert service {backend.address} serves {field} "
                    f"{getattr(info, field)!r}; this router has {getattr(identity, field)!r}"
                )
        backend.region = info.region
        pairs = [(k.layer, k.expert) for k in info.experts]
        for pair in pairs:
            placement.setdefault(pair, []).append(backend)
        log.info(
            "expert service %s (region %r) serves %s",
            backend.address,
            backend.region,
            format_experts(pairs),
        )
    return placement
