"""The dispatcher's telemetry: its counters as OpenTelemetry metrics, the duration of each expert
backend call by transport, and, in a traced request, a span per MoE layer and per backend call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from opentelemetry import trace
from opentelemetry.metrics import Observation

from common.moe import ExpertGroup
from common.probing import Prober
from common.telemetry import (
    DISPATCH_DURATION,
    EJECTION_CHECKS,
    EJECTIONS,
    FAILOVERS,
    HEDGES,
    OFF,
    TOKENS_ROUTED,
    Telemetry,
)
from router_service.experts.backends import ExpertBackend


class Counted(Protocol):
    """What the dispatcher counts (ExpertDispatcher)."""

    failovers: int
    hedges: int
    hedges_won: int
    ejections: int
    prober: Prober

    def routed_counts(self) -> list[list[int]]: ...


@dataclass
class Call:
    """One backend call as observed: its transport is known once a remote call returns."""

    transport: str


class DispatchTelemetry:
    """Spans and call durations for the dispatcher, and its counters registered as metrics."""

    def __init__(self, telemetry: Telemetry = OFF) -> None:
        self.tracer = telemetry.tracer
        self.meter = telemetry.meter
        self._call_s = telemetry.latency(
            DISPATCH_DURATION, "one expert backend call of one MoE layer"
        )

    def register(self, counted: Counted) -> None:
        """Publish `counted`'s counters, read when metrics are collected."""
        self._counter(
            TOKENS_ROUTED,
            "(token, expert) assignments by layer and expert",
            lambda: [
                Observation(n, {"moe.layer": layer, "moe.expert": e})
                for layer, row in enumerate(counted.routed_counts())
                for e, n in enumerate(row)
                if n
            ],
        )
        self._counter(
            FAILOVERS,
            "expert calls retried on another replica",
            lambda: [Observation(counted.failovers)],
        )
        self._counter(
            HEDGES,
            "expert calls also sent to a second replica; won: the second answered first",
            lambda: [
                Observation(counted.hedges_won, {"moe.outcome": "won"}),
                Observation(counted.hedges - counted.hedges_won, {"moe.outcome": "lost"}),
            ],
        )
        self._counter(
            EJECTIONS,
            "expert replicas ejected for a while",
            lambda: [Observation(counted.ejections)],
        )
        prober = counted.prober
        self._counter(
            EJECTION_CHECKS,
            "health checks of ejected expert replicas; readmitted: the check ended the ejection, "
            "passed: it passed but the replica was ejected for being slow",
            lambda: [
                Observation(prober.readmitted, {"moe.outcome": "readmitted"}),
                Observation(prober.passed - prober.readmitted, {"moe.outcome": "passed"}),
                Observation(prober.failed, {"moe.outcome": "failed"}),
            ],
        )

    def _counter(self, name: str, description: str, read: Callable[[], list[Observation]]) -> None:
        self.meter.create_observable_counter(name, [lambda _: read()], description=description)

    def tracing(self) -> bool:
        """Whether this thread computes for a traced request (its layers then get spans)."""
        return self.tracer is not None and trace.get_current_span().is_recording()

    @contextmanager
    def layer_span(self, layer: int, tokens: int, groups: Sequence[ExpertGroup]) -> Iterator[None]:
        """A `moe.dispatch` span over one MoE layer's expert work, in a traced request."""
        if not self.tracing():
            yield
            return
        attributes = {
            "moe.layer": layer,
            "moe.tokens": tokens,
            "moe.experts": [g.expert for g in groups],
            "moe.expert_tokens": [g.size for g in groups],
        }
        with self.tracer.start_as_current_span("moe.dispatch", attributes=attributes):
            yield

    @contextmanager
    def call(
        self, backend: ExpertBackend, layer: int, groups: Sequence[tuple[int, torch.Tensor]]
    ) -> Iterator[Call]:
        """Time one backend call per transport and, in a traced request, span it with what it carried.

        A remote call's transport is known once it returns: its result says whether UCX or gRPC
        carried it (`ExpertOutputs.transport`); the caller sets it on the yielded record."""
        call = Call("colocated" if backend.local else "grpc")
        start = time.perf_counter()
        try:
            if not self.tracing():
                yield call
                return
            attributes = {
                "moe.layer": layer,
                "moe.transport": call.transport,
                "moe.replica": getattr(backend, "address", "colocated"),
                "moe.region": backend.region,
                "moe.experts": [e for e, _ in groups],
                "moe.expert_tokens": [r.shape[0] for _, r in groups],
                "moe.bytes": sum(r.numel() * r.element_size() for _, r in groups),
            }
            with self.tracer.start_as_current_span(
                "moe.expert_call", attributes=attributes
            ) as span:
                yield call
                span.set_attribute("moe.transport", call.transport)
        finally:
            self._call_s.record(time.perf_counter() - start, {"moe.transport": call.transport})
