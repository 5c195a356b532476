"""Fast-path frames over UCX (ucxx): the process's UCX runtime and sending/receiving one frame.

Progress: ucxx's own modes cost either a core while idle (`polling`, and `blocking`, whose request
waits spin `asyncio.sleep(0)`) or two thread hops per completion (`thread` with Python futures:
UCX's progress thread, then a notifier thread that wakes the loop; measured here as the reason
UCX lost to gRPC on 2 cores, and `reset()` waits up to 1 s for that notifier). So the runtime
drives the worker itself, in the event loop's thread: the worker's epoll descriptor is a loop
reader; on each wake-up it progresses the worker, completes finished requests, hands probed
messages to whoever waits on their tag, and re-arms. Nothing spins; idle costs one tick per
TICK_S (a guard against a missed wake-up), and every completion is one loop callback.

A message part-way is not always woken for: a send that waits for room at its peer (whose
shared-memory queue was full) resumes only when this side progresses again, and the rest of a
message being received has been seen to arrive without a wake-up. So while any request is
incomplete the tick is BUSY_TICK_S (measured: 256-token layers over 2 services stalled for the
old 200 ms tick in up to 7 of 150 calls, once per stall a 1 MiB send or receive part-way), for
as long as requests keep moving: one stuck for BUSY_FOR_S (a sender gone mid-message) is back
on TICK_S rather than waking the process 1,000 times a second. BUSY_TICK_S is uvloop's timer
resolution: it runs a shorter call_later at once, as call_soon (a Handle without when()), which
made the services spin.

Receives are probe-then-receive (`tag_probe(remove=True)` + `tag_recv_with_handle`): the receiver
learns a message's exact size before giving it a buffer, and nothing is posted while idle. Both
happen in the same progress callback, so an eager message costs its receiver one wake-up.

A probe matches on a message's first fragment. When the rest is missing, its sender is often not
slow but preempted: the fragment woke this process, which the scheduler may run on the waker's
core, in the middle of the waker's send (measured: 128 KiB messages after 10 ms idle were still
part-way after 2 ms of polling, and complete ~0.15 ms after a sched_yield). So for YIELD_FOR_S
after such a probe, progress goes on as loop callbacks that first give the core away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import torch

from common.fastpath.frame import (
    FIRST_MESSAGE_BYTES,
    FrameError,
    Header,
    check_payload_length,
    decode_frame,
    empty_like_payload,
    payload_view,
)

log = logging.getLogger(__name__)
TICK_S = 0.2  # progress at least this often while something waits: a missed wake-up costs this
BUSY_TICK_S = 0.001  # ... and this often while a message is part-way
BUSY_FOR_S = 1.0  # ... unless no request has moved (begun, finished) for this long
YIELD_FOR_S = 0.0005  # after a message is found part-way, yield and progress this long


# UCX's shared-memory transports write a fragment's length into 16 bits of their FIFO element
# (uct_mm_fifo_element_t): with larger segments, messages arrive truncated or never (measured:
# UCX_MM_SEG_SIZE=140000 cut 64 KiB payloads to 0 bytes, 65600 lost them).
MAX_SEGMENT_BYTES = 65535
_SEGMENT_VARS = ("UCX_MM_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_XPMEM_SEG_SIZE")
_UNITS = {u + b: 1 << 10 * i for i, u in enumerate(("", "k", "m", "g", "t")) for b in ("", "b")}
unavailable = ""  # why load_ucxx last returned None
EXTRA = "pip install 'moe-mesh[fastpath]'"  # what brings ucxx (pyproject.toml's `fastpath` extra)


def oversized_segments(env: Mapping[str, str]) -> str | None:
    """What in `env` would make UCX's shared memory corrupt messages, or None (a size set in
    ucx.conf instead is not seen)."""
    for name in _SEGMENT_VARS:
        value = env.get(name, "").strip().lower()
        match = re.fullmatch(r"(\d+)([a-z]*)", value)
        size = int(match[1]) * _UNITS.get(match[2], 0) if match else 0
        if value == "inf" or size > MAX_SEGMENT_BYTES:
            return (
                f"{name}={env[name]} is over the {MAX_SEGMENT_BYTES} bytes a UCX shared-memory "
                "fragment can carry (its length field has 16 bits); unset it or lower it"
            )
    return None


def load_ucxx(loopback: bool = False) -> ModuleType | None:
    """ucxx, or None when it cannot be imported (not installed, no libucx) or UCX's environment
    would corrupt messages (oversized_segments); never raises. `unavailable` says why.

    UCX reads its environment once, when ucxx is imported: shared memory needs error handling on
    to let endpoints fail cleanly instead of aborting the process, and on a loopback-only mesh the
    TCP transport stays on `lo`. Explicit settings (UCX_TLS, UCX_NET_DEVICES) win."""
    global unavailable
    if (oversized := oversized_segments(os.environ)) is not None:
        if unavailable != oversized:
            log.warning("UCX fast path off: %s", oversized)
        unavailable = oversized
        return None
    os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Rendezvous costs a message each way before the data moves (RTS, RTR), and with a peer that
    # sleeps in epoll each is a wake-up: on one host, eager up to 2 MiB measured a round trip 2x
    # faster at 64-128 KiB (a 32-token call) and 1.4x at 0.5-1 MiB over shared memory and TCP
    # alike. Between hosts the 32 KiB kept from before: RDMA's zero-copy rendezvous pays there.
    os.environ.setdefault("UCX_RNDV_THRESH", "intra:2mb,inter:32kb")
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        _load_libucx()
        import ucxx
    except ModuleNotFoundError as e:
        why = f"{e.name or 'ucxx'} is not installed (it comes with the fastpath extra: {EXTRA})"
        return _unavailable(why)
    except Exception as e:  # ImportError, or OSError from a missing libucx
        return _unavailable(f"ucxx cannot be imported ({e})")
    unavailable = ""
    return ucxx


def _load_libucx() -> None:
    """Load UCX's libraries from the libucx wheel, when it is installed, before ucxx. ucxx's loader
    does so only when librmm imports too, and ucxx needs no RMM (nor cuda-bindings, cuda-core or
    nvidia-ml-py) over shared memory and TCP: installed without them (`pip install --no-deps
    ucxx-cu12 libucxx-cu12 libucx-cu12`), ucxx would otherwise fail to find libucp.so."""
    try:
        import libucx
    except ImportError:
        return  # UCX from the system (or none): ucxx's import says which
    libucx.load_library()


def _unavailable(why: str) -> None:
    """Say once per reason that the fast path is unavailable (in auto mode activations go over
    gRPC; `ucx` refuses to start), and why (`unavailable`). A warning: expert services log nothing
    below it; `--fast-path off` tries nothing and says nothing."""
    global unavailable
    if why != unavailable:
        log.warning(
            "UCX fast path unavailable (--fast-path auto: activations go over gRPC): %s", why
        )
    unavailable = why


def ucx_errors() -> tuple[type[BaseException], ...]:
    """What ucxx raises for transport failures (peer closed, reset, truncated, cancelled)."""
    ucxx = load_ucxx()
    return (ucxx.exceptions.UCXError,) if ucxx is not None else ()


class UcxRuntime:
    """The process's one UCX worker, driven from one event loop; shared by servers and clients.

    `UcxRuntime.acquire()` inside the running loop returns it, `release()` when done. The worker
    outlives its users while the loop runs, so its address (what a service advertises) survives a
    fast-path restart and stopping is free; a new event loop (tests run one after another) resets
    UCX first."""

    _current: UcxRuntime | None = None
    _users = 0

    @classmethod
    def acquire(cls, loopback: bool = False) -> UcxRuntime:
        ucxx = load_ucxx(loopback)
        if ucxx is None:
            raise ImportError("ucxx cannot be imported")
        loop = asyncio.get_running_loop()
        if cls._current is None or cls._current.loop is not loop:
            if cls._current is not None:
                cls._current._shutdown()
            cls._current = cls(ucxx, loop)
        cls._users += 1
        return cls._current

    @classmethod
    def release(cls) -> None:
        cls._users = max(0, cls._users - 1)

    def __init__(self, ucxx: ModuleType, loop: asyncio.AbstractEventLoop) -> None:
        from ucxx._lib.arr import Array
        from ucxx._lib_async import application_context

        self.ucxx, self.loop, self._array = ucxx, loop, Array
        from ucxx.types import Tag

        self._tag = Tag
        # ucxx starts its own progress for a loop unless one is registered: ours is.
        application_context.ProgressTasks[loop] = self
        ucxx.init(progress_mode="blocking", enable_python_future=False)
        self.ctx = ucxx.core._get_ctx()
        self.worker = self.ctx.worker
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()
        self._fd = self.worker.epoll_file_descriptor
        self._requests: list[tuple[Any, asyncio.Future | None, Any]] = []
        # tag -> (future, buffer to receive into or None, largest length taken)
        self._waiters: dict[int, tuple[asyncio.Future, Any, int]] = {}
        self._scheduled = False
        self._tick: asyncio.TimerHandle | None = None
        self._moved = 0.0  # loop time a request last began or finished
        # monotonic time until which a part-way message's sender gets the core
        self._yield_until = 0.0
        loop.add_reader(self._fd, self._progress)

    # -- progress -----------------------------------------------------------------------------

    def kick(self) -> None:
        """Progress soon (after a submit, or a new waiter): coalesced into one loop callback."""
        self._moved = self.loop.time()
        self._soon()

    def _soon(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._progress_soon)

    def _progress_soon(self) -> None:
        self._scheduled = False
        self._progress()

    def _progress(self) -> None:
        for _ in range(1000):  # bounded: arm() says busy only while events keep coming
            self.worker.progress()
            self._complete()
            self._probe()
            if self.worker.arm():
                break
        if not (self._requests or self._waiters):
            return
        if self._requests and time.monotonic() < self._yield_until:
            os.sched_yield()  # our waker may be runnable on this core: let it send the rest
            self._soon()
            return
        busy = self._requests and self.loop.time() - self._moved < BUSY_FOR_S
        delay = BUSY_TICK_S if busy else TICK_S
        if self._tick is not None:
            if self._tick.when() <= self.loop.time() + delay:
                return
            self._tick.cancel()
        self._tick = self.loop.call_later(delay, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self._progress()

    def _complete(self) -> None:
        if not self._requests:
            return
        pending = []
        for entry in self._requests:
            request, future, _keepalive = entry
            if not request.completed:
                pending.append(entry)
                continue
            if future is not None and not future.done():
                _settle(request, future, _keepalive)
        if len(pending) < len(self._requests):
            self._moved = self.loop.time()
        self._requests = pending

    def _probe(self) -> None:
        for tag, (future, into, limit) in list(self._waiters.items()):
            if future.done():  # cancelled (timeout): nobody waits any more
                del self._waiters[tag]
                continue
            probe = self.worker.tag_probe(self._tag(tag), remove=True)
            if probe.matched:
                del self._waiters[tag]
                self._take(probe, future, into, limit)

    def discard(self, tag: int, max_messages: int) -> int:
        """Drop the messages queued on `tag` (at most `max_messages`); how many were dropped."""
        self.worker.progress()
        for dropped in range(max_messages):
            probe = self.worker.tag_probe(self._tag(tag), remove=True)
            if not probe.matched:
                return dropped
            drain = np.empty(16, np.uint8)  # truncated: it leaves UCX's queue
            request = self.worker.tag_recv_with_handle(self._array(drain), probe)
            self._requests.append((request, None, drain))
        return max_messages

    def _take(self, probe: Any, future: asyncio.Future, into: Any, limit: int) -> None:
        """Receive a probed message at once (an eager one completes here, in this callback)."""
        self._moved = self.loop.time()
        n = probe.length
        if n > limit:
            # Received anyway (truncated into a small buffer) so it leaves UCX's queue.
            drain = np.empty(16, np.uint8)
            self._requests.append(
                (self.worker.tag_recv_with_handle(self._array(drain), probe), None, drain)
            )
            future.set_exception(MessageTooLarge(n, limit))
            return
        buffer = np.empty(n, np.uint8) if into is None else into[:n]
        request = self.worker.tag_recv_with_handle(self._array(buffer), probe)
        if request.completed:
            _settle(request, future, buffer)
        else:
            self._requests.append((request, future, buffer))
            # time.monotonic: uvloop's loop.time() moves in whole milliseconds
            self._yield_until = time.monotonic() + YIELD_FOR_S
            self._soon()  # _moved is set above

    # -- requests -----------------------------------------------------------------------------

    def send(self, ep: Any, buffer: Any, tag: int) -> asyncio.Future:
        """Submit one tag message; the future completes when UCX is done with `buffer`, which is
        kept alive until then even if nobody awaits the future (UCX cannot cancel a send)."""
        request = ep._ep.tag_send(self._array(buffer), self._tag(tag))
        return self._track(request, buffer)

    def recv(self, tag: int, limit: int, into: Any = None) -> asyncio.Future:
        """A future for the next message on `tag`: a numpy byte array of its exact length (a
        prefix of `into`, a byte array, when given). MessageTooLarge when it is over `limit`
        bytes (it is drained). One waiter per tag."""
        waiter = self._waiters.get(tag)
        if waiter is not None and not waiter[0].done():
            raise RuntimeError(f"tag {tag:#x} already has a waiter")
        future = self.loop.create_future()
        probe = self.worker.tag_probe(self._tag(tag), remove=True)
        if probe.matched:  # already here: no loop round trip
            self._take(probe, future, into, limit)
            return future
        self._waiters[tag] = (future, into, limit)
        self.kick()
        return future

    def _track(self, request: Any, buffer: Any) -> asyncio.Future:
        future = self.loop.create_future()
        # A send nobody awaits (a reply to a vanished caller) must not log "never retrieved".
        future.add_done_callback(_retrieve)
        if request.completed:  # eager messages often complete at submit: no loop round trip
            _settle(request, future, buffer)
            return future
        self._requests.append((request, future, buffer))
        self.kick()
        return future

    async def connect(self, address: bytes) -> Any:
        """An endpoint to the worker at `address` (raises ucxx errors for a malformed address)."""
        return await self.ctx.create_endpoint_from_worker_address(
            self.ucxx.get_ucx_address_from_buffer(address)
        )

    def on_close(self, ep: Any, callback: Callable[[], None]) -> None:
        """Run `callback` (in the loop) when UCX reports `ep` closed or failed."""
        ep._ep.set_close_callback(lambda *_: self.loop.call_soon(callback))

    def _shutdown(self) -> None:
        """Reset UCX for a new event loop; the old loop may be closed already."""
        if self._tick is not None:
            self._tick.cancel()
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
        self._requests.clear()
        self._waiters.clear()
        self.worker = self.ctx = None
        try:
            self.ucxx.reset()
        except Exception as e:  # an endpoint still referenced somewhere; the process lives on
            log.warning("UCX reset incomplete: %s", e)


class MessageTooLarge(FrameError):
    """A message over the receiver's limit (drained, not received)."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__("message", f"message of {length} bytes exceeds the limit of {limit}")
        self.length = length


def _settle(request: Any, future: asyncio.Future, result: Any) -> None:
    try:
        request.check_error()
    except Exception as e:
        future.set_exception(e)
    else:
        future.set_result(result)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def close_endpoint(ep: Any) -> None:
    """Abort an endpoint without waiting on the peer (a dead one would make close block)."""
    try:
        ep.abort(period=0)
    except Exception as e:  # already gone
        log.debug("endpoint abort: %s", e)


def submit_frame(
    runtime: UcxRuntime, ep: Any, tag: int, messages: list[Any]
) -> list[asyncio.Future]:
    """Submit a frame's messages (frame.encode_frame) in order; a future per message."""
    return [runtime.send(ep, message, tag) for message in messages]


async def send_frame(runtime: UcxRuntime, ep: Any, tag: int, messages: list[Any]) -> None:
    """Send a frame; returns when UCX is done with its buffers (at once for eager messages:
    awaiting a done future does not yield to the loop, gather would)."""
    for future in submit_frame(runtime, ep, tag, messages):
        await future


def first_message(runtime: UcxRuntime, tag: int, max_payload_bytes: int) -> asyncio.Future:
    """The future of a frame's first message on `tag` (post it before sending what it answers)."""
    return runtime.recv(tag, FIRST_MESSAGE_BYTES + max_payload_bytes)


async def read_frame(
    runtime: UcxRuntime,
    tag: int,
    max_payload_bytes: int,
    payload_timeout_s: float,
    first: asyncio.Future | None = None,
) -> tuple[Header, torch.Tensor | None]:
    """The next frame on `tag` (its first message from `first` when given): its header and
    payload (None when it has none).

    Raises FrameError for a malformed frame (the sender should be forgotten after answering),
    ucxx errors when a receive fails. Waiting for message 1 is unbounded: bound it from outside."""
    if first is None:
        first = first_message(runtime, tag, max_payload_bytes)
    header, payload, follows = decode_frame(await first, max_payload_bytes)
    if not follows:
        return header, payload
    n = header.payload_bytes
    payload = empty_like_payload(header)  # the one receive buffer: the tensor itself
    try:
        async with asyncio.timeout(payload_timeout_s):
            received = await runtime.recv(tag, n, payload_view(payload))
    except TimeoutError:
        raise FrameError(
            "payload", f"{n} bytes announced, not received within {payload_timeout_s:g}s"
        ) from None
    except MessageTooLarge as e:
        check_payload_length(header, e.length)
    check_payload_length(header, len(received))
    return header, payload
