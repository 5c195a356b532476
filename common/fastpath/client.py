"""The calling side of the fast path: request frames to one expert service's UCX worker.

One endpoint per service, opened lazily with a hello that tells the service this process's worker
address and a random client id. Calls are numbered, and each reply comes back on its call's own
tag, so concurrent calls share the endpoint without interleaving. Any transport failure drops the
connection (the next call says hello again, with a new id) and raises FastPathError naming its
cause; the caller falls back to gRPC. Errors the service answers (wrong weights, unknown layer...)
are raised as the same classes as over gRPC.

A call its caller gives up on is not a transport failure: the calls sharing its connection go on,
and its reply is read and dropped when it comes (unread, it would hold the service's send); if it
does not come within the call's budget, the connection is dropped. A call cancelled (a hedge race
lost) keeps the connection; one timed out retires it (new calls say hello again, as to a restarted
service), and it closes once its calls in flight are done.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import numpy as np
import torch

from common.fastpath import Target
from common.fastpath.auth import HelloSigner
from common.fastpath.frame import (
    CLIENT_ID_BITS,
    MAX_CALL,
    ErrorHeader,
    FrameError,
    Header,
    ReplyHeader,
    RequestHeader,
    VersionError,
    control_tag,
    encode_frame,
    encode_hello,
    error_from_header,
    hello_tag,
    reply_tag,
    request_tag,
)
from common.fastpath.ucx import (
    UcxRuntime,
    close_endpoint,
    first_message,
    read_frame,
    submit_frame,
    ucx_errors,
)

log = logging.getLogger(__name__)
ABANDONED_REPLY_S = 30.0  # at least; a call's own budget (RequestHeader.timeout_ms) when longer


class FastPathError(Exception):
    """The fast path could not carry this call; `cause` is a short label for metrics:
    unavailable (ucxx missing), connect, send, recv, closed, timeout, version, protocol."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"fast path {cause}: {message}")
        self.cause = cause


class _Refused(Exception):
    """The service refused a frame of this connection (on its control tag)."""

    def __init__(self, header: Header) -> None:
        self.header = header


class _Connection:
    def __init__(self, ep: Any, client_id: int) -> None:
        self.ep, self.id = ep, client_id
        self.calls = 0
        # The reply futures (first messages) of calls in flight: a refusal or a dropped
        # connection fails them, so each call waits on its own future alone.
        self.pending: dict[int, asyncio.Future] = {}
        # The control tag's frame, read once: a refusal of a frame of this connection
        # (cancelled when the connection is dropped).
        self.refusal: asyncio.Task | None = None
        self.abandoned: set[asyncio.Task] = set()  # reading the replies of calls given up on
        self.closed = False

    def fail(self, error: BaseException) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)


class FrameClient:
    """Calls one expert service at its `target` (UCX worker address and server number);
    `close()` aborts calls in flight."""

    def __init__(
        self,
        target: Target,
        max_payload_bytes: int,
        loopback: bool = True,
        signer: HelloSigner | None = None,
    ) -> None:
        self.target, self.max_payload_bytes, self.loopback = target, max_payload_bytes, loopback
        self.signer = signer  # under mutual TLS: proves this router's mesh certificate
        self._runtime: UcxRuntime | None = None  # acquired at the first connect
        self._conn: _Connection | None = None
        self._retired: set[_Connection] = set()  # closing once their calls in flight are done
        self._connecting: asyncio.Lock | None = None
        self.closed = False

    @property
    def address(self) -> str:
        return f"ucx-worker:{self.target.address[:6].hex()}…/{self.target.server}"

    async def call(
        self, header: RequestHeader, payload: torch.Tensor, timeout_s: float
    ) -> tuple[torch.Tensor, float]:
        """The output tensor and the service's own time for the call (seconds); raises
        FastPathError (fall back) or a MoeMeshError the service answered."""
        if self.closed:
            raise FastPathError("closed", f"{self.address} is closed")
        payload = payload.contiguous()  # what UCX reads from (kept alive by the runtime)
        conn = await self._connection(timeout_s)
        try:
            reply, output = await self._exchange(conn, header, payload, timeout_s)
        except asyncio.CancelledError:
            raise  # given up on: the connection stays (_exchange)
        except FastPathError as e:
            self._retire(conn) if e.cause == "timeout" else self._drop(conn)
            raise
        except BaseException:
            self._drop(conn)
            raise
        return self._result(conn, reply, output)

    async def connect(self, timeout_s: float) -> None:
        """Say hello now rather than on the first call; FastPathError when that fails."""
        if self.closed:
            raise FastPathError("closed", f"{self.address} is closed")
        await self._connection(timeout_s)

    async def _connection(self, timeout_s: float) -> _Connection:
        if self._conn is not None:
            return self._conn
        if self._runtime is None:
            try:
                self._runtime = UcxRuntime.acquire(self.loopback)
            except ImportError as e:
                raise FastPathError("unavailable", str(e)) from None
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # concurrent first calls share one hello
            if self._conn is not None:
                return self._conn
            runtime = self._runtime
            try:
                async with asyncio.timeout(timeout_s):
                    ep = await runtime.connect(self.target.address)
                    conn = _Connection(ep, random.randrange(1, 1 << CLIENT_ID_BITS))
                    proof = (
                        self.signer.proof(*self.target, conn.id, runtime.address)
                        if self.signer
                        else b""
                    )
                    hello = encode_hello(conn.id, runtime.address, proof=proof)
                    await runtime.send(
                        ep, np.frombuffer(hello, np.uint8), hello_tag(self.target.server)
                    )
            except (TimeoutError, *ucx_errors()) as e:
                raise FastPathError("connect", f"{self.address}: {type(e).__name__}: {e}") from None
            if self.closed:
                close_endpoint(ep)
                raise FastPathError("closed", f"{self.address} is closed")
            conn.refusal = asyncio.ensure_future(
                read_frame(runtime, control_tag(conn.id), self.max_payload_bytes, timeout_s)
            )
            conn.refusal.add_done_callback(lambda task: _refused(conn, task))
            self._conn = conn
            return conn

    async def _exchange(
        self, conn: _Connection, header: RequestHeader, payload: torch.Tensor, timeout_s: float
    ) -> tuple[Header, torch.Tensor | None]:
        runtime = self._runtime
        assert runtime is not None
        call = conn.calls = conn.calls % MAX_CALL + 1
        tag = reply_tag(conn.id, call)
        # Posted before the request leaves: the reply is taken in the callback it arrives in.
        first = conn.pending[call] = first_message(runtime, tag, self.max_payload_bytes)
        reading: asyncio.Future | None = None
        try:
            messages = encode_frame(header, payload, call=call)
            # Not awaited: the reply implies the request arrived; a failed send fails the reply.
            for sent in submit_frame(runtime, conn.ep, request_tag(conn.id), messages):
                sent.add_done_callback(lambda s: _fail_with(first, s))
            reading = asyncio.ensure_future(
                read_frame(runtime, tag, self.max_payload_bytes, timeout_s, first)
            )
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(reading)
        except _Refused as e:  # the service could not read a frame of ours
            return e.header, None
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
        finally:
            if reading is not None and not reading.done():
                budget_s = (header.timeout_ms or 0) / 1e3
                self._abandon(conn, call, reading, max(ABANDONED_REPLY_S, budget_s + 5))
            else:
                first.cancel()
                self._done(conn, call)

    def _abandon(
        self, conn: _Connection, call: int, reading: asyncio.Future, within_s: float
    ) -> None:
        """Read and drop the reply of a call given up on; drop the connection if it does not come
        `within_s` (the service answers every call by its budget, if only with an error)."""

        async def drain() -> None:
            try:
                async with asyncio.timeout(within_s):
                    await reading
            except BaseException as e:  # no reply in time, or the connection failed meanwhile
                if not conn.closed:
                    log.warning(
                        "fast path %s: the reply of a call given up on did not come (%s); "
                        "dropping the connection",
                        self.address,
                        type(e).__name__,
                    )
                self._drop(conn)
            finally:
                self._done(conn, call)

        task = asyncio.ensure_future(drain())
        conn.abandoned.add(task)
        task.add_done_callback(conn.abandoned.discard)

    def _result(
        self, conn: _Connection, reply: Header, output: torch.Tensor | None
    ) -> tuple[torch.Tensor, float]:
        if isinstance(reply, ErrorHeader):
            if reply.code == "VERSION" or (
                reply.code == "INVALID_ARGUMENT" and reply.field in _FRAME_FIELDS
            ):
                # The service could not read our frame (another version, or a framing bug): not
                # an answer about the call, so the call goes over gRPC.
                self._drop(conn)
                cause = "version" if reply.code == "VERSION" else "protocol"
                raise FastPathError(cause, f"{self.address}: {reply.message}")
            raise error_from_header(reply, self.address)
        if not isinstance(reply, ReplyHeader) or output is None:
            raise FastPathError("protocol", f"{self.address}: expected a reply with a tensor")
        return output, reply.service_s

    def _done(self, conn: _Connection, call: int) -> None:
        conn.pending.pop(call, None)
        if conn in self._retired and not conn.pending:
            self._drop(conn)

    def _retire(self, conn: _Connection) -> None:
        """New calls take a new connection; this one closes when its calls in flight are done."""
        if conn.closed:
            return
        if conn is self._conn:
            self._conn = None
        self._retired.add(conn)
        if not conn.pending:
            self._drop(conn)

    def _drop(self, conn: _Connection | None) -> None:
        """Forget a connection: its endpoint closes, its calls in flight fail."""
        if conn is None or conn.closed:
            return
        if conn is self._conn:
            self._conn = None
        self._retired.discard(conn)
        conn.closed = True
        conn.fail(FastPathError("closed", f"{self.address}: connection dropped"))
        if conn.refusal is not None:
            conn.refusal.cancel()
        close_endpoint(conn.ep)

    def close(self) -> None:
        """Abort the connection (calls in flight fail with FastPathError) and release UCX."""
        if self.closed:
            return
        self.closed = True
        for conn in [self._conn, *self._retired]:
            self._drop(conn)
        if self._runtime is not None:
            self._runtime = None
            UcxRuntime.release()


def _refused(conn: _Connection, task: asyncio.Task) -> None:
    """The control tag's frame arrived (or its reader ended): the calls in flight learn it."""
    if task.cancelled():
        return
    error = task.exception()
    conn.fail(_Refused(task.result()[0]) if error is None else error)


def _fail_with(reply: asyncio.Future, sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None and not reply.done():
        reply.set_exception(sent.exception())


# Fields only a frame-level refusal names (frame.decode_header); errors about the call's content
# (hidden.shape, expert_ids...) come from the core and are raised, not fallen back.
_FRAME_FIELDS = {
    "magic",
    "version",
    "prefix",
    "header",
    "kind",
    "call",
    "payload",
    "payload_bytes",
    "dtype",
    "shape",
}
