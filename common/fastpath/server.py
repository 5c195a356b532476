"""The service side of the fast path: answers request frames with a handler (the service's core).

Nothing listens: clients reach this process's UCX worker by its address (see fastpath/__init__).
A client's hello (on this server's hello tag) carries its worker address and id (and, with a
verifier, its proof of a mesh certificate: a hello without a good one is dropped); the server opens
an endpoint back to it and reads its requests on request_tag(id). Each request is handled in its own task, so a
client's concurrent calls, and other clients', meet in the core's batcher; each reply goes to the
call's own tag. An error the handler raises goes back as an error frame; a frame that cannot be
read is refused on the client's control tag and the client is forgotten (it reconnects), since
what follows from it cannot be trusted to line up with frame boundaries. A hello that is not one
is dropped: there is nobody to answer. Clients are reaped when UCX reports their endpoint closed,
and at most MAX_CLIENTS are kept (the least recently heard-from is evicted).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from common.errors import DeadlineExceededError, InternalError, MoeMeshError
from common.fastpath import worker_url
from common.fastpath.auth import HelloVerifier
from common.fastpath.frame import (
    DTYPE_NAMES,
    MAX_HELLO_BYTES,
    FrameError,
    ReplyHeader,
    RequestHeader,
    control_tag,
    decode_hello,
    encode_frame,
    error_header,
    hello_tag,
    reply_tag,
    request_tag,
)
from common.fastpath.ucx import (
    UcxRuntime,
    close_endpoint,
    read_frame,
    send_frame,
    ucx_errors,
)

log = logging.getLogger(__name__)
Handler = Callable[[RequestHeader, torch.Tensor | None], Awaitable[torch.Tensor]]
PAYLOAD_TIMEOUT_S = 10.0  # after a request's header, how long its payload may take to arrive
MAX_CLIENTS = 256  # router processes x their links; one more evicts the quietest
MAX_CALLS_PER_CLIENT = 64  # requests of one client handled at once; more wait in UCX's queue


class _Client:
    def __init__(self, client_id: int, ep: Any) -> None:
        self.id, self.ep = client_id, ep
        self.reader: asyncio.Task | None = None
        self.calls: set[asyncio.Task] = set()
        self.slots = asyncio.Semaphore(MAX_CALLS_PER_CLIENT)
        self.seen = time.monotonic()


_numbers = itertools.count(1)


class FrameServer:
    """`await start()` -> the address to advertise (ucx-worker:...); `await stop()` forgets every
    client; start() again serves at the same address (the worker outlives the server)."""

    def __init__(
        self,
        handler: Handler,
        max_payload_bytes: int,
        loopback: bool = True,
        verifier: HelloVerifier | None = None,
    ) -> None:
        self.handler, self.max_payload_bytes, self.loopback = handler, max_payload_bytes, loopback
        self.verifier = verifier  # under mutual TLS: hellos must prove a mesh certificate
        # Unique in this process (which has one UCX worker), kept across stop/start, so a
        # restarted server answers at the address it advertised before.
        self.number = next(_numbers)
        self.hello_tag = hello_tag(self.number)
        self.address = ""
        self.frames = 0  # requests answered with a tensor
        self.errors = 0  # requests answered with an error frame
        self.refused = 0  # hellos dropped for a missing or bad proof
        self.clients: dict[int, _Client] = {}
        self._runtime: UcxRuntime | None = None
        self._hello: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._runtime is not None

    async def start(self) -> str:
        if self._runtime is not None:
            return self.address
        runtime = UcxRuntime.acquire(self.loopback)
        try:
            self.address = worker_url(runtime.address, self.number)
        except ValueError:
            UcxRuntime.release()
            raise
        self._runtime = runtime
        # Hellos sent while this server was stopped name connections it never made; their
        # clients time out and say hello again.
        stale = runtime.discard(self.hello_tag, MAX_CLIENTS)
        if stale:
            log.info("fast path: dropped %d hello(s) queued while stopped", stale)
        self._hello = asyncio.create_task(self._accept())
        return self.address

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop reading hellos and requests, let the calls in flight answer for up to `drain_s`
        (a router's fast path is as good a caller as its gRPC), then forget every client."""
        if self._runtime is None:
            return
        runtime, self._runtime = self._runtime, None
        hello = [self._hello] if self._hello else []
        for task in hello + [c.reader for c in self.clients.values() if c.reader]:
            task.cancel()
        calls = [t for c in self.clients.values() for t in c.calls]
        if calls and drain_s > 0:
            await asyncio.wait(calls, timeout=drain_s)
        tasks = hello  # _forget gives each client's reader and calls (cancelled)
        for client in list(self.clients.values()):
            tasks += self._forget(client)
        await asyncio.gather(*tasks, return_exceptions=True)
        runtime.release()

    async def _accept(self) -> None:
        runtime = self._runtime
        assert runtime is not None
        while True:
            try:
                hello = await runtime.recv(self.hello_tag, MAX_HELLO_BYTES)
                client_id, address, proof = decode_hello(hello)
            except (FrameError, *ucx_errors()) as e:
                log.info("fast path: dropping a hello that is not one: %s", e)
                continue
            if self.verifier is not None:
                try:
                    self.verifier.check(proof, runtime.address, self.number, client_id, address)
                except FrameError as e:
                    self.refused += 1
                    log.warning("fast path: refusing a hello: %s", e)
                    continue
            try:
                ep = await runtime.connect(address)
            except ucx_errors() as e:
                log.info("fast path: cannot reach a client that said hello: %s", e)
                continue
            self._add(runtime, _Client(client_id, ep))

    def _add(self, runtime: UcxRuntime, client: _Client) -> None:
        old = self.clients.get(client.id)
        if old is not None:  # the same id again: that client reconnected
            self._forget(old)
        if len(self.clients) >= MAX_CLIENTS:
            self._forget(min(self.clients.values(), key=lambda c: c.seen))
        self.clients[client.id] = client
        runtime.on_close(client.ep, lambda: self._forget(client))
        client.reader = asyncio.create_task(self._serve(runtime, client))

    def _forget(self, client: _Client) -> list[asyncio.Task]:
        """Drop a client (closed, evicted, refused, or stopping); its tasks are cancelled."""
        if self.clients.get(client.id) is client:
            del self.clients[client.id]
        tasks = [t for t in [client.reader, *client.calls] if t is not None]
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        close_endpoint(client.ep)
        return tasks

    async def _serve(self, runtime: UcxRuntime, client: _Client) -> None:
        tag = request_tag(client.id)
        while True:
            try:
                header, payload = await read_frame(
                    runtime, tag, self.max_payload_bytes, PAYLOAD_TIMEOUT_S
                )
                if not isinstance(header, RequestHeader):
                    raise FrameError(
                        "kind", f"expected a request frame, got {type(header).__name__}"
                    )
            except FrameError as e:
                log.info("fast path: refusing a malformed frame: %s", e)
                await self._answer(runtime, client, control_tag(client.id), error=e)
                self._forget(client)
                return
            except ucx_errors():
                self._forget(client)
                return
            client.seen = time.monotonic()
            await client.slots.acquire()
            task = asyncio.create_task(self._call(runtime, client, header, payload))
            client.calls.add(task)
            task.add_done_callback(client.calls.discard)

    async def _call(
        self,
        runtime: UcxRuntime,
        client: _Client,
        header: RequestHeader,
        payload: torch.Tensor | None,
    ) -> None:
        tag = reply_tag(client.id, header.call)
        try:
            began = time.perf_counter()
            try:
                output = await self._run(header, payload)
                if output.dtype not in DTYPE_NAMES:  # the caller would wait for a reply in vain
                    raise InternalError(
                        f"expert forward returned {output.dtype}: not a frame dtype"
                    )
            except MoeMeshError as e:
                await self._answer(runtime, client, tag, error=e)
                return
            except Exception as e:  # a bug in the core must not take the server down
                log.exception("fast path: handler failed")
                await self._answer(runtime, client, tag, InternalError(f"expert forward: {e}"))
                return
            reply = ReplyHeader(
                DTYPE_NAMES[output.dtype],
                list(output.shape),
                output.numel() * output.element_size(),
                time.perf_counter() - began,
            )
            await self._answer(runtime, client, tag, reply=(reply, output.contiguous()))
            self.frames += 1
        finally:
            client.slots.release()

    async def _run(self, header: RequestHeader, payload: torch.Tensor | None) -> torch.Tensor:
        if header.timeout_ms is None:
            return await self.handler(header, payload)
        try:  # in this task: wait_for would start another one for every call (Python 3.11)
            async with asyncio.timeout(header.timeout_ms / 1e3):
                return await self.handler(header, payload)
        except TimeoutError:
            raise DeadlineExceededError(
                f"expert call did not complete within its {header.timeout_ms:g} ms budget"
            ) from None

    async def _answer(
        self,
        runtime: UcxRuntime,
        client: _Client,
        tag: int,
        error: MoeMeshError | None = None,
        reply: tuple[ReplyHeader, torch.Tensor] | None = None,
    ) -> None:
        if error is not None:
            self.errors += 1
            messages = encode_frame(error_header(error))
        else:
            assert reply is not None
            messages = encode_frame(*reply)
        try:
            await send_frame(runtime, client.ep, tag, messages)
        except ucx_errors():
            self._forget(client)  # the peer is gone; nobody to tell
