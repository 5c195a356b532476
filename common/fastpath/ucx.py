"""Fast-path frames over UCX (ucxx): the process's UCX runtime and sending/receiving one frame.

Progress mode: ucxx's `polling` and `blocking` modes complete every pending request by spinning
`asyncio.sleep(0)`, and a service always has a receive pending per connected router, so both burn
a core while idle (measured here, 2 cores: 1.5-1.7 s of CPU per 2 s idle). `thread` progress with
Python futures idles at ~1% CPU and, for echo round trips between two processes, costs
p50 0.64 ms at 8 KiB / 0.86 ms at 4 MiB over shared memory and 0.70 / 5.7 ms over UCX_TLS=tcp,
against gRPC's 0.5 / ~20 ms. The "10-50x slower" thread modes of the brief are those without
Python futures (completion by polling from the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
from types import ModuleType
from typing import Any

import numpy as np
import torch

from moe_mesh.common.fastpath.frame import (
    FIRST_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    TRAILER_BYTES,
    FrameError,
    Header,
    decode_header,
    decode_trailer,
    empty_like_payload,
    encode_trailer,
    payload_view,
)

log = logging.getLogger(__name__)


def load_ucxx(loopback: bool = False) -> ModuleType | None:
    """ucxx, or None when it cannot be imported (not installed, no libucx); never raises.

    UCX reads its environment once, when ucxx is imported: shared memory needs error handling on
    to let endpoints fail cleanly instead of aborting the process, and on a loopback-only mesh the
    TCP transport stays on `lo`. Explicit settings (UCX_TLS, UCX_NET_DEVICES) win."""
    os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        import ucxx
    except Exception as e:  # ImportError, or OSError from a missing libucx
        log.info("UCX fast path unavailable: cannot import ucxx (%s)", e)
        return None
    return ucxx


class UcxRuntime:
    """The process's one UCX context, shared by listeners and clients of this event loop.

    ucxx keeps a single context per process, bound to the event loop it was initialised in (its
    notifier thread hands completions to that loop), so this is the one place that initialises and
    resets it: `acquire()` inside the running loop, `release()` when done; the last release resets
    UCX (tests run one event loop after another in one process)."""

    _users = 0
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def acquire(cls, loopback: bool = False) -> ModuleType:
        ucxx = load_ucxx(loopback)
        if ucxx is None:
            raise ImportError("ucxx cannot be imported")
        loop = asyncio.get_running_loop()
        if cls._loop is not loop:
            if cls._loop is not None:  # left over from a loop that ended without releasing
                cls._reset(ucxx)
            ucxx.init(progress_mode="thread", enable_python_future=True)
            cls._loop, cls._users = loop, 0
        cls._users += 1
        return ucxx

    @classmethod
    def release(cls) -> None:
        cls._users -= 1
        if cls._users <= 0 and cls._loop is not None:
            ucxx = load_ucxx()
            if ucxx is not None:
                cls._reset(ucxx)

    @classmethod
    def _reset(cls, ucxx: ModuleType) -> None:
        cls._loop, cls._users = None, 0
        try:
            ucxx.stop_notifier_thread()
            ucxx.reset()
        except Exception as e:  # an endpoint still referenced somewhere; the process lives on
            log.warning("UCX reset incomplete: %s", e)


def ucx_errors() -> tuple[type[BaseException], ...]:
    """What ucxx raises for transport failures (peer closed, reset, truncated, cancelled)."""
    ucxx = load_ucxx()
    return (ucxx.exceptions.UCXError,) if ucxx is not None else ()


async def send_frame(ep: Any, first: bytes, payload: torch.Tensor | None = None) -> None:
    """Send one frame: message 1 (`first`, from frame.encode_header), then the payload from the
    tensor's own memory and its trailer. Submitted in order, awaited together.

    The caller keeps `payload` alive until the endpoint is closed if this is cancelled: UCX does
    not cancel a send in flight."""
    sends = [ep.send(np.frombuffer(first, np.uint8))]
    if payload is not None and payload.numel():
        n = payload.numel() * payload.element_size()
        sends += [
            ep.send(payload_view(payload)),
            ep.send(np.frombuffer(encode_trailer(n), np.uint8)),
        ]
    await asyncio.gather(*sends)


class FrameReader:
    """Receives frames on one endpoint into one reusable buffer for message 1."""

    def __init__(self, max_payload_bytes: int) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._first = np.empty(FIRST_MESSAGE_BYTES, np.uint8)
        self._trailer = np.empty(TRAILER_BYTES, np.uint8)
        # A receive cut short (timeout, cancellation) is not cancelled by UCX: its buffer must
        # outlive the endpoint, which the caller closes next. The reader lives as long.
        self._abandoned: list[torch.Tensor] = []

    async def read(self, ep: Any, payload_timeout_s: float) -> tuple[Header, torch.Tensor | None]:
        """The next frame's header and payload (None when it has none).

        Raises FrameError for a malformed frame (the endpoint should be closed after answering),
        ucxx errors when the peer goes away."""
        ucxx = load_ucxx()
        # A message shorter than the prefix would leave the previous frame's prefix readable.
        self._first[:PREFIX_BYTES] = 0
        try:
            await ep.recv(self._first)
        except ucxx.exceptions.UCXMessageTruncatedError:
            raise FrameError(
                "header",
                f"message exceeds {FIRST_MESSAGE_BYTES} bytes (header limit {MAX_HEADER_BYTES})",
            ) from None
        header = decode_header(memoryview(self._first), self.max_payload_bytes)
        n = getattr(header, "payload_bytes", 0)
        if not n:
            return header, None
        payload = empty_like_payload(header)  # the one receive buffer: the tensor itself
        # Both receives posted at once; awaited with a bound, and reaped whatever happens.
        recvs = [
            asyncio.ensure_future(ep.recv(payload_view(payload))),
            asyncio.ensure_future(ep.recv(self._trailer)),
        ]
        try:
            async with asyncio.timeout(payload_timeout_s):
                await asyncio.gather(*recvs)
        except BaseException as e:
            self._abandoned.append(payload)
            for r in recvs:
                r.cancel()
            await asyncio.gather(*recvs, return_exceptions=True)
            if isinstance(e, TimeoutError):
                raise FrameError(
                    "payload", f"{n} bytes announced, not received within {payload_timeout_s:g}s"
                ) from None
            if isinstance(e, ucxx.exceptions.UCXMessageTruncatedError):
                raise FrameError(
                    "payload", f"more than the {n} bytes announced were sent"
                ) from None
            raise
        decode_trailer(self._trailer.tobytes(), n)
        return header, payload
