"""The gateway's side of RouterService: one long-lived channel per router replica."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from opentelemetry import context
from opentelemetry.context import Context

from common.server import channel_options
from common.errors import MoeMeshError
from common.status import error_from_rpc
from gateway.balancer import RouterLostError
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)
# host:port, [v6]:port and gRPC's "ipv4:" / "ipv6:" forms: a router's error details name routers and
# expert services (connection failures, unreachable experts), which the public must not learn.
_ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\[[0-9A-Fa-f:.%]+\]|\b[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):\d{1,5}\b")


def scrub_addresses(text: str) -> str:
    return _ADDRESS.sub("<internal>", text)

FINISH = {router_pb2.FINISH_REASON_STOP: "stop", router_pb2.FINISH_REASON_LENGTH: "length",
          router_pb2.FINISH_REASON_CANCELLED: "cancelled"}


@dataclass
class Chunk:
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class RouterBackend(Protocol):
    """A router replica as the gateway sees it."""

    address: str
    outstanding: int

    def generate(self, request: router_pb2.RouterGenerateRequest, timeout_s: float,
                 trace_context: Context | None = None) -> AsyncIterator[Chunk]: ...

    async def status(self, timeout_s: float) -> router_pb2.RouterStatus: ...


class RouterClient:
    def __init__(self, address: str, max_message_bytes: int,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes),
                                                 interceptors=list(interceptors) or None)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.outstanding = 0

    async def generate(self, request: router_pb2.RouterGenerateRequest, timeout_s: float,
                       trace_context: Context | None = None) -> AsyncIterator[Chunk]:
        """Stream a request's tokens. Closing the iterator early cancels the call (the router frees the slot).

        With `trace_context` the call is a child of that span: tracing interceptors read the current
        context when the call starts, so it is current just then (never across a yield)."""
        token = context.attach(trace_context) if trace_context is not None else None
        try:
            call = self.stub.Generate(request, timeout=timeout_s)
        finally:
            if token is not None:
                context.detach(token)
        self.outstanding += 1
        try:
            async for msg in call:
                chunk = Chunk(list(msg.token_ids), FINISH.get(msg.finish_reason), msg.prompt_tokens,
                              msg.completion_tokens)
                if chunk.finish_reason is not None:
                    # The router ends the stream right after its last message. Reading to the end completes
                    # the call, and with it the tracing interceptor's client span, before the caller stops.
                    async for _ in call:
                        pass
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise self._error(e, request.request_id) from e
        finally:
            self.outstanding -= 1
            call.cancel()  # no-op once the stream ended

    async def status(self, timeout_s: float) -> router_pb2.RouterStatus:
        try:
            return await self.stub.Status(router_pb2.RouterStatusRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "status") from e

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> MoeMeshError:
        """Our error for a failed call. Its message may reach the public, so it leaves out this router's
        address (logged here instead); UNAVAILABLE becomes RouterLostError, which the core retries elsewhere."""
        log.info("router %s: %s failed: %s: %s", self.address, what, e.code().name, e.details())
        details = scrub_addresses(e.details() or "")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return RouterLostError(f"UNAVAILABLE: {details}")
        return error_from_rpc(e, details=details)

    async def close(self) -> None:
        await self.channel.close()
