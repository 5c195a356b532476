"""Expert backends and the MoE layer's scatter-gather over them.

An `ExpertBackend` computes expert FFNs for one layer on groups of token rows. The colocated
backend runs them in-process; remote backends (gRPC, later UCX) send them to expert services.
The dispatcher routes each token, sends every backend its groups in one call, all in flight at
once, and combines the results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from common.arch import ModelSpec
from common.moe import combine, expert_ffn, group_by_expert, route, shared_expert_output
from common.weights import FFNWeights, LayerWeights


class ExpertBackend(Protocol):
    """Computes expert FFNs. `groups` is [(expert, rows [n, hidden])]; returns outputs in the same order."""

    async def forward(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]: ...


class ColocatedExperts:
    """Experts held in this process: no network hop."""

    def __init__(self, weights: Mapping[tuple[int, int], FFNWeights]) -> None:
        self.weights = dict(weights)

    async def forward(self, layer: int, groups: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        return [expert_ffn(rows, self.weights[(layer, expert)]) for expert, rows in groups]


class ExpertDispatcher:
    """The MoE block of every layer: route, scatter to backends by placement, gather, combine."""

    def __init__(self, spec: ModelSpec, placement: Mapping[tuple[int, int], ExpertBackend]) -> None:
        self.spec = spec
        self.placement = dict(placement)
        self.tokens_routed = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64)

    async def moe(self, layer: int, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """x: [tokens, hidden] (already normed) -> routed (+ shared) expert output [tokens, hidden]."""
        routing = route(x, w.router, self.spec)
        groups = group_by_expert(routing, self.spec.num_experts)
        by_backend: dict[int, tuple[ExpertBackend, list[int]]] = {}
        for i, g in enumerate(groups):
            backend = self.placement[(layer, g.expert)]
            by_backend.setdefault(id(backend), (backend, []))[1].append(i)
        self.tokens_routed[layer] += torch.bincount(routing.experts.reshape(-1), minlength=self.spec.num_experts)
        calls = [backend.forward(layer, [(groups[i].expert, x[groups[i].tokens]) for i in idx])
                 for backend, idx in by_backend.values()]
        outputs: list[torch.Tensor | None] = [None] * len(groups)
        for (_, idx), result in zip(by_backend.values(), await asyncio.gather(*calls)):
            for i, y in zip(idx, result):
                outputs[i] = y
        y = combine(groups, outputs, routing, x.shape[0], like=x)  # type: ignore[arg-type]
        if w.shared_expert is not None:
            y = y + shared_expert_output(x, w.shared_expert, w.shared_expert_gate)
        return y
