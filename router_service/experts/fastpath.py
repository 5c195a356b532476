"""A replica's fast path as the router sees it: a UCX frame client, and a back-off after failures.

RemoteExperts asks `usable()` before each call; a call the fast path cannot carry raises
FastPathError and RemoteExperts re-sends it over gRPC. Each failure turns this replica's fast path
off for a back-off that doubles (1 s, 2 s, ... at most 30 s by default) and is reset by the next
success, so a flapping listener costs one fallback per back-off, not one per call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opentelemetry import propagate, trace

from common.fastpath import Target, parse_worker_url, worker_url
from common.fastpath.auth import HelloSigner
from common.fastpath.client import FastPathError, FrameClient
from common.fastpath.frame import DTYPE_NAMES, RequestHeader
from common.fastpath.ucx import load_ucxx
from common.resilience import call_size

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class FastPathConfig:
    """The router's fast-path settings (RouterSettings documents each field)."""

    mode: str = "auto"  # auto | ucx | off
    timeout_s: float = 0.5
    backoff_s: float = 1.0
    max_backoff_s: float = MAX_BACKOFF_S
    loopback: bool = True
    # Called with the cause of every fallback (a hook for the fallback counter metric).
    on_fallback: Callable[[str], None] | None = None
    signer: HelloSigner | None = None  # under mutual TLS: hellos prove the router's certificate

    def enabled(self) -> bool:
        """Off by setting, or auto without ucxx; `ucx` without ucxx is refused at start-up."""
        return self.mode != "off" and load_ucxx(self.loopback) is not None


class FastPathLink:
    """One replica's UCX client and its back-off state."""

    def __init__(
        self,
        url: str,
        target: Target,
        config: FastPathConfig,
        max_message_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url, self.config, self.clock = url, config, clock
        self.client = FrameClient(target, max_message_bytes, config.loopback, config.signer)
        self.fallbacks: Counter[str] = Counter()  # cause -> calls that fell back
        self.calls = 0  # calls the fast path carried
        self.off_until = 0.0
        self._backoff_s = config.backoff_s

    @classmethod
    def offered(
        cls, urls: list[str] | str, config: FastPathConfig | None, max_message_bytes: int
    ) -> FastPathLink | None:
        """A link when the service advertises ucx and this router's fast path is on."""
        target = parse_worker_url(urls) if urls else None
        if target is None or config is None or not config.enabled():
            return None
        return cls(worker_url(*target), target, config, max_message_bytes)

    def usable(self) -> bool:
        return not self.client.closed and self.clock() >= self.off_until

    async def forward(
        self,
        model_id: str,
        weights_checksum: str,
        layer: int,
        expert_ids: list[int],
        counts: list[int],
        hidden: torch.Tensor,
        timeout_s: float | None,
    ) -> tuple[torch.Tensor, float]:
        """The output rows and the service's time; FastPathError when the call should go over gRPC."""
        # timeout_s per CALL_ROWS rows, so a long prompt's prefill is not abandoned (computed twice);
        # half the call's budget at most: a fallback must still have time to finish over gRPC.
        budget = self.config.timeout_s * call_size(hidden.shape[0])
        if timeout_s is not None:
            budget = min(budget, timeout_s / 2)
        header = RequestHeader(
            model_id=model_id,
            weights_checksum=weights_checksum,
            layer=layer,
            expert_ids=expert_ids,
            token_counts=counts,
            dtype=DTYPE_NAMES.get(hidden.dtype, str(hidden.dtype)),
            shape=list(hidden.shape),
            payload_bytes=hidden.numel() * hidden.element_size(),
            timeout_ms=None if timeout_s is None else timeout_s * 1e3,
            trace=_trace_context(),
        )
        try:
            reply = await self.client.call(header, hidden, budget)
        except FastPathError as e:
            if not self.client.closed:  # closed on purpose (retire, close): not a fallback
                self.failed(e.cause, str(e))
            raise
        self.calls += 1
        self._backoff_s = self.config.backoff_s
        return reply

    def failed(self, cause: str, detail: str = "") -> None:
        """Count a fallback and turn the fast path off for the current back-off."""
        self.fallbacks[cause] += 1
        self.off_until = self.clock() + self._backoff_s
        log.warning(
            "fast path %s: %s; falling back to gRPC, retrying UCX in %gs",
            self.url,
            detail or cause,
            self._backoff_s,
        )
        self._backoff_s = min(self._backoff_s * 2, self.config.max_backoff_s)
        if self.config.on_fallback is not None:
            self.config.on_fallback(cause)

    async def warm(self) -> None:
        """Connect ahead of the first call. A failure here is not a fallback (no call fell back):
        the first call tries again and counts it if it fails too."""
        with contextlib.suppress(FastPathError):
            await self.client.connect(self.config.timeout_s)

    def close(self) -> None:
        self.client.close()


def _trace_context() -> dict[str, str] | None:
    """The current trace context for the service's span, as gRPC metadata would carry it."""
    if not trace.get_current_span().is_recording():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None
