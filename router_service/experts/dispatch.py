"""Expert backends and the MoE layer's scatter-gather over them.

An `ExpertBackend` computes expert FFNs for one layer on groups of token rows. The colocated
backend runs them in-process; remote backends send them to expert services. At every MoE layer
the dispatcher routes the tokens, picks one replica per expert (colocated first, then the least
outstanding calls, with replicas outside the router's region counted as `region_penalty` calls
busier), sends each backend all its groups in one call with every backend in flight at
once, fails groups over to other replicas when a backend is unavailable, and combines the results.

A hung or dying replica must not stall the batch (DispatchPolicy): each remote call has a timeout
learned from its replica's latency; a call not answered by a latency quantile is hedged to another
replica serving the same experts, and the first answer wins (expert math is deterministic, so the
output does not change); a replica that fails, times out or loses a hedge race is ejected for a
while (Envoy-style outlier ejection), and checked meanwhile so that it is back as soon as it
answers again (common/probing.py); failovers and hedges draw on a retry budget.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from opentelemetry import trace
from opentelemetry.metrics import Observation

from common.arch import ModelSpec
from common.errors import DeadlineExceededError, ExpertUnavailableError, UnavailableError
from common.moe import (
    ExpertGroup,
    Routing,
    combine,
    expert_ffn,
    gather_rows,
    group_by_expert,
    route,
    shared_expert_output,
)
from common.probing import Prober
from common.resilience import (
    EjectionPolicy,
    EndpointHealth,
    RetryBudget,
    SizedLatency,
    call_size,
)
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
from common.weights import FFNWeights, LayerWeights
from router_service.experts.utilization import UtilizationWindow


class ExpertBackend(Protocol):
    """Computes expert FFNs. `groups` is [(expert, rows [n, hidden])]; returns outputs in the same order.

    Raises UnavailableError when the backend cannot be reached (the dispatcher then tries another
    replica) and DeadlineExceededError when `timeout_s` runs out. A local backend also offers
    `compute(layer, groups)`, the same without awaiting, which the dispatcher runs on the
    router's compute thread. A remote one may offer `check(timeout_s)`, a cheap call that raises
    unless the service is up and serves this router's model: while the backend is ejected the
    dispatcher calls it, and re-admits the backend once it passes.
    """

    local: bool  # True: in this process, no network hop
    outstanding: int  # calls in flight, for load balancing
    region: str  # where it runs ("" unknown); routers prefer their own region

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> list[torch.Tensor]: ...


class ColocatedExperts:
    """Experts held in this process: no network hop."""

    local = True
    outstanding = 0
    region = ""

    def __init__(self, weights: Mapping[tuple[int, int], FFNWeights]) -> None:
        self.weights = dict(weights)

    def __repr__(self) -> str:
        return f"ColocatedExperts({len(self.weights)} experts)"

    def compute(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        return [expert_ffn(rows, self.weights[(layer, expert)]) for expert, rows in groups]

    async def forward(
        self, layer: int, groups: Sequence[tuple[int, torch.Tensor]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        return self.compute(layer, groups)


Placement = Mapping[tuple[int, int], Sequence[ExpertBackend]]
# Runs torch work where the router computes: its compute thread, or inline (the default).
Compute = Callable[..., Awaitable[Any]]


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass
class Routed:
    """One MoE layer's routing of a micro-batch, between gating and combining."""

    layer: int
    routing: Routing
    groups: list[ExpertGroup]


@dataclass
class CallTimes:
    """What one layer's remote calls cost, for the micro-batch planner (seconds)."""

    wall: float = 0.0  # first call out to last answer in
    service: float = 0.0  # the slowest answering service's own time (queue + compute)


@dataclass(frozen=True)
class DispatchPolicy:
    """How the dispatcher treats slow and failing replicas (RouterSettings documents each field)."""

    call_timeout_factor: float = 8.0
    call_timeout_min_s: float = 1.0
    hedge_quantile: float = 0.95
    hedge_min_delay_s: float = 0.05
    hedge_initial_delay_s: float = 0.25  # before a replica has min_samples latencies
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    retry_budget_ratio: float = 0.2
    probe_interval_s: float = 0.5  # checks of an ejected replica; 0: none


@dataclass
class _Call:
    transport: str


class ReplicaTimeout(UnavailableError):
    """A replica did not answer within its learned per-call timeout, before the request's deadline."""


class _Replica:
    """What the dispatcher learns about one backend: its health and its recent latencies."""

    def __init__(self, policy: EjectionPolicy) -> None:
        self.health = EndpointHealth(policy)
        self.latency = SizedLatency()


class ExpertDispatcher:
    """The MoE block of every layer: route, scatter to backends by placement, gather, combine."""

    def __init__(
        self,
        spec: ModelSpec,
        placement: Placement,
        default_timeout_s: float = 30.0,
        region: str = "",
        region_penalty: float = 8.0,
        window: UtilizationWindow | None = None,
        telemetry: Telemetry = OFF,
        policy: DispatchPolicy = DispatchPolicy(),
        compute: Compute = inline,
    ) -> None:
        self.spec = spec
        self.compute = compute  # where colocated experts run while remote calls are out
        self.prober = Prober(policy.probe_interval_s, "expert replica")
        self.set_placement(placement)
        self.default_timeout_s = default_timeout_s
        self.region, self.region_penalty = region, region_penalty
        self.window = window or UtilizationWindow(spec.num_layers, spec.num_experts)
        # [layer][expert]: Python ints, bumped once per MoE layer call (see UtilizationWindow)
        self.tokens_routed = [[0] * spec.num_experts for _ in range(spec.num_layers)]
        self.tokens_colocated = 0  # routed (token, expert) assignments computed in this process
        self.remote_calls = 0
        self.failovers = 0
        self.hedges = 0  # calls also sent to a second replica
        self.hedges_won = 0  # ... where the second replica answered first
        self.ejections = 0
        # Counters are bumped from the event loop and from the compute thread.
        self._stats_lock = threading.Lock()
        self.policy = policy
        self.budget = RetryBudget(ratio=policy.retry_budget_ratio)
        # Backends come and go with membership: what is learned about one lives as long as it does.
        self._replicas: weakref.WeakKeyDictionary[ExpertBackend, _Replica] = (
            weakref.WeakKeyDictionary()
        )
        self._turn = itertools.count()  # rotates ties between equally loaded replicas
        self.tracer = telemetry.tracer
        self._dispatch_s = telemetry.latency(
            DISPATCH_DURATION, "one expert backend call of one MoE layer"
        )
        telemetry.meter.create_observable_counter(
            TOKENS_ROUTED,
            [self._observe_routed],
            description="(token, expert) assignments by layer and expert",
        )
        telemetry.meter.create_observable_counter(
            FAILOVERS,
            [lambda _: [Observation(self.failovers)]],
            description="expert calls retried on another replica",
        )
        telemetry.meter.create_observable_counter(
            HEDGES,
            [
                lambda _: [
                    Observation(self.hedges_won, {"moe.outcome": "won"}),
                    Observation(self.hedges - self.hedges_won, {"moe.outcome": "lost"}),
                ]
            ],
            description="expert calls also sent to a second replica; won: the second answered first",
        )
        telemetry.meter.create_observable_counter(
            EJECTIONS,
            [lambda _: [Observation(self.ejections)]],
            description="expert replicas ejected for a while",
        )
        telemetry.meter.create_observable_counter(
            EJECTION_CHECKS,
            [
                lambda _: [
                    Observation(self.prober.readmitted, {"moe.outcome": "readmitted"}),
                    Observation(
                        self.prober.passed - self.prober.readmitted, {"moe.outcome": "passed"}
                    ),
                    Observation(self.prober.failed, {"moe.outcome": "failed"}),
                ]
            ],
            description="health checks of ejected expert replicas; readmitted: the check ended "
            "the ejection, passed: it passed but the replica was ejected for being slow",
        )

    def set_placement(self, placement: Placement) -> None:
        """Swap in a new placement table (one assignment: a layer call in flight keeps the old one)."""
        self.placement = {pair: list(replicas) for pair, replicas in placement.items()}
        # Whether some expert is served only remotely, so a step may wait on the network.
        self.remote = any(not r[0].local for r in self.placement.values() if r)
        if self.prober.checking:  # a replica that left is not checked any more
            self.prober.retain(b for replicas in self.placement.values() for b in replicas)

    async def close(self) -> None:
        """Stop checking ejected replicas (before their channels close)."""
        await self.prober.close()

    def routed_counts(self) -> list[list[int]]:
        """Tokens routed per [layer][expert] since start (the compute thread adds to them)."""
        with self._stats_lock:
            return [list(row) for row in self.tokens_routed]

    def _observe_routed(self, _options) -> list[Observation]:
        counts = self.routed_counts()
        return [
            Observation(n, {"moe.layer": layer, "moe.expert": e})
            for layer, row in enumerate(counts)
            for e, n in enumerate(row)
            if n
        ]

    async def moe(
        self, layer: int, x: torch.Tensor, w: LayerWeights, deadline: float | None = None
    ) -> torch.Tensor:
        """x: [tokens, hidden] (already normed) -> routed (+ shared) expert output [tokens, hidden]."""
        routed = self.route(layer, x, w)
        outputs = self.colocated_outputs(routed, x, deadline)
        if outputs is None:
            outputs = await self.gather(routed, x, deadline)
        return self.finish(routed, outputs, x, w)

    # The steps of `moe`, so the model can run the synchronous ones on its compute thread.

    def route(self, layer: int, x: torch.Tensor, w: LayerWeights) -> Routed:
        """Gate and group a layer's tokens by expert, and count them."""
        routing = route(x, w.router, self.spec, w.router_bias, w.router_correction)
        groups = group_by_expert(routing, self.spec.num_experts)
        routed = [(g.expert, g.size) for g in groups]
        with self._stats_lock:
            row = self.tokens_routed[layer]
            for expert, n in routed:
                row[expert] += n
            self.window.add(layer, routed)
        return Routed(layer, routing, groups)

    def colocated_outputs(
        self, routed: Routed, x: torch.Tensor, deadline: float | None = None
    ) -> list[torch.Tensor] | None:
        """The layer's expert outputs computed here and now when one colocated backend serves
        every group (no network, nothing to await); None when some group needs a remote call.

        Such a layer makes no remote call, so it draws nothing on the retry budget either."""
        placement, layer = self.placement, routed.layer  # one table for the whole layer
        local = None
        for g in routed.groups:
            replicas = placement.get((layer, g.expert)) or (None,)
            if not getattr(replicas[0], "local", False) or local not in (None, replicas[0]):
                return None
            local = replicas[0]
        if local is None:
            return []
        self._check_deadline(deadline)
        groups = list(zip((g.expert for g in routed.groups), gather_rows(x, routed.groups)))
        with self._dispatch_span(routed, x), self._observed(local, layer, groups):
            outputs = local.compute(layer, groups)
        with self._stats_lock:
            self.tokens_colocated += sum(g.size for g in routed.groups)
        return outputs

    async def gather(
        self,
        routed: Routed,
        x: torch.Tensor,
        deadline: float | None,
        times: CallTimes | None = None,
    ) -> list[torch.Tensor]:
        """Scatter the layer's groups to their backends and gather the outputs, in group order."""
        with self._dispatch_span(routed, x):
            return await self._scatter_gather(routed.layer, x, routed.groups, deadline, times)

    def finish(
        self, routed: Routed, outputs: list[torch.Tensor], x: torch.Tensor, w: LayerWeights
    ) -> torch.Tensor:
        """Combine expert outputs by their routing weights (+ the shared expert)."""
        y = combine(routed.groups, outputs, routed.routing, x.shape[0], like=x)
        if w.shared_expert is not None:
            y = y + shared_expert_output(x, w.shared_expert, w.shared_expert_gate)
        return y

    @contextmanager
    def _dispatch_span(self, routed: Routed, x: torch.Tensor) -> Iterator[None]:
        if self.tracer is None or not trace.get_current_span().is_recording():
            yield
            return
        attributes = {
            "moe.layer": routed.layer,
            "moe.tokens": x.shape[0],
            "moe.experts": [g.expert for g in routed.groups],
            "moe.expert_tokens": [g.size for g in routed.groups],
        }
        with self.tracer.start_as_current_span("moe.dispatch", attributes=attributes):
            yield

    async def _scatter_gather(
        self,
        layer: int,
        x: torch.Tensor,
        groups: list[ExpertGroup],
        deadline: float | None,
        times: CallTimes | None,
    ) -> list[torch.Tensor]:
        outputs: list[torch.Tensor | None] = [None] * len(groups)
        excluded: dict[int, set[int]] = {}  # group index -> ids of backends that failed it
        errors: dict[int, Exception] = {}  # group index -> its latest failure
        pending = list(range(len(groups)))
        rows = gather_rows(x, groups)
        self.budget.request()
        start = time.perf_counter()
        while pending:
            plan = self._assign(layer, groups, pending, excluded, errors)
            self._check_deadline(deadline)
            # Remote calls first: they are on the wire while colocated experts compute.
            order = sorted(plan.values(), key=lambda p: p[0].local)
            results = await asyncio.gather(
                *(
                    self._hedged(
                        b,
                        layer,
                        [(groups[i].expert, rows[i]) for i in idx],
                        idx,
                        excluded,
                        deadline,
                    )
                    for b, idx in order
                ),
                return_exceptions=True,
            )
            pending = []
            for (backend, idx), result in zip(order, results):
                if not backend.local:
                    self.remote_calls += 1
                    if times is not None and not isinstance(result, BaseException):
                        times.service = max(times.service, getattr(result, "service_s", 0.0))
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
                        with self._stats_lock:
                            self.tokens_colocated += sum(groups[i].size for i in idx)
            if pending and not self.budget.try_retry():  # a sick mesh: do not multiply its load
                causes = dict.fromkeys(str(errors[i]) for i in pending)
                raise ExpertUnavailableError(
                    layer,
                    [groups[i].expert for i in pending],
                    "retry budget exhausted; " + "; ".join(causes),
                )
        if times is not None:
            times.wall = time.perf_counter() - start
        return outputs  # type: ignore[return-value]

    async def _hedged(
        self,
        backend: ExpertBackend,
        layer: int,
        groups: list[tuple[int, torch.Tensor]],
        idx: list[int],
        excluded: dict[int, set[int]],
        deadline: float | None,
    ) -> list[torch.Tensor]:
        """`backend`'s answer, or a second replica's if `backend` has not answered by its hedge delay.

        `groups` are (expert, rows) of the layer's group indices `idx`."""
        if backend.local:  # no network to hang on: no task, no hedge
            return await self._call(backend, layer, groups, deadline)
        first = asyncio.ensure_future(self._call(backend, layer, groups, deadline))
        tasks = {first}
        try:
            delay = self._hedge_delay(backend, _rows(groups))
            while True:
                done, _ = await asyncio.wait(tasks, timeout=delay)
                if done:
                    return first.result()
                other = self._alternate(layer, [e for e, _ in groups], backend, excluded, idx)
                if other is None:
                    return await first
                # Only to a replica less busy than this one (this call included), as soon as there
                # is one: one as busy would answer no sooner, and the duplicate would slow both.
                if other.outstanding < backend.outstanding:
                    break
                delay = max(self.policy.hedge_min_delay_s, 0.01)
            if not self.budget.try_retry():
                return await first
            self.hedges += 1
            second = asyncio.ensure_future(self._call(other, layer, groups, deadline))
            tasks.add(second)
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        if task is second:
                            self.hedges_won += 1
                            # Slow past its hedge delay and beaten: skip it for a while.
                            self._failed(
                                backend, f"lost a hedge race to {_name(other)}", down=False
                            )
                        return task.result()
            raise first.exception()  # both failed: the first replica's error goes to failover
        finally:
            for task in tasks:
                task.cancel()

    def _alternate(
        self,
        layer: int,
        experts: list[int],
        backend: ExpertBackend,
        excluded: dict[int, set[int]],
        idx: list[int],
    ) -> ExpertBackend | None:
        """A healthy remote replica, other than `backend`, serving every one of `experts` at `layer`."""
        common: set[int] | None = None
        by_id: dict[int, ExpertBackend] = {}
        for expert, i in zip(experts, idx):
            ids = set()
            for b in self.placement.get((layer, expert), ()):
                if (
                    b is not backend
                    and not b.local
                    and id(b) not in excluded.get(i, ())
                    and not self._replica(b).health.ejected
                ):
                    ids.add(id(b))
                    by_id[id(b)] = b
            common = ids if common is None else common & ids
        if not common:
            return None
        return min((by_id[i] for i in common), key=self._cost)

    def _replica(self, backend: ExpertBackend) -> _Replica:
        r = self._replicas.get(backend)
        if r is None:
            r = self._replicas[backend] = _Replica(self.policy.ejection)
        return r

    def _failed(self, backend: ExpertBackend, cause: object, down: bool) -> None:
        """Count a failed call of `backend`; `down`: it could not be reached (not merely slow)."""
        health = self._replica(backend).health
        if health.failure():
            self.ejections += 1
            check = getattr(backend, "check", None)
            self.prober.ejected(backend, _name(backend), health, check, cause, down)

    def _hedge_delay(self, backend: ExpertBackend, rows: int) -> float:
        q = self._replica(backend).latency.quantile(self.policy.hedge_quantile, rows)
        q = q if q is not None else self.policy.hedge_initial_delay_s * call_size(rows)
        return max(self.policy.hedge_min_delay_s, q)

    def _call_timeout(self, backend: ExpertBackend, deadline: float | None, rows: int) -> float:
        """min(the request's remaining time, a multiple of the replica's p99 latency for a call of
        `rows` rows once known)."""
        limit = self.default_timeout_s
        if not backend.local:
            p99 = self._replica(backend).latency.quantile(0.99, rows)
            if p99 is not None:
                limit = min(
                    limit,
                    max(self.policy.call_timeout_min_s, p99 * self.policy.call_timeout_factor),
                )
        if deadline is None:
            return limit
        return min(limit, self._check_deadline(deadline))

    def _check_deadline(self, deadline: float | None) -> float:
        """Seconds left until `deadline` (inf without one); DeadlineExceededError once it passed."""
        if deadline is None:
            return float("inf")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError("the request deadline passed during expert dispatch")
        return remaining

    async def _call(
        self,
        backend: ExpertBackend,
        layer: int,
        groups: list[tuple[int, torch.Tensor]],
        deadline: float | None,
    ) -> list[torch.Tensor]:
        """One backend call with its per-call timeout; its outcome feeds the replica's health and latency."""
        rows = _rows(groups)
        timeout = self._call_timeout(backend, deadline, rows)
        start = time.perf_counter()
        try:
            result = await self._traced_call(backend, layer, groups, timeout)
        except DeadlineExceededError as e:
            if deadline is not None and time.monotonic() >= deadline:
                raise  # the request's own deadline: nothing to retry
            timed_out = ReplicaTimeout(f"{_name(backend)} did not answer within {timeout:.3g}s")
            self._failed(backend, timed_out, down=False)
            raise timed_out from e
        except UnavailableError as e:
            self._failed(backend, e, down=True)
            raise
        if not backend.local:
            replica = self._replica(backend)
            replica.health.success()
            replica.latency.add(time.perf_counter() - start, rows)
        return result

    async def _traced_call(
        self,
        backend: ExpertBackend,
        layer: int,
        groups: list[tuple[int, torch.Tensor]],
        timeout: float,
    ) -> list[torch.Tensor]:
        with self._observed(backend, layer, groups) as call:
            if backend.local:
                return await self.compute(backend.compute, layer, groups)  # type: ignore[attr-defined]
            result = await backend.forward(layer, groups, timeout)
            call.transport = getattr(result, "transport", call.transport)
            return result

    @contextmanager
    def _observed(
        self, backend: ExpertBackend, layer: int, groups: list[tuple[int, torch.Tensor]]
    ) -> Iterator[_Call]:
        """Time one backend call per transport and, in a traced request, span it with what it carried.

        A remote call's transport is known once it returns: its result says whether UCX or gRPC
        carried it (`ExpertOutputs.transport`); the caller sets it on the yielded record."""
        call = _Call("colocated" if backend.local else "grpc")
        start = time.perf_counter()
        try:
            if self.tracer is None or not trace.get_current_span().is_recording():
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
            self._dispatch_s.record(time.perf_counter() - start, {"moe.transport": call.transport})

    def _assign(
        self,
        layer: int,
        groups: list[ExpertGroup],
        pending: list[int],
        excluded: dict[int, set[int]],
        errors: dict[int, Exception],
    ) -> dict[int, tuple[ExpertBackend, list[int]]]:
        plan: dict[int, tuple[ExpertBackend, list[int]]] = {}
        unreachable: list[int] = []
        turn = next(self._turn)
        for i in pending:
            replicas = [
                b
                for b in self.placement.get((layer, groups[i].expert), ())
                if id(b) not in excluded.get(i, ())
            ]
            # Ejected replicas sit out, unless every replica is (panic mode: try them all rather than none).
            replicas = [
                b for b in replicas if b.local or not self._replica(b).health.ejected
            ] or replicas
            if not replicas:
                unreachable.append(i)
                continue
            n = len(replicas)
            best = min(
                range(n),
                key=lambda r: (not replicas[r].local, self._cost(replicas[r]), (r - turn) % n),
            )
            plan.setdefault(id(replicas[best]), (replicas[best], []))[1].append(i)
        if unreachable:
            causes = dict.fromkeys(
                str(errors[i]) if i in errors else "no replica placed" for i in unreachable
            )
            raise ExpertUnavailableError(
                layer, [groups[i].expert for i in unreachable], "; ".join(causes)
            )
        return plan

    def _cost(self, backend: ExpertBackend) -> float:
        away = bool(self.region) and backend.region != self.region
        return backend.outstanding + (self.region_penalty if away else 0.0)


def _name(backend: ExpertBackend) -> str:
    return getattr(backend, "address", repr(backend))


def _rows(groups: Sequence[tuple[int, torch.Tensor]]) -> int:
    return sum(rows.shape[0] for _, rows in groups)


class LivePlacement:
    """The dispatcher's placement table, rebuilt whenever one of its two sources changes: the experts
    colocated in this process (pins and tiering) and the remote replicas (static or from the registry).

    Each change publishes a new table in one assignment, so a layer call reads a consistent table,
    and a replaced ColocatedExperts stays alive (its weights too) only while a call still holds it.
    """

    def __init__(
        self, dispatcher: ExpertDispatcher, colocated: ColocatedExperts | None = None
    ) -> None:
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
        table: dict[tuple[int, int], list[ExpertBackend]] = {
            pair: [self.colocated] for pair in self.colocated.weights
        }
        for pair, replicas in self.remote.items():
            table.setdefault(pair, []).extend(replicas)
        self.table = table
        self.dispatcher.set_placement(table)

    def missing(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The pairs of `pairs` that no backend serves."""
        return [p for p in pairs if not self.table.get(p)]
