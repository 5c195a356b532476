"""The MoE decoder as the router runs it: dense layers in-process, MoE blocks through the dispatcher."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.arch import ModelSpec
from common.linear import linear, serial_tokens
from common.moe import expert_ffn
from common.weights import DenseWeights
from router_service.engine.kv_cache import KVCache, block_bytes
from router_service.engine.layers import (
    AttentionBatch,
    Prefill,
    Rope,
    add_norm,
    attention,
    norm,
)
from router_service.experts.dispatch import (
    CallTimes,
    Compute,
    ExpertDispatcher,
    Routed,
    inline,
)


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [tokens] int64
    attention: AttentionBatch
    logits_rows: torch.Tensor  # [sequences] int64: the row of each sequence's last token
    deadline: float | None = None  # time.monotonic() by which expert calls must finish


def pack_step(
    prefills: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    decodes: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
) -> StepBatch:
    """Lay out one step over the paged cache. Prefills are (block table, tokens already cached,
    new token ids); decodes are (block table, token, context length incl. it). A block table must
    cover every token up to the end of its run."""
    tokens: list[int] = []
    positions, slots, runs = [], [], []
    for table, start, ids in prefills:
        n, total = len(ids), start + len(ids)
        tokens += ids
        pos = torch.arange(start, total)
        blocks = torch.tensor([table[: -(-total // block_size)]], dtype=torch.int64)
        positions.append(pos)
        slots.append(blocks[0, pos // block_size] * block_size + pos % block_size)
        mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=start) if start else None
        runs.append(Prefill(start=start, length=n, blocks=blocks, mask=mask))
    num_prefill = len(tokens)
    tokens += [d[1] for d in decodes]
    lengths = torch.tensor([d[2] for d in decodes], dtype=torch.int64)
    width = -(-int(lengths.max()) // block_size) if decodes else 0
    tables = torch.tensor(
        [list(t[:width]) + [0] * (width - len(t[:width])) for t, _, _ in decodes],
        dtype=torch.int64,
    ).view(len(decodes), width)  # [decodes, blocks]
    pos = lengths - 1
    positions.append(pos)
    slots.append(
        tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    )
    context = torch.arange(width * block_size)
    attn = AttentionBatch(
        positions=torch.cat(positions),
        slots=torch.cat(slots),
        prefills=runs,
        decode_tables=tables,
        decode_mask=(context[None, :] < lengths[:, None])[:, None, None, :],
        decode_lengths=lengths,
        num_prefill_tokens=num_prefill,
    )
    rows = [end - 1 for end in itertools.accumulate(r.length for r in runs)] + list(
        range(num_prefill, len(tokens))
    )
    return StepBatch(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        attention=attn,
        logits_rows=torch.tensor(rows, dtype=torch.int64),
    )


@dataclass
class PassCosts:
    """What one forward pass cost, for the micro-batch planner: router compute and, per MoE layer
    that called remote experts, the calls' times."""

    compute_s: float = 0.0
    remote: list[CallTimes] = field(default_factory=list)
    moe_layers: int = 1


@dataclass
class _Pass:
    """A forward pass between two compute segments: where it stands and what it waits for."""

    batch: StepBatch
    cache: KVCache
    all_logits: bool
    costs: PassCosts
    x: torch.Tensor | None = None  # the residual stream
    layer: int = 0  # the next layer to run, or the MoE layer waiting for its experts
    waiting: Routed | None = None  # that layer's routing
    h: torch.Tensor | None = None  # ... and its expert input
    outputs: list[torch.Tensor] | None = None  # ... and, once they answered, the experts' outputs
    logits: torch.Tensor | None = None


class MoeModel:
    """Forward passes over packed steps (prefill runs + decode tokens) with a paged KV cache.

    Torch work runs through `compute` (the router's compute thread) in segments that end where a
    MoE layer needs remote experts: the event loop then carries the calls while other micro-batches
    compute. Layers whose experts are all colocated run inside the segment, so a monolithic
    router computes a whole pass in one segment.
    """

    def __init__(
        self,
        spec: ModelSpec,
        weights: DenseWeights,
        dispatcher: ExpertDispatcher,
        max_model_len: int,
        compute: Compute = inline,
        serial_max_tokens: int | None = 0,
    ) -> None:
        self.spec, self.weights, self.dispatcher = spec, weights, dispatcher
        self.max_model_len = max_model_len
        self.compute = compute
        self.dtype = weights.embed.dtype
        if serial_max_tokens is None:  # what this host runs fastest
            serial_max_tokens = serial_tokens(self.dtype)
        self.serial_max_tokens = serial_max_tokens
        self.rope = Rope(spec, max_model_len, self.dtype)

    def close(self) -> None:
        """Stop the compute thread, if it has one."""
        close = getattr(self.compute, "close", None)
        if close is not None:
            close()

    def new_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        """A paged cache of `num_blocks` blocks of `block_size` tokens for this model."""
        heads, k_dim, v_dim = self.spec.kv_dims
        return KVCache(
            self.spec.num_layers, heads, k_dim, self.dtype, num_blocks, block_size, v_dim
        )

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV-cache block of `block_size` tokens."""
        heads, k_dim, v_dim = self.spec.kv_dims
        return block_bytes(self.spec.num_layers, heads, k_dim, self.dtype, block_size, v_dim)

    async def forward(
        self,
        batch: StepBatch,
        cache: KVCache,
        all_logits: bool = False,
        costs: PassCosts | None = None,
    ) -> torch.Tensor:
        """Float32 logits of each sequence's last token [sequences, vocab] (every token's with all_logits)."""
        p = _Pass(batch, cache, all_logits, costs or PassCosts())
        p.costs.moe_layers = max(1, len(self.spec.moe_layer_ids))
        while not await self.compute(self._advance, p):
            times = CallTimes()
            p.outputs = await self.dispatcher.gather(p.waiting, p.h, batch.deadline, times)
            p.costs.remote.append(times)
        return p.logits

    def _advance(self, p: _Pass) -> bool:
        """Run layers until one needs remote experts (False) or the pass is done (True)."""
        began = time.perf_counter()
        threads = torch.get_num_threads()
        # A pass this small is bound by memory bandwidth: where one core reads most of it, waking
        # the other threads for each of its hundreds of ops costs more than they add.
        serial = threads > 1 and p.batch.token_ids.numel() <= self.serial_max_tokens
        if serial:
            torch.set_num_threads(1)
        try:
            return self._run_layers(p)
        finally:
            if serial:
                torch.set_num_threads(threads)
            p.costs.compute_s += time.perf_counter() - began

    def _run_layers(self, p: _Pass) -> bool:
        s, w, d = self.spec, self.weights, self.dispatcher
        # h is the residual stream x normed for what reads it next: each residual addition and
        # the norm after it are one step (add_norm: one kernel call in bfloat16).
        if p.waiting is not None:  # its experts answered: finish that layer
            delta = d.finish(p.waiting, p.outputs, p.h, w.layers[p.layer])
            x, h = add_norm(p.x, delta, self._norm_after(p.layer), s)
            p.waiting = p.h = p.outputs = None
            p.layer += 1
        else:
            x = F.embedding(p.batch.token_ids, w.embed)  # [tokens, hidden]
            h = norm(x, self._norm_after(-1), s)
        while p.layer < len(w.layers):
            i, layer = p.layer, w.layers[p.layer]
            attended = attention(h, layer.attention, s, self.rope, p.batch.attention, p.cache, i)
            x, h = add_norm(x, attended, layer.post_attention_norm, s)
            if layer.dense_mlp is not None:
                delta = expert_ffn(h, layer.dense_mlp)
            else:
                routed = d.route(i, h, layer)
                delta = d.colocated_outputs(routed, h, p.batch.deadline)
                if delta is None:
                    p.x, p.h, p.waiting = x, h, routed
                    return False
                delta = d.finish(routed, delta, h, layer)
            x, h = add_norm(x, delta, self._norm_after(i), s)
            p.layer += 1
        rows = h if p.all_logits else h[p.batch.logits_rows]
        p.logits = linear(rows, w.lm_head).float()  # [rows, vocab]
        return True

    def _norm_after(self, layer: int) -> torch.Tensor:
        """The weight of the norm that reads layer `layer`'s output (-1: the embeddings)."""
        w = self.weights
        return w.layers[layer + 1].input_norm if layer + 1 < len(w.layers) else w.final_norm
