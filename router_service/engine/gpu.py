"""How a model on a GPU runs a pass whose experts are all on that GPU.

MoeModel hands a pass here first. Where the dispatcher's placement puts every routed expert in
one colocated backend (all_colocated), the experts are stacked per layer (device_pass.stack),
MoE layers become grouped products with no host synchronisation (device_pass.moe_layer), and a
decode-only step replays a CUDA graph (graphs.DecodeGraphs); a prefill or an unbucketed step
runs the same pass eagerly. Anything else (remote experts, a traced request, a dtype torch has
no grouped product for) answers None, and the model takes the dispatcher's path, where expert
rows cross to the host only for the calls that need the wire.

MOE_MESH_CUDA_GRAPHS=off keeps the grouped products but launches every step eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import torch

from common.arch import ModelSpec
from common.weights import DenseWeights, FFNWeights, LayerWeights
from router_service.engine import device_pass
from router_service.engine.graphs import CudaGraphs, DecodeGraphs, GraphBackend
from router_service.engine.kv_cache import KVCache
from router_service.engine.layers import AttentionBatch
from router_service.experts.dispatch import ExpertDispatcher

log = logging.getLogger(__name__)

# The model's pass over (tokens, layout, logits rows, cache, MoE layer) -> logits, as a coroutine.
Layers = Callable[..., Coroutine[Any, Any, torch.Tensor]]


def graphs_enabled() -> bool:
    """MOE_MESH_CUDA_GRAPHS: `off` launches decode steps eagerly (default on)."""
    return os.environ.get("MOE_MESH_CUDA_GRAPHS", "on").lower() not in ("off", "0", "false", "no")


def run_sync(coro: Coroutine[Any, Any, torch.Tensor]) -> torch.Tensor:
    """Run a pass whose every await returns at once (a device pass waits on no call)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a device pass awaited something that did not finish at once")


class GpuPasses:
    """Passes of one model on one device whose experts are all held there."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: DenseWeights,
        dispatcher: ExpertDispatcher,
        layers: Layers,
        max_seqs: int,
        max_model_len: int,
        backend: GraphBackend | None = None,
    ) -> None:
        self.spec, self.weights, self.dispatcher, self.layers = spec, weights, dispatcher, layers
        self.device = weights.embed.device
        self.max_seqs, self.max_model_len = max_seqs, max_model_len
        self.backend = backend
        if backend is None and self.device.type == "cuda" and graphs_enabled():
            self.backend = CudaGraphs(self.device)
        self.stacks: dict[int, device_pass.StackedExperts] | None = None
        self._stacked_for: Mapping[tuple[int, int], FFNWeights] | None = None
        self.graphs: DecodeGraphs | None = None
        self._cache: KVCache | None = None

    def run(
        self,
        tokens: torch.Tensor,
        attention: AttentionBatch,
        rows: torch.Tensor | None,
        cache: KVCache,
    ) -> torch.Tensor | None:
        """Float32 logits of `rows` (every token's with None), or None where the pass is not
        all here (the caller's path then)."""
        experts = self.dispatcher.all_colocated()
        if experts is None:  # let go of the stacks of the old placement, and their graphs
            self.stacks = self._stacked_for = self.graphs = self._cache = None
            return None
        if self.dispatcher.traced() or not self._bind(experts):
            return None
        out = None
        if rows is not None and self.backend is not None and self._graphs(cache) is not None:
            out = self.graphs.step(tokens, attention)  # type: ignore[union-attr]
        if out is None:
            out = self._eager(tokens, attention, rows, cache)
        logits, chosen = out
        # One read a step: the step's logits are read next anyway.
        self.dispatcher.computed_together(chosen.flatten(1).tolist())
        return logits

    def prepare(self) -> None:
        """Stack the experts now, before the KV cache takes its share of the device's memory:
        stacking copies a layer's experts before their originals are let go."""
        if (experts := self.dispatcher.all_colocated()) is not None:
            self._bind(experts)
        if self.device.type == "cuda":  # the originals' memory back to the device, for the cache
            torch.cuda.empty_cache()

    def _bind(self, experts: Mapping[tuple[int, int], FFNWeights]) -> bool:
        if experts is not self._stacked_for:
            self._stacked_for = experts
            # Graphs captured over the old stacks would read their freed memory.
            old, self.stacks, self.graphs, self._cache = self.stacks, None, None, None
            dtype = self.weights.embed.dtype
            if device_pass.grouped_products(self.device, dtype):
                self.stacks = device_pass.stack(experts, self.spec, old)
            else:
                log.info(
                    "no grouped product for %s on %s: MoE layers expert by expert",
                    dtype,
                    self.device,
                )
        return self.stacks is not None

    def _eager(
        self,
        tokens: torch.Tensor,
        attention: AttentionBatch,
        rows: torch.Tensor | None,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen: list[torch.Tensor] = []
        stacks = self.stacks

        async def moe(i: int, h: torch.Tensor, layer: LayerWeights, *_: object) -> torch.Tensor:
            out, experts = device_pass.moe_layer(h, layer, stacks[i], self.spec)  # type: ignore[index]
            chosen.append(experts)
            return out

        logits = run_sync(self.layers(tokens, attention, rows, cache, moe))
        return logits, torch.stack(chosen)  # [moe layers, rows, k]

    def _graphs(self, cache: KVCache) -> DecodeGraphs | None:
        """This cache's decode graphs (new ones for a new cache); None without a scratch slot."""
        if cache is not self._cache:
            self._cache, self.graphs = cache, None
            if cache.scratch_slot is not None:
                blocks = -(-self.max_model_len // cache.block_size)

                def forget_tables() -> None:
                    # What gather keeps between calls is made anew in each run, so the capture
                    # allocates it in the graphs' pool: rows from the static tables, and a
                    # workspace no eager step can free while a graph still writes to it.
                    cache._tables = None
                    cache._work = cache._work.new_empty(0)

                self.graphs = DecodeGraphs(
                    lambda t, a, r: self._eager(t, a, r, cache),
                    self.backend,  # type: ignore[arg-type]
                    self.max_seqs,
                    blocks,
                    cache.block_size,
                    cache.scratch_slot,
                    self.device,
                    forget_tables,
                )
        return self.graphs
