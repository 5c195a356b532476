"""The expert service's fast path: request frames from a UCX listener into the same ExpertHost.forward
as gRPC calls, so both merge in one dynamic batcher and get the same checks and error classes.

As thin as the servicer: frames -> arguments of forward, nothing else. The frame codec has already
refused what gRPC would refuse before the servicer runs (garbage, size limit, byte count).
"""

from __future__ import annotations

import logging

import torch
from opentelemetry import propagate, trace
from opentelemetry.metrics import Observation

from common.errors import PreconditionError
from common.fastpath import LOOPBACK_HOSTS, ucx
from common.fastpath.auth import HelloVerifier
from common.fastpath.frame import DTYPES, RequestHeader
from common.fastpath.server import FrameServer
from common.fastpath.ucx import load_ucxx
from common.telemetry import FAST_PATH_REFUSED
from expert_service.core import ExpertHost

log = logging.getLogger(__name__)


class FastPath:
    """The UCX fast path of one expert service (settings.fast_path), or nothing when it is off."""

    def __init__(self, host: ExpertHost, verifier: HelloVerifier | None = None) -> None:
        self.host = host
        settings = host.settings
        self.mode = settings.fast_path
        self.server: FrameServer | None = None
        if self.mode != "off":
            self.server = FrameServer(
                self.forward,
                settings.max_message_bytes,
                loopback=settings.host in LOOPBACK_HOSTS,
                verifier=verifier,
            )
            server = self.server
            host.telemetry.meter.create_observable_counter(
                FAST_PATH_REFUSED,
                [lambda _: [Observation(server.refused)]],
                description="fast-path hellos dropped for a missing or bad certificate proof",
            )

    async def forward(self, header: RequestHeader, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:  # a frame without payload: forward reports the empty payload
            hidden = torch.empty(header.shape, dtype=DTYPES[header.dtype])
        tracer = self.host.telemetry.tracer
        if header.trace is None or tracer is None:
            return await self._forward(header, hidden)
        # The span a gRPC call gets from the server interceptor, so a traced request still
        # shows this service; ExpertHost.forward adds its attributes to it.
        with tracer.start_as_current_span(
            "moe_mesh.v1.ExpertService/Forward",
            context=propagate.extract(header.trace),
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "ucx", "moe.transport": "ucx"},
        ):
            return await self._forward(header, hidden)

    async def _forward(self, header: RequestHeader, hidden: torch.Tensor) -> torch.Tensor:
        return await self.host.forward(
            header.model_id,
            header.weights_checksum,
            header.layer,
            header.expert_ids,
            header.token_counts,
            hidden,
        )

    async def start(self) -> list[str]:
        """Serve; the addresses to advertise (none when off, or in auto mode without ucxx). A worker
        address names its host itself: no advertised host is needed."""
        if self.server is None:
            return []
        loopback = self.server.loopback
        if load_ucxx(loopback) is None:
            if self.mode == "ucx":
                raise PreconditionError(f"--fast-path ucx: {ucx.unavailable}")
            self.server = None  # load_ucxx has said why, once
            return []
        try:
            url = await self.server.start()
        except Exception as e:  # UCX failed to start, or an address over the registry's limit
            if self.mode == "ucx":
                raise
            log.warning("fast path off: UCX did not start: %s", e)
            self.server = None
            return []
        log.info("fast path on UCX worker %s", url[:40] + "…")
        return [url]

    async def stop(self, drain_s: float = 0.0) -> None:
        """Calls in flight may answer for up to `drain_s` (FrameServer.stop)."""
        if self.server is not None:
            await self.server.stop(drain_s)
