"""The router's serving loop, free of gRPC: one task steps the engine while requests stream out.

Each request gets a queue of StepOutputs; leaving `generate` early (client cancelled, deadline
passed) aborts the request, which frees its batch slot and KV cache at the next token boundary.

The loop is supervised: if it dies (a bug; the engine itself fails only the requests concerned), the
requests in flight fail with InternalError and the loop restarts. After `max_loop_deaths` deaths
within `loop_death_window_s` it stays down, new requests get UnavailableError, and `on_unhealthy`
is told so the process reports NOT_SERVING and balancers and registries drop it. A device error
(common.device.device_lost: a CUDA context an error left unusable) gives up at the first death.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Observation
from opentelemetry.trace import Span, StatusCode

from common.device import device_lost
from common.errors import InternalError, MoeMeshError, UnavailableError
from common.sampling import SamplingParams
from common.telemetry import (
    OFF,
    PREEMPTIONS,
    PREFIX_CACHE_HIT_TOKENS,
    PREFIX_CACHE_QUERY_TOKENS,
    ROUTER_BATCH_SIZE,
    ROUTER_KV_BLOCKS,
    ROUTER_QUEUE_DEPTH,
    Telemetry,
)
from router_service.engine.engine import Engine, FinishReason, StepOutput
from router_service.engine.pipeline import MicroBatchPlanner
from router_service.engine.scheduler import Scheduler
from router_service.experts.tiering import Tierer

log = logging.getLogger(__name__)

# Told why the serving loop gave up; the composition root turns it into health NOT_SERVING.
Unhealthy = Callable[[str], Awaitable[None]]


@dataclass
class RouterStatus:
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_experts: int
    moe_layers: list[int]
    running: int
    waiting: int
    steps: int
    tokens_routed: list[list[int]]  # [layers][experts]
    failovers: int
    placement: dict[str, list[tuple[int, int]]]  # "colocated" or address -> pairs it serves
    regions: dict[str, str]  # the same keys -> region
    precisions: dict[str, str]  # the same keys -> what the experts are held in ('' unknown)
    registry_stale: bool  # running on the last known membership: the registry is unreachable
    utilization: list[list[float]]  # [layers][experts] tokens routed in the window
    window_s: float
    region: str
    remote_calls: int
    tokens_colocated: int
    hedges: int
    ejections: int
    tiering: TieringStatus
    replicas: list[ReplicaStatus]  # one per backend of `placement`, in its key order
    pipeline: PipelineStatus
    kv: KvStatus


@dataclass
class ReplicaStatus:
    """How this router reaches one expert backend now (RouterStatus.replicas documents each field)."""

    backend: str  # "colocated" or the expert service's address
    transport: str  # "ucx" | "grpc" | "colocated": what the next call tries first
    fast_path: str  # the UCX link's URL, "" when gRPC only
    fast_path_calls: int
    fallbacks: dict[str, int]  # cause -> calls re-sent over gRPC

    @classmethod
    def of(cls, backend) -> ReplicaStatus:
        if backend.local:
            return cls("colocated", "colocated", "", 0, {})
        # Backends other than RemoteExperts (test doubles) have no fast path: plain gRPC.
        link = getattr(backend, "fast_path", None)
        return cls(
            backend.address,
            getattr(backend, "transport", "grpc"),
            link.url if link is not None else "",
            link.calls if link is not None else 0,
            dict(link.fallbacks) if link is not None else {},
        )


@dataclass
class PipelineStatus:
    """Micro-batching now (RouterStatus documents each field)."""

    setting: str
    micro_batches: int
    ta_ms: float
    te_ms: float
    tc_ms: float

    @classmethod
    def of(cls, planner: MicroBatchPlanner, setting: str) -> PipelineStatus:
        c = planner.estimate()
        return cls(setting, planner.last, c.ta * 1e3, c.te * 1e3, c.tc * 1e3)


@dataclass
class KvStatus:
    """The paged KV cache and its prefix cache (RouterStatus in router.proto documents each field)."""

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int

    @classmethod
    def of(cls, scheduler: Scheduler) -> KvStatus:
        pool = scheduler.pool
        return cls(
            scheduler.block_size,
            pool.num_blocks,
            pool.num_used,
            pool.num_cached,
            scheduler.prefix_query_tokens,
            scheduler.prefix_hit_tokens,
            scheduler.preemptions,
        )


@dataclass
class TieringStatus:
    expert_bytes: int
    colocated_bytes: int
    budget_bytes: int
    promotions: int
    demotions: int
    pinned_hot: list[tuple[int, int]]
    pinned_remote: list[tuple[int, int]]


class RouterCore:
    def __init__(
        self,
        engine: Engine,
        model_id: str,
        tierer: Tierer,
        membership=None,
        telemetry: Telemetry = OFF,
        *,
        on_unhealthy: Unhealthy | None = None,
        max_loop_deaths: int = 3,
        loop_death_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,  # what loop deaths are timed on
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.tierer = tierer
        self.membership = membership  # set when expert services come from a registry
        self.tracer = telemetry.tracer
        # request id -> its span's context, for traced requests only
        self._traced: dict[str, Context] = {}
        self._batch_size = telemetry.sizes(ROUTER_BATCH_SIZE, "sequences in one engine step")
        telemetry.meter.create_observable_gauge(
            ROUTER_QUEUE_DEPTH,
            [lambda _: [Observation(engine.num_waiting)]],
            description="sequences waiting for a batch slot",
        )
        self._observe_kv(telemetry, engine.scheduler)
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.on_unhealthy = on_unhealthy
        self.max_loop_deaths, self.loop_death_window_s = max_loop_deaths, loop_death_window_s
        self.clock = clock
        self.loop_deaths = 0
        self.down: str | None = None  # why the loop gave up, once it has

    @staticmethod
    def _observe_kv(telemetry: Telemetry, scheduler: Scheduler) -> None:
        """KV blocks by state and the prefix cache's counts, read at each scrape."""
        pool = scheduler.pool

        def blocks(_):
            used, cached = pool.num_used, pool.num_cached
            free = pool.num_blocks - used - cached
            return [
                Observation(n, {"moe.state": state})
                for state, n in (("used", used), ("cached", cached), ("free", free))
            ]

        telemetry.meter.create_observable_gauge(
            ROUTER_KV_BLOCKS,
            [blocks],
            description="KV-cache blocks by moe.state: used (by sequences), cached (a prefix "
            "nobody uses now, evicted on demand), free",
        )
        for name, read, description in (
            (
                PREFIX_CACHE_QUERY_TOKENS,
                lambda: scheduler.prefix_query_tokens,
                "tokens of admitted sequences (the prefix cache's lookups)",
            ),
            (
                PREFIX_CACHE_HIT_TOKENS,
                lambda: scheduler.prefix_hit_tokens,
                "tokens of admitted sequences found in the prefix cache",
            ),
            (PREEMPTIONS, lambda: scheduler.preemptions, "sequences preempted for KV blocks"),
        ):
            telemetry.meter.create_observable_counter(
                name, [lambda _, read=read: [Observation(read())]], description=description
            )

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="router-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> RouterStatus:
        d = self.engine.model.dispatcher
        placement: dict[str, list[tuple[int, int]]] = {}
        regions: dict[str, str] = {}
        precisions: dict[str, str] = {}
        backends: dict[str, object] = {}
        for pair, replicas in sorted(d.placement.items()):
            for backend in replicas:
                key = "colocated" if backend.local else backend.address
                placement.setdefault(key, []).append(pair)
                regions[key] = d.region if backend.local else backend.region
                precisions[key] = getattr(backend, "precision", "")
                backends.setdefault(key, backend)
        t = self.tierer
        tiering = TieringStatus(
            t.config.expert_bytes,
            t.colocated_bytes(),
            t.config.budget_bytes,
            t.promotions,
            t.demotions,
            sorted(t.config.pinned_hot),
            sorted(t.config.pinned_remote),
        )
        spec = self.engine.model.spec
        return RouterStatus(
            self.model_id,
            spec.family,
            spec.vocab_size,
            self.engine.model.max_model_len,
            spec.num_layers,
            spec.num_experts,
            spec.moe_layer_ids,
            len(self.engine.running),
            self.engine.num_waiting,
            self.steps,
            d.routed_counts(),
            d.failovers,
            placement,
            regions,
            precisions,
            bool(self.membership is not None and self.membership.stale),
            d.window.counts().tolist(),
            d.window.window_s,
            d.region,
            d.remote_calls,
            d.tokens_colocated,
            d.hedges,
            d.ejections,
            tiering,
            [ReplicaStatus.of(b) for b in backends.values()],
            PipelineStatus.of(self.engine.planner, self.engine.settings.micro_batches),
            KvStatus.of(self.engine.scheduler),
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream a request's outputs; the last one has a finish_reason. Raises the step's error on failure."""
        if self.down is not None:
            raise UnavailableError(f"this router stopped serving: {self.down}")
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        # Outside the try below: a refused request (e.g. its id is in flight already) must not
        # abort or drop the queue of the request that holds the id.
        self.engine.add_request(request_id, prompt_token_ids, params, priority, deadline)
        span = self._request_span(request_id, prompt_token_ids, params)
        self._queues[request_id] = queue
        self._work.set()
        finished, completion = False, 0
        try:
            while not finished:
                out = await queue.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                finished = out.finish_reason is not None
                completion = out.completion_tokens
                yield out
        except BaseException as e:
            if span is not None:
                span.record_exception(e)
                span.set_status(StatusCode.ERROR, str(e))
            raise
        finally:
            self._queues.pop(request_id, None)
            if span is not None:
                self._traced.pop(request_id, None)
                span.set_attribute("gen_ai.usage.output_tokens", completion)
                span.end()
            if not finished:
                self.engine.abort(request_id)
                self._work.set()

    def _request_span(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> Span | None:
        """A span for a request whose trace is sampled (the RPC's span is recording); steps hang under it."""
        if self.tracer is None or not trace.get_current_span().is_recording():
            return None
        span = self.tracer.start_span(
            "moe.router.request",
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.id": request_id,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.usage.input_tokens": len(prompt),
            },
        )
        self._traced[request_id] = trace.set_span_in_context(span)
        return span

    async def _step(self) -> list[StepOutput]:
        """One engine step; traced under the oldest traced request in flight, linked to the others."""
        if not self._traced:
            return await self.engine.step()
        parent, *others = self._traced.values()
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in others]
        with self.tracer.start_as_current_span(
            "moe.router.step", context=parent, links=links
        ) as span:
            outputs = await self.engine.step()
            span.set_attributes(
                {"moe.batch.size": len(outputs), "moe.traced_requests": len(others) + 1}
            )
            return outputs

    async def _supervise(self) -> None:
        deaths: deque[float] = deque()
        while True:
            try:
                await self._loop()
            except Exception as e:
                log.exception("the engine loop died")
                self.loop_deaths += 1
                now = self.clock()
                deaths.append(now)
                while deaths and deaths[0] < now - self.loop_death_window_s:
                    deaths.popleft()
                self._fail_in_flight(InternalError(f"the router's engine loop failed: {e!r}"))
                if device_lost(e):  # a restarted loop would fail on the same device at once
                    self.down = f"its device failed ({e!r}); only a new process recovers from that"
                elif len(deaths) >= self.max_loop_deaths:
                    self.down = (
                        f"its engine loop died {len(deaths)} times within {self.loop_death_window_s:g}s, "
                        f"last: {e!r}"
                    )
                if self.down is not None:
                    log.error("giving up: %s", self.down)
                    if self.on_unhealthy is not None:
                        try:
                            await self.on_unhealthy(self.down)
                        except Exception:
                            log.exception("could not report the router unhealthy")
                    return
                self._work.set()  # requests may have arrived while it was down

    def _fail_in_flight(self, error: MoeMeshError) -> None:
        """End every request with `error`: after a loop death the batch state cannot be trusted."""
        for out in self.engine.fail_all(error):
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def _loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self.engine.has_unfinished():
                outputs = await self._step()
                self._batch_size.record(len(outputs))
                self.steps += 1
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None and out.finish_reason is not FinishReason.CANCELLED:
                        queue.put_nowait(out)
                # Let the server read new requests and flush streamed tokens between steps.
                await asyncio.sleep(0)
