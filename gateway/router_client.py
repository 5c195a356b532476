"""The gateway's side of RouterService: one long-lived channel per router replica."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import context
from opentelemetry.context import Context

from common import sampling
from common.errors import MoeMeshError, UnavailableError
from common.finish_reason import from_wire
from common.sampling import SamplingParams
from common.server import peer_channel_options
from common.status import EXPERTS_UNAVAILABLE_KEY, error_from_rpc
from common.tls import MeshTls, open_channel
from gateway.balancer import RouterLostError
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)
# host:port, [v6]:port and gRPC's "ipv4:" / "ipv6:" forms: a router's error details name routers and
# expert services (connection failures, unreachable experts), which the public must not learn.
_ADDRESS = re.compile(
    r"(?:ipv[46]:)?(?:\[[0-9A-Fa-f:.%]+\]|\b[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):\d{1,5}\b"
)


def scrub_addresses(text: str) -> str:
    return _ADDRESS.sub("<internal>", text)


@dataclass(frozen=True)
class ModelInfo:
    """What a router serves, from its Status."""

    id: str
    architecture: str
    max_model_len: int
    vocab_size: int


# A produced token's logprob and its (token id, logprob) alternatives, most likely first.
Logprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class RouterRequest:
    """One call to a router: token ids in (tokenization is the gateway's), a stream of Chunks out."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    priority: int = 0


def to_proto(r: RouterRequest) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        params=sampling.to_proto(r.params, router_pb2.SamplingParams()),
        priority=r.priority,
    )


@dataclass
class Chunk:
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[Logprobs] | None = None  # one per token, when asked for


class RouterBackend(Protocol):
    """A router replica as the gateway sees it."""

    address: str
    outstanding: int

    def generate(
        self, request: RouterRequest, timeout_s: float, trace_context: Context | None = None
    ) -> AsyncIterator[Chunk]: ...

    async def model(self, timeout_s: float) -> ModelInfo: ...

    async def check(self, timeout_s: float) -> str:
        """The model id it serves, once it says it is serving; raises otherwise."""
        ...


class RouterClient:
    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: MeshTls | None = None,
    ) -> None:
        self.address = address
        self.channel = open_channel(
            address, peer_channel_options(max_message_bytes), interceptors, tls
        )
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.outstanding = 0

    async def generate(
        self, request: RouterRequest, timeout_s: float, trace_context: Context | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream a request's tokens. Closing the iterator early cancels the call (the router frees the slot).

        With `trace_context` the call is a child of that span: tracing interceptors read the current
        context when the call starts, so it is current just then (never across a yield)."""
        token = context.attach(trace_context) if trace_context is not None else None
        try:
            call = self.stub.Generate(to_proto(request), timeout=timeout_s)
        finally:
            if token is not None:
                context.detach(token)
        self.outstanding += 1
        try:
            async for msg in call:
                chunk = Chunk(
                    list(msg.token_ids),
                    from_wire(msg.finish_reason),
                    msg.prompt_tokens,
                    msg.completion_tokens,
                    [
                        (t.logprob, tuple((a.token_id, a.logprob) for a in t.top))
                        for t in msg.logprobs
                    ]
                    or None,
                )
                if chunk.finish_reason is not None:
                    # The router ends the stream right after its last message. Reading to the end completes
                    # the call, and with it the tracing interceptor's client span, before the caller stops.
                    async for _ in call:
                        pass
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise self._error(e, request.request_id) from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller cancelled us (its client left)
            # The call was cancelled under us: this router left the registry and its channel was
            # closed (a frozen router is dropped so), which must fail over like a lost router.
            log.info("router %s: %s cut off: its channel closed", self.address, request.request_id)
            raise RouterLostError("the router left mid-stream") from None
        finally:
            self.outstanding -= 1
            call.cancel()  # no-op once the stream ended

    async def model(self, timeout_s: float) -> ModelInfo:
        """The model this router serves (its Status RPC); waits for the router up to `timeout_s`."""
        try:
            st = await self.stub.Status(
                router_pb2.RouterStatusRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "status") from e
        return ModelInfo(st.model_id, st.architecture, st.max_model_len, st.vocab_size)

    async def check(self, timeout_s: float) -> str:
        """The gateway's check of this router while it is ejected: gRPC health says SERVING, then
        Status names the model it serves; both within `timeout_s`, waiting for the channel.

        Health first: a router whose engine loop gave up says NOT_SERVING, yet answers Status.
        Failures are not logged (_error's line): a dead router fails a check every interval."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            reply = await self.health.Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                raise UnavailableError(f"router {self.address} is {status}")
            left = deadline - asyncio.get_running_loop().time()
            st = await self.stub.Status(
                router_pb2.RouterStatusRequest(), timeout=max(0.0, left), wait_for_ready=True
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.address) from e
        return st.model_id

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> MoeMeshError:
        """Our error for a failed call. Its message may reach the public, so it leaves out this router's
        address (logged here instead); UNAVAILABLE becomes RouterLostError, which the core retries elsewhere,
        unless the router says its expert replicas are what is unavailable."""
        log.info("router %s: %s failed: %s: %s", self.address, what, e.code().name, e.details())
        details = scrub_addresses(e.details() or "")
        experts = dict(e.trailing_metadata() or ()).get(EXPERTS_UNAVAILABLE_KEY)
        if e.code() == grpc.StatusCode.UNAVAILABLE and not experts:
            return RouterLostError(f"UNAVAILABLE: {details}")
        return error_from_rpc(e, details=details)

    async def close(self) -> None:
        await self.channel.close()
