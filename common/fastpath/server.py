"""A UCX listener that answers fast-path request frames with a handler (the service's core).

Each connected endpoint is served one frame at a time, in its own task; several endpoints (a
router's pool, several routers) are served concurrently, so their calls meet in the core's batcher.
An error the handler raises goes back as an error frame and the endpoint stays open; a malformed
frame is answered with an error frame, then its endpoint is closed, since what follows on it
cannot be trusted to line up with frame boundaries. Nothing a peer sends stops the listener.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from moe_mesh.common.errors import DeadlineExceededError, InternalError, MoeMeshError
from moe_mesh.common.fastpath.frame import (
    DTYPE_NAMES,
    FrameError,
    ReplyHeader,
    RequestHeader,
    encode_header,
    error_header,
)
from moe_mesh.common.fastpath.ucx import FrameReader, UcxRuntime, send_frame, ucx_errors

log = logging.getLogger(__name__)
Handler = Callable[[RequestHeader, torch.Tensor | None], Awaitable[torch.Tensor]]
PAYLOAD_TIMEOUT_S = 10.0  # after a request's header, how long its payload may take to arrive


class FrameServer:
    """`await start()` -> port; `await stop()` closes the listener and every endpoint."""

    def __init__(
        self, handler: Handler, max_payload_bytes: int, port: int = 0, loopback: bool = True
    ) -> None:
        self.handler, self.max_payload_bytes = handler, max_payload_bytes
        self.requested_port, self.loopback = port, loopback
        self.port = 0
        self.frames = 0  # requests answered with a tensor
        self.errors = 0  # requests answered with an error frame
        self._listener: Any = None
        self._endpoints: set[Any] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen (the port is bound on every interface: ucxx takes no bind address)."""
        ucxx = UcxRuntime.acquire(self.loopback)
        try:
            self._listener = ucxx.create_listener(self._accept, port=self.requested_port)
        except Exception:
            UcxRuntime.release()
            raise
        self.port = self._listener.port
        return self.port

    async def stop(self) -> None:
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ep in list(self._endpoints):
            ep.abort()
        self._endpoints.clear()
        listener.close()  # after its handlers ended, or ucxx warns about live handlers
        UcxRuntime.release()

    async def _accept(self, ep: Any) -> None:
        # ucxx runs this per connection; a task of our own lets stop() cancel it.
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._endpoints.add(ep)
        reader = FrameReader(self.max_payload_bytes)
        try:
            await self._serve(ep, reader)
        except asyncio.CancelledError:
            pass
        finally:
            self._endpoints.discard(ep)
            ep.abort()  # before `reader` (and any buffer UCX may still write) is dropped
            if task is not None:
                self._tasks.discard(task)

    async def _serve(self, ep: Any, reader: FrameReader) -> None:
        transport_errors = ucx_errors()
        while True:
            try:
                header, payload = await reader.read(ep, PAYLOAD_TIMEOUT_S)
                if not isinstance(header, RequestHeader):
                    raise FrameError(
                        "kind", f"expected a request frame, got {type(header).__name__}"
                    )
            except FrameError as e:
                log.info("fast path: refusing a malformed frame: %s", e)
                await self._answer_error(ep, e)
                return
            except transport_errors:
                return  # the peer closed or vanished
            try:
                output = await self._call(header, payload)
            except MoeMeshError as e:
                await self._answer_error(ep, e)
                continue
            except Exception as e:  # a bug in the core must not take the listener down
                log.exception("fast path: handler failed")
                await self._answer_error(ep, InternalError(f"expert forward failed: {e}"))
                continue
            reply = ReplyHeader(
                DTYPE_NAMES[output.dtype],
                list(output.shape),
                output.numel() * output.element_size(),
            )
            try:
                await send_frame(ep, encode_header(reply), output)
            except transport_errors:
                return
            self.frames += 1

    async def _call(self, header: RequestHeader, payload: torch.Tensor | None) -> torch.Tensor:
        if header.timeout_ms is None:
            return await self.handler(header, payload)
        try:
            return await asyncio.wait_for(self.handler(header, payload), header.timeout_ms / 1e3)
        except TimeoutError:
            raise DeadlineExceededError(
                f"expert call did not complete within its {header.timeout_ms:g} ms budget"
            ) from None

    async def _answer_error(self, ep: Any, error: MoeMeshError) -> None:
        self.errors += 1
        try:
            await send_frame(ep, encode_header(error_header(error)))
        except ucx_errors():
            pass  # the peer is gone; nobody to tell
