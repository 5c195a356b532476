"""Which replica computes each expert group of a MoE layer, and how a layer survives slow and
failing replicas.

Colocated first, then the least outstanding calls, with replicas outside the router's region
counted as `region_penalty` calls busier; each backend gets all its groups in one call, every
backend in flight at once. A hung or dying replica must not stall the batch (DispatchPolicy):
each remote call has a timeout learned from its replica's latency; a call not answered by a
latency quantile is hedged to another replica serving the same experts, and the first answer
wins (expert math is deterministic, so the output does not change); a replica that fails, times
out or loses a hedge race is ejected for a while (Envoy-style outlier ejection), and checked
meanwhile so that it is back as soon as it answers again (common/probing.py); an unavailable
replica's groups fail over to another; failovers and hedges draw on a retry budget. An expert
that no replica serves at all (its group scaled to 0) is waited for, up to missing_expert_wait_s,
instead of failed at once. Ejections, the budget, latencies and deadlines read one injected clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.errors import DeadlineExceededError, ExpertUnavailableError, UnavailableError
from common.probing import Prober
from common.resilience import (
    Clock,
    EjectionPolicy,
    EndpointHealth,
    RetryBudget,
    SizedLatency,
    call_size,
)
from router_service.engine.pipeline import CallTimes, Compute, inline
from router_service.experts.backends import ExpertBackend, Placement, backend_name
from router_service.experts.metrics import DispatchTelemetry

log = logging.getLogger(__name__)
Groups = list[tuple[int, torch.Tensor]]  # [(expert, rows [n, hidden])]


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
    # How long a call waits for an expert that no replica serves at all to get one (a group scaled
    # to 0 and back, a replica restarting) before it fails; 0: it fails at once.
    missing_expert_wait_s: float = 0.0


class ReplicaTimeout(UnavailableError):
    """A replica did not answer within its learned per-call timeout, before the request's deadline."""


class Replica:
    """What is learned about one backend: its health and its recent latencies."""

    def __init__(self, policy: EjectionPolicy, clock: Clock) -> None:
        self.health = EndpointHealth(policy, clock)
        self.latency = SizedLatency()


class Replicas:
    """The replicas of every expert as the placement table lists them, and what each has shown."""

    def __init__(
        self,
        policy: DispatchPolicy = DispatchPolicy(),
        default_timeout_s: float = 30.0,
        region: str = "",
        region_penalty: float = 8.0,
        compute: Compute = inline,
        telemetry: DispatchTelemetry | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.policy, self.default_timeout_s, self.clock = policy, default_timeout_s, clock
        self.region, self.region_penalty = region, region_penalty
        self.compute = compute  # where colocated groups run while remote calls are out
        self.telemetry = telemetry or DispatchTelemetry()
        self.prober = Prober(policy.probe_interval_s, "expert replica")
        self.budget = RetryBudget(ratio=policy.retry_budget_ratio, clock=clock)
        self.placement: dict[tuple[int, int], list[ExpertBackend]] = {}
        self.tokens_colocated = 0  # routed (token, expert) assignments computed in this process
        self.remote_calls = 0
        self.failovers = 0
        self.hedges = 0  # calls also sent to a second replica
        self.hedges_won = 0  # ... where the second replica answered first
        self.ejections = 0
        self.waiting_for_experts = 0  # calls now waiting in _until_placed
        self._lock = threading.Lock()  # tokens_colocated: bumped from the loop and compute thread
        # Backends come and go with membership: what is learned about one lives as long as it does.
        self._replicas: weakref.WeakKeyDictionary[ExpertBackend, Replica] = (
            weakref.WeakKeyDictionary()
        )
        self._turn = itertools.count()  # rotates ties between equally loaded replicas
        self._placed = asyncio.Event()  # set, and replaced, by each new placement table

    def set_placement(self, placement: Placement) -> None:
        """Swap in a new placement table (one assignment: a layer call in flight keeps the old one)."""
        self.placement = {pair: list(replicas) for pair, replicas in placement.items()}
        if self.prober.checking:  # a replica that left is not checked any more
            self.prober.retain(b for replicas in self.placement.values() for b in replicas)
        placed, self._placed = self._placed, asyncio.Event()
        placed.set()  # calls waiting for a missing expert look again

    def replica(self, backend: ExpertBackend) -> Replica:
        r = self._replicas.get(backend)
        if r is None:
            r = self._replicas[backend] = Replica(self.policy.ejection, self.clock)
        return r

    def colocated(
        self, layer: int, experts: Sequence[int], placement: Placement | None = None
    ) -> ExpertBackend | None:
        """The colocated backend that is the first choice for every one of `experts`, if one is:
        the layer then needs no network, nothing to await, and draws nothing on the retry budget.
        Asked of `placement` where given, else of the current table."""
        placement = self.placement if placement is None else placement  # one table for the layer
        local = None
        for expert in experts:
            first = (placement.get((layer, expert)) or (None,))[0]
            if not getattr(first, "local", False) or local not in (None, first):
                return None
            local = first
        return local

    def compute_here(
        self, backend: ExpertBackend, layer: int, groups: Groups
    ) -> list[torch.Tensor]:
        """`groups` computed now by the colocated `backend`, on the calling thread."""
        with self.telemetry.call(backend, layer, groups):
            outputs = backend.compute(layer, groups)  # type: ignore[attr-defined]
        with self._lock:
            self.tokens_colocated += _rows(groups)
        return outputs

    def computed_here(self, rows: int) -> None:
        """Count `rows` (token, expert) rows computed in this process outside compute_here (a
        decode step in one call: engine/fused.py)."""
        with self._lock:
            self.tokens_colocated += rows

    def check_deadline(self, deadline: float | None) -> float:
        """Seconds left until `deadline` (inf without one); DeadlineExceededError once it passed."""
        if deadline is None:
            return float("inf")
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise DeadlineExceededError("the request deadline passed during expert dispatch")
        return remaining

    async def forward(
        self, layer: int, groups: Groups, deadline: float | None, times: CallTimes | None = None
    ) -> list[torch.Tensor]:
        """The outputs of `groups`, in order, from their replicas; groups whose replica is
        unavailable fail over to another while the retry budget allows."""
        outputs: list[torch.Tensor | None] = [None] * len(groups)
        excluded: dict[int, set[int]] = {}  # group index -> ids of backends that failed it
        errors: dict[int, Exception] = {}  # group index -> its latest failure
        pending = list(range(len(groups)))
        self.budget.request()
        start = self.clock()
        while pending:
            await self._until_placed(layer, [groups[i][0] for i in pending], deadline)
            plan = self._assign(layer, [e for e, _ in groups], pending, excluded, errors)
            self.check_deadline(deadline)
            # Remote calls first: they are on the wire while colocated experts compute.
            order = sorted(plan.values(), key=lambda p: p[0].local)
            results = await asyncio.gather(
                *(
                    self._hedged(b, layer, [groups[i] for i in idx], idx, excluded, deadline)
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
                        with self._lock:
                            self.tokens_colocated += _rows([groups[i] for i in idx])
            if pending and not self.budget.try_retry():  # a sick mesh: do not multiply its load
                causes = dict.fromkeys(str(errors[i]) for i in pending)
                raise ExpertUnavailableError(
                    layer,
                    [groups[i][0] for i in pending],
                    "retry budget exhausted; " + "; ".join(causes),
                )
        if times is not None:
            times.wall = self.clock() - start
        return outputs  # type: ignore[return-value]

    async def _until_placed(self, layer: int, experts: list[int], deadline: float | None) -> None:
        """Wait while some of `experts` has no replica placed at all, for up to
        missing_expert_wait_s and within `deadline`; then _assign fails those still missing.

        A group scaled to 0 under a running stream: the stream pauses instead of failing, and
        resumes once a replica registers (the gateway reports not-ready meanwhile). An expert whose
        replicas are placed but failing does not wait here: it fails over, or fails, at once."""
        wait_s = self.policy.missing_expert_wait_s
        if not wait_s or all(self.placement.get((layer, e)) for e in experts):
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while missing := [e for e in experts if not self.placement.get((layer, e))]:
            left = min(give_up - loop.time(), self.check_deadline(deadline))
            if left <= 0:
                return
            if not self.waiting_for_experts:
                log.warning(
                    "layer %d expert(s) %s have no replica: waiting up to %gs for one",
                    layer,
                    ",".join(map(str, missing)),
                    wait_s,
                )
            self.waiting_for_experts += 1
            try:
                await asyncio.wait_for(self._placed.wait(), left)
            except TimeoutError:
                pass
            finally:
                self.waiting_for_experts -= 1

    def _assign(
        self,
        layer: int,
        experts: list[int],
        pending: list[int],
        excluded: dict[int, set[int]],
        errors: dict[int, Exception],
    ) -> dict[int, tuple[ExpertBackend, list[int]]]:
        """backend id -> (backend, indices of the pending groups it gets)."""
        plan: dict[int, tuple[ExpertBackend, list[int]]] = {}
        unreachable: list[int] = []
        turn = next(self._turn)
        for i in pending:
            replicas = [
                b
                for b in self.placement.get((layer, experts[i]), ())
                if id(b) not in excluded.get(i, ())
            ]
            # Ejected replicas sit out, unless every replica is (panic mode: try them all rather than none).
            replicas = [
                b for b in replicas if b.local or not self.replica(b).health.ejected
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
                layer, [experts[i] for i in unreachable], "; ".join(causes)
            )
        return plan

    async def _hedged(
        self,
        backend: ExpertBackend,
        layer: int,
        groups: Groups,
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
                                backend, f"lost a hedge race to {backend_name(other)}", down=False
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
                    and not self.replica(b).health.ejected
                ):
                    ids.add(id(b))
                    by_id[id(b)] = b
            common = ids if common is None else common & ids
        if not common:
            return None
        return min((by_id[i] for i in common), key=self._cost)

    def _failed(self, backend: ExpertBackend, cause: object, down: bool) -> None:
        """Count a failed call of `backend`; `down`: it could not be reached (not merely slow)."""
        health = self.replica(backend).health
        if health.failure():
            self.ejections += 1
            check = getattr(backend, "check", None)
            self.prober.ejected(backend, backend_name(backend), health, check, cause, down)

    def _hedge_delay(self, backend: ExpertBackend, rows: int) -> float:
        q = self.replica(backend).latency.quantile(self.policy.hedge_quantile, rows)
        q = q if q is not None else self.policy.hedge_initial_delay_s * call_size(rows)
        return max(self.policy.hedge_min_delay_s, q)

    def _call_timeout(self, backend: ExpertBackend, deadline: float | None, rows: int) -> float:
        """min(the request's remaining time, a multiple of the replica's p99 latency for a call of
        `rows` rows once known)."""
        limit = self.default_timeout_s
        if not backend.local:
            p99 = self.replica(backend).latency.quantile(0.99, rows)
            if p99 is not None:
                limit = min(
                    limit,
                    max(self.policy.call_timeout_min_s, p99 * self.policy.call_timeout_factor),
                )
        if deadline is None:
            return limit
        return min(limit, self.check_deadline(deadline))

    async def _call(
        self, backend: ExpertBackend, layer: int, groups: Groups, deadline: float | None
    ) -> list[torch.Tensor]:
        """One backend call with its per-call timeout; its outcome feeds the replica's health and latency."""
        rows = _rows(groups)
        timeout = self._call_timeout(backend, deadline, rows)
        start = self.clock()
        try:
            with self.telemetry.call(backend, layer, groups) as call:
                if backend.local:
                    return await self.compute(backend.compute, layer, groups)  # type: ignore[attr-defined]
                result = await backend.forward(layer, groups, timeout)
                call.transport = getattr(result, "transport", call.transport)
        except DeadlineExceededError as e:
            if deadline is not None and self.clock() >= deadline:
                raise  # the request's own deadline: nothing to retry
            timed_out = ReplicaTimeout(
                f"{backend_name(backend)} did not answer within {timeout:.3g}s"
            )
            self._failed(backend, timed_out, down=False)
            raise timed_out from e
        except UnavailableError as e:
            self._failed(backend, e, down=True)
            raise
        replica = self.replica(backend)
        replica.health.success()
        replica.latency.add(self.clock() - start, rows)
        return result

    def _cost(self, backend: ExpertBackend) -> float:
        away = bool(self.region) and backend.region != self.region
        return backend.outstanding + (self.region_penalty if away else 0.0)


def _rows(groups: Groups) -> int:
    return sum(rows.shape[0] for _, rows in groups)
