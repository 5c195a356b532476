"""The calling side of the fast path: request frames to one listener over a small endpoint pool.

A frame occupies its endpoint until the reply arrives (two calls' messages must not interleave
on one endpoint), so concurrent calls take different endpoints: up to `pool_size`, connected
lazily and kept for the next calls. Any transport failure closes the endpoint it happened on and
raises FastPathError naming its cause; the caller falls back to gRPC. Errors the service answers
(wrong weights, unknown layer...) are raised as the same classes as over gRPC.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from moe_mesh.common.fastpath.frame import (
    ErrorHeader,
    FrameError,
    Header,
    ReplyHeader,
    RequestHeader,
    VersionError,
    encode_header,
    error_from_header,
)
from moe_mesh.common.fastpath.ucx import FrameReader, UcxRuntime, send_frame, ucx_errors


class FastPathError(Exception):
    """The fast path could not carry this call; `cause` is a short label for metrics:
    unavailable (ucxx missing), connect, send, recv, closed, timeout, version, protocol."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"fast path {cause}: {message}")
        self.cause = cause


class _Endpoint:
    def __init__(self, ep: Any, max_payload_bytes: int) -> None:
        self.ep = ep
        self.reader = FrameReader(max_payload_bytes)
        # Sends UCX has not finished when a call was abandoned: kept until the endpoint is closed.
        self.pinned: list[torch.Tensor] = []

    def abort(self) -> None:
        self.ep.abort()
        self.pinned.clear()


class FrameClient:
    """Calls one fast-path listener (`host`, `port`); `close()` aborts calls in flight."""

    def __init__(
        self,
        host: str,
        port: int,
        max_payload_bytes: int,
        pool_size: int = 4,
        loopback: bool = True,
    ) -> None:
        self.host, self.port = host, port
        self.max_payload_bytes, self.pool_size, self.loopback = (
            max_payload_bytes,
            pool_size,
            loopback,
        )
        self._idle: list[_Endpoint] = []
        self._busy: set[_Endpoint] = set()
        self._free = asyncio.Semaphore(pool_size)
        self._ucxx: Any = None  # the UCX runtime, acquired at the first connect
        self.closed = False

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    async def call(
        self, header: RequestHeader, payload: torch.Tensor, timeout_s: float
    ) -> torch.Tensor:
        """The output tensor; raises FastPathError (fall back) or a MoeMeshError the service answered."""
        if self.closed:
            raise FastPathError("closed", f"{self.address} is closed")
        payload = payload.contiguous()  # what UCX reads from, and what stays pinned if abandoned
        try:
            async with asyncio.timeout(timeout_s):
                await self._free.acquire()
        except TimeoutError:
            raise FastPathError("timeout", f"no free endpoint within {timeout_s:g}s") from None
        endpoint: _Endpoint | None = None
        try:
            endpoint = self._idle.pop() if self._idle else await self._connect(timeout_s)
            self._busy.add(endpoint)
            try:
                reply, output = await self._exchange(endpoint, header, payload, timeout_s)
            except BaseException:
                endpoint.pinned.append(payload)
                endpoint.abort()
                raise
            # After a refused frame the service closes the endpoint; otherwise it is in sync.
            if isinstance(reply, ErrorHeader) and reply.field in _FRAME_FIELDS:
                endpoint.abort()
            elif not self.closed:
                self._idle.append(endpoint)
            return self._result(reply, output)
        finally:
            if endpoint is not None:
                self._busy.discard(endpoint)
            self._free.release()

    async def _connect(self, timeout_s: float) -> _Endpoint:
        if self._ucxx is None:
            try:
                self._ucxx = UcxRuntime.acquire(self.loopback)
            except ImportError as e:
                raise FastPathError("unavailable", str(e)) from None
        try:
            async with asyncio.timeout(timeout_s):
                ep = await self._ucxx.create_endpoint(
                    self.host, self.port, connect_timeout=timeout_s
                )
        except (TimeoutError, *ucx_errors()) as e:
            raise FastPathError("connect", f"{self.address}: {type(e).__name__}: {e}") from None
        return _Endpoint(ep, self.max_payload_bytes)

    async def _exchange(
        self, endpoint: _Endpoint, header: RequestHeader, payload: torch.Tensor, timeout_s: float
    ) -> tuple[Header, torch.Tensor | None]:
        try:
            async with asyncio.timeout(timeout_s):
                await send_frame(endpoint.ep, encode_header(header), payload)
                return await endpoint.reader.read(endpoint.ep, timeout_s)
        except TimeoutError:
            raise FastPathError(
                "timeout", f"{self.address}: no reply within {timeout_s:g}s"
            ) from None
        except VersionError as e:  # an older (or newer) service: its reply is in its version
            raise FastPathError("version", f"{self.address}: {e}") from None
        except FrameError as e:
            raise FastPathError("protocol", f"{self.address}: {e}") from None
        except ucx_errors() as e:
            raise FastPathError("closed", f"{self.address}: {type(e).__name__}: {e}") from None

    def _result(self, reply: Header, output: torch.Tensor | None) -> torch.Tensor:
        if isinstance(reply, ErrorHeader):
            if reply.code == "VERSION" or (
                reply.code == "INVALID_ARGUMENT" and reply.field in _FRAME_FIELDS
            ):
                # The service could not read our frame (another version, or a framing bug): not
                # an answer about the call, so the call goes over gRPC.
                cause = "version" if reply.code == "VERSION" else "protocol"
                raise FastPathError(cause, f"{self.address}: {reply.message}")
            raise error_from_header(reply, self.address)
        if not isinstance(reply, ReplyHeader) or output is None:
            raise FastPathError("protocol", f"{self.address}: expected a reply with a tensor")
        return output

    def close(self) -> None:
        """Abort every endpoint (calls in flight fail with FastPathError) and release UCX."""
        if self.closed:
            return
        self.closed = True
        for endpoint in [*self._idle, *self._busy]:
            endpoint.abort()
        self._idle.clear()
        if self._ucxx is not None:
            self._ucxx = None
            UcxRuntime.release()


# Fields only a frame-level refusal names (frame.decode_header); errors about the call's content
# (hidden.shape, expert_ids...) come from the core and are raised, not fallen back.
_FRAME_FIELDS = {
    "magic",
    "version",
    "prefix",
    "header",
    "kind",
    "payload",
    "payload_bytes",
    "trailer",
    "dtype",
    "shape",
}
