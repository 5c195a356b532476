"""The MoE block of every layer, as one await: route the tokens, compute each expert group on its
replica (colocated here and now when one colocated backend serves them all; otherwise scattered
to the backends on the event loop, replicas.py), gather the outputs and combine them.

Awaited from a pass under run_stretches (engine/pipeline.py), a layer that needs the network ends
the pass's stretch on the compute thread: other micro-batches compute while its calls are out.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping

import torch

from common.arch import ModelSpec
from common.moe import (
    ExpertGroup,
    Routing,
    combine,
    gather_rows,
    group_by_expert,
    route,
    shared_expert_output,
)
from common.resilience import Clock
from common.telemetry import OFF, Telemetry
from common.weights import FFNWeights, LayerWeights
from router_service.engine.pipeline import CallTimes, Compute, inline, on_loop
from router_service.experts.backends import ColocatedExperts, ExpertBackend, Placement
from router_service.experts.metrics import DispatchTelemetry
from router_service.experts.replicas import DispatchPolicy, Replicas
from router_service.experts.utilization import UtilizationWindow


class ExpertDispatcher:
    """Runs MoE layers over the experts' placement; counts what it routed and what it cost."""

    def __init__(
        self,
        spec: ModelSpec,
        placement: Placement,
        default_timeout_s: float = 30.0,
        region: str = "",
        region_penalty: float = 8.0,
        window: UtilizationWindow | None = None,
        telemetry: Telemetry = OFF,
        policy: DispatchPolicy | None = None,
        compute: Compute = inline,
        clock: Clock = time.monotonic,
    ) -> None:
        self.spec = spec
        self.telemetry = DispatchTelemetry(telemetry)
        self.replicas = Replicas(
            policy or DispatchPolicy(),
            default_timeout_s,
            region,
            region_penalty,
            compute,
            self.telemetry,
            clock,
        )
        self.prober, self.budget = self.replicas.prober, self.replicas.budget
        self.set_placement(placement)
        self.window = window or UtilizationWindow(spec.num_layers, spec.num_experts)
        # [layer][expert]: Python ints, bumped once per MoE layer call (see UtilizationWindow)
        self.tokens_routed = [[0] * spec.num_experts for _ in range(spec.num_layers)]
        self._lock = threading.Lock()  # layers are routed on the compute thread, read from the loop
        self.telemetry.register(self)

    # What status and metrics read, counted where the replicas are chosen.
    tokens_colocated = property(lambda self: self.replicas.tokens_colocated)
    remote_calls = property(lambda self: self.replicas.remote_calls)
    failovers = property(lambda self: self.replicas.failovers)
    hedges = property(lambda self: self.replicas.hedges)
    hedges_won = property(lambda self: self.replicas.hedges_won)
    ejections = property(lambda self: self.replicas.ejections)
    region = property(lambda self: self.replicas.region)  # where this router runs

    @property
    def placement(self) -> dict[tuple[int, int], list[ExpertBackend]]:
        return self.replicas.placement

    def set_placement(self, placement: Placement) -> None:
        """Swap in a new placement table (one assignment: a layer call in flight keeps the old one)."""
        self.replicas.set_placement(placement)
        # all_colocated's answer for this table, found on first use; nothing of the old table
        # held meanwhile (a demoted expert's weights are freed once its calls are done).
        self._sole_for: Placement | None = None
        self._sole: ColocatedExperts | None = None
        # Whether some expert is served only remotely, so a step may wait on the network.
        self.remote = any(not r[0].local for r in self.replicas.placement.values() if r)

    async def close(self) -> None:
        """Stop checking ejected replicas (before their channels close)."""
        await self.prober.close()

    def routed_counts(self) -> list[list[int]]:
        """Tokens routed per [layer][expert] since start (the compute thread adds to them)."""
        with self._lock:
            return [list(row) for row in self.tokens_routed]

    async def moe_layer(
        self,
        layer: int,
        x: torch.Tensor,
        w: LayerWeights,
        deadline: float | None = None,
        calls: list[CallTimes] | None = None,
    ) -> torch.Tensor:
        """x: [tokens, hidden] (already normed) -> routed (+ shared) expert output [tokens, hidden].

        `deadline` (the dispatcher's clock) bounds every expert call; a layer that calls remote
        experts appends what its calls cost to `calls`."""
        routing = route(x, w.router, self.spec, w.router_bias, w.router_correction)
        groups = group_by_expert(routing, self.spec.num_experts)
        self._count(layer, [(g.expert, g.size) for g in groups])
        local = self.replicas.colocated(layer, [g.expert for g in groups])
        if not groups:
            outputs: list[torch.Tensor] = []
        elif local is not None:
            self.replicas.check_deadline(deadline)
            rows = list(zip((g.expert for g in groups), gather_rows(x, groups)))
            with self.telemetry.layer_span(layer, x.shape[0], groups):
                outputs = self.replicas.compute_here(local, layer, rows)
        elif not staged_on_host(x):
            outputs = await on_loop(self._scatter_gather, layer, x, groups, deadline, calls)
        else:  # the wire carries host memory: the layer staged there, its result sent back
            host = Routing(routing.experts.cpu(), routing.weights.cpu(), routing.add_in_order)
            staged = group_by_expert(host, self.spec.num_experts)  # the same groups, in order
            rows = x.cpu()
            outputs = await on_loop(self._scatter_gather, layer, rows, staged, deadline, calls)
            y = combine(staged, outputs, host, x.shape[0], like=rows).to(x.device)
            return self._shared(x, w, y)
        y = combine(groups, outputs, routing, x.shape[0], like=x)
        return self._shared(x, w, y)

    @staticmethod
    def _shared(x: torch.Tensor, w: LayerWeights, y: torch.Tensor) -> torch.Tensor:
        """The routed output `y` plus the layer's shared expert, where it has one."""
        if w.shared_expert is not None:
            y = y + shared_expert_output(x, w.shared_expert, w.shared_expert_gate)
        return y

    def all_colocated(self) -> Mapping[tuple[int, int], FFNWeights] | None:
        """Every routed expert's weights, where one colocated backend is the first choice for all
        of them: a decode step can then compute every layer in one call
        (engine/fused.py), with no call to make. Found once per placement table (on the
        compute thread, while the loop may swap the table: the answer names the table it is for)."""
        placement = self.replicas.placement
        if self._sole_for is not placement:
            self._sole_for, self._sole = placement, self._sole_backend(placement)
        return None if self._sole is None else self._sole.weights

    def traced(self) -> bool:
        """Whether this thread computes for a traced request (its layers then get spans)."""
        return self.telemetry.tracing()

    def _sole_backend(self, placement: Placement) -> ColocatedExperts | None:
        experts, sole = range(self.spec.num_experts), None
        for layer in self.spec.moe_layer_ids:
            local = self.replicas.colocated(layer, experts, placement)
            if not isinstance(local, ColocatedExperts) or sole not in (None, local):
                return None
            sole = local
        return sole

    def computed_together(self, chosen: list[list[int]]) -> None:
        """Count a pass computed without the dispatcher (all_colocated: one call, or a GPU's
        grouped products): the experts each MoE layer routed its tokens to, every choice once,
        as its layers would have counted them. It made no expert call, so the call durations
        record none."""
        for layer, experts in zip(self.spec.moe_layer_ids, chosen):
            self._count(layer, sorted(Counter(experts).items()))
        self.replicas.computed_here(sum(len(c) for c in chosen))

    def _count(self, layer: int, routed: list[tuple[int, int]]) -> None:
        with self._lock:
            row = self.tokens_routed[layer]
            for expert, n in routed:
                row[expert] += n
            self.window.add(layer, routed)

    async def _scatter_gather(
        self,
        layer: int,
        x: torch.Tensor,
        groups: list[ExpertGroup],
        deadline: float | None,
        calls: list[CallTimes] | None,
    ) -> list[torch.Tensor]:
        """The groups' outputs from their replicas, in group order (on the event loop)."""
        times = CallTimes()
        with self.telemetry.layer_span(layer, x.shape[0], groups):
            rows = list(zip((g.expert for g in groups), gather_rows(x, groups)))
            outputs = await self.replicas.forward(layer, rows, deadline, times)
        if calls is not None:
            calls.append(times)
        return outputs


def staged_on_host(x: torch.Tensor) -> bool:
    """Whether a layer with remote experts stages `x` in host memory for the wire (a GPU's)."""
    return x.device.type != "cpu"
