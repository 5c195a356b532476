"""Expert backends and the MoE layer's scatter-gather over them.

An `ExpertBackend` computes expert FFNs for one layer on groups of token rows. The colocated
backend runs them in-process; remote backends send them to expert services. At every MoE layer
the dispatcher routes the tokens, picks one replica per expert (colocated first, then the least
outstanding calls, with replicas outside the router's region counted as `region_penalty` calls
busier), sends each backend all its groups in one call with every backend in flight at
once, fails groups over to other replicas when a backend is unavailable, and combines the results.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from opentelemetry import trace
from opentelemetry.metrics import Observation

from common.arch import ModelSpec
from common.errors import DeadlineExceededError, ExpertUnavailableError, UnavailableError
from common.moe import ExpertGroup, combine, expert_ffn, group_by_expert, route, shared_expert_output
from common.telemetry import DISPATCH_DURATION, FAILOVERS, OFF, TOKENS_ROUTED, Telemetry
from common.weights import FFNWeights, LayerWeights
from router_service.utilization import UtilizationWindow


class ExpertBackend(Protocol):
    """Computes expert FFNs. `groups` is [(expert, rows [n, hidden])]; returns outputs in the same order.

    Raises UnavailableError when the backend cannot be reached (the dispatcher then tries another
    replica) and DeadlineExceededError when `timeout_s` runs out.
    """

    local: bool  # True: in this process, no network hop
    outstanding: int  # calls in flight, for load balancing
    region: str  # where it runs ("" unknown); routers prefer their own region

    async def forward(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]],
                      timeout_s: float | None = None) -> list[torch.Tensor]: ...


class ColocatedExperts:
    """Experts held in this process: no network hop."""

    local = True
    outstanding = 0
    region = ""

    def __init__(self, weights: Mapping[tuple[int, int], FFNWeights]) -> None:
        self.weights = dict(weights)

    def __repr__(self) -> str:
        return f"ColocatedExperts({len(self.weights)} experts)"

    async def forward(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]],
                      timeout_s: float | None = None) -> list[torch.Tensor]:
        return [expert_ffn(rows, self.weights[(layer, expert)]) for expert, rows in groups]


Placement = Mapping[tuple[int, int], Sequence[ExpertBackend]]


class ExpertDispatcher:
    """The MoE block of every layer: route, scatter to backends by placement, gather, combine."""

    def __init__(self, spec: ModelSpec, placement: Placement, default_timeout_s: float = 30.0,
                 region: str = "", region_penalty: float = 8.0, window: UtilizationWindow | None = None,
                 telemetry: Telemetry = OFF) -> None:
        self.spec = spec
        self.placement = {pair: list(replicas) for pair, replicas in placement.items()}
        self.default_timeout_s = default_timeout_s
        self.region, self.region_penalty = region, region_penalty
        self.window = window or UtilizationWindow(spec.num_layers, spec.num_experts)
        self.tokens_routed = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64)
        self.tokens_colocated = 0  # routed (token, expert) assignments computed in this process
        self.remote_calls = 0
        self.failovers = 0
        self._turn = itertools.count()  # rotates ties between equally loaded replicas
        self.tracer = telemetry.tracer
        self._dispatch_s = telemetry.latency(DISPATCH_DURATION, "one expert backend call of one MoE layer")
        telemetry.meter.create_observable_counter(
            TOKENS_ROUTED, [self._observe_routed], description="(token, expert) assignments by layer and expert")
        telemetry.meter.create_observable_counter(
            FAILOVERS, [lambda _: [Observation(self.failovers)]], description="expert calls retried on another replica")

    def _observe_routed(self, _options) -> list[Observation]:
        counts = self.tokens_routed.tolist()
        return [Observation(n, {"moe.layer": layer, "moe.expert": e})
                for layer, row in enumerate(counts) for e, n in enumerate(row) if n]

    async def moe(self, layer: int, x: torch.Tensor, w: LayerWeights, deadline: float | None = None) -> torch.Tensor:
        """x: [tokens, hidden] (already normed) -> routed (+ shared) expert output [tokens, hidden]."""
        routing = route(x, w.router, self.spec)
        groups = group_by_expert(routing, self.spec.num_experts)
        counts = torch.bincount(routing.experts.reshape(-1), minlength=self.spec.num_experts)
        self.tokens_routed[layer] += counts
        self.window.add(layer, counts)
        if self.tracer is not None and trace.get_current_span().is_recording():
            attributes = {"moe.layer": layer, "moe.tokens": x.shape[0], "moe.experts": [g.expert for g in groups],
                          "moe.expert_tokens": [len(g.tokens) for g in groups]}
            with self.tracer.start_as_current_span("moe.dispatch", attributes=attributes):
                outputs = await self._scatter_gather(layer, x, groups, deadline)
        else:
            outputs = await self._scatter_gather(layer, x, groups, deadline)
        y = combine(groups, outputs, routing, x.shape[0], like=x)
        if w.shared_expert is not None:
            y = y + shared_expert_output(x, w.shared_expert, w.shared_expert_gate)
        return y

    async def _scatter_gather(self, layer: int, x: torch.Tensor, groups: list[ExpertGroup],
                              deadline: float | None) -> list[torch.Tensor]:
        outputs: list[torch.Tensor | None] = [None] * len(groups)
        excluded: dict[int, set[int]] = {}  # group index -> ids of backends that failed it
        errors: dict[int, Exception] = {}  # group index -> its latest failure
        pending = list(range(len(groups)))
        while pending:
            plan = self._assign(layer, groups, pending, excluded, errors)
            timeout = self._timeout(deadline)
            # Remote calls first: they are on the wire while colocated experts compute.
            order = sorted(plan.values(), key=lambda p: p[0].local)
            results = await asyncio.gather(
                *(self._call(b, layer, [(groups[i].expert, x[groups[i].tokens]) for i in idx], timeout)
                  for b, idx in order), return_exceptions=True)
            pending = []
            for (backend, idx), result in zip(order, results):
                if not backend.local:
                    self.remote_calls += 1
                if isinstance(result, UnavailableError):
                    self.failovers += 1
                    for i in idx:
                        excluded.setdefault(i, set()).add(id(backend))
                        errors[i] = result
                    pending += idx
                elif isinstance(result, BaseException):
                    raise result
                else:
                    for i, y in zip(idx, result):
                        outputs[i] = y
                    if backend.local:
                        self.tokens_colocated += sum(len(groups[i].tokens) for i in idx)
        return outputs  # type: ignore[return-value]

    async def _call(self, backend: ExpertBackend, layer: int, groups: list[tuple[int, torch.Tensor]],
                    timeout: float) -> list[torch.Tensor]:
        """One backend call, timed per transport and, in a traced request, spanned with what it carried."""
        transport = "colocated" if backend.local else "grpc"
        start = time.perf_counter()
        try:
            if self.tracer is None or not trace.get_current_span().is_recording():
                return await backend.forward(layer, groups, timeout)
            attributes = {"moe.layer": layer, "moe.transport": transport,
                          "moe.replica": getattr(backend, "address", "colocated"), "moe.region": backend.region,
                          "moe.experts": [e for e, _ in groups], "moe.expert_tokens": [r.shape[0] for _, r in groups],
                          "moe.bytes": sum(r.numel() * r.element_size() for _, r in groups)}
            with self.tracer.start_as_current_span("moe.expert_call", attributes=attributes):
                return await backend.forward(layer, groups, timeout)
        finally:
            self._dispatch_s.record(time.perf_counter() - start, {"moe.transport": transport})

    def _assign(self, layer: int, groups: list[ExpertGroup], pending: list[int], excluded: dict[int, set[int]],
                errors: dict[int, Exception]) -> dict[int, tuple[ExpertBackend, list[int]]]:
        plan: dict[int, tuple[ExpertBackend, list[int]]] = {}
        unreachable: list[int] = []
        turn = next(self._turn)
        for i in pending:
            replicas = [b for b in self.placement.get((layer, groups[i].expert), ())
                        if id(b) not in excluded.get(i, ())]
            if not replicas:
                unreachable.append(i)
                continue
            n = len(replicas)
            best = min(range(n), key=lambda r: (not replicas[r].local, self._cost(replicas[r]), (r - turn) % n))
            plan.setdefault(id(replicas[best]), (replicas[best], []))[1].append(i)
        if unreachable:
            causes = dict.fromkeys(str(errors[i]) if i in errors else "no replica placed" for i in unreachable)
            raise ExpertUnavailableError(layer, [groups[i].expert for i in unreachable], "; ".join(causes))
        return plan

    def _cost(self, backend: ExpertBackend) -> float:
        away = bool(self.region) and backend.region != self.region
        return backend.outstanding + (self.region_penalty if away else 0.0)

    def _timeout(self, deadline: float | None) -> float:
        if deadline is None:
            return self.default_timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError("the request deadline passed during expert dispatch")
        return min(remaining, self.default_timeout_s)


class LivePlacement:
    """The dispatcher's placement table, rebuilt whenever one of its two sources changes: the experts
    colocated in this process (pins and tiering) and the remote replicas (static or from the registry).

    Each change publishes a new table in one assignment, so a layer call reads a consistent table,
    and a replaced ColocatedExperts stays alive (its weights too) only while a call still holds it.
    """

    def __init__(self, dispatcher: ExpertDispatcher, colocated: ColocatedExperts | None = None) -> None:
        self.dispatcher = dispatcher
        self.colocated = colocated or ColocatedExperts({})
        self.remote: dict[tuple[int, int], list[ExpertBackend]] = {}
        self._publish()

    def set_remote(self, remote: Mapping[tuple[int, int], Sequence[ExpertBackend]]) -> None:
        self.remote = {pair: list(replicas) for pair, replicas in remote.items() if replicas}
        self._publish()

    def set_colocated(self, colocated: ColocatedExperts) -> None:
        self.colocated = colocated
        self._publish()

    def _publish(self) -> None:
        table: dict[tuple[int, int], list[ExpertBackend]] = {pair: [self.colocated] for pair in self.colocated.weights}
        for pair, replicas in self.remote.items():
            table.setdefault(pair, []).extend(replicas)
        self.dispatcher.placement = table
