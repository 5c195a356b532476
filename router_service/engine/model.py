"""The MoE decoder as the router runs it: dense layers in-process, MoE blocks through the dispatcher."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_mesh.common.arch import ModelSpec
from moe_mesh.common.moe import expert_ffn
from moe_mesh.common.weights import DenseWeights
from moe_mesh.router_service.engine.kv_cache import KVCache
from moe_mesh.router_service.engine.layers import AttentionBatch, Prefill, Rope, attention, rms_norm
from moe_mesh.router_service.experts.dispatch import ExpertDispatcher


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [tokens] int64
    attention: AttentionBatch
    logits_rows: torch.Tensor  # [sequences] int64: the row of each sequence's last token
    deadline: float | None = None  # time.monotonic() by which expert calls must finish


def pack_step(
    prefills: Sequence[tuple[int, Sequence[int]]], decodes: Sequence[tuple[int, int, int]]
) -> StepBatch:
    """Lay out one step: prefills are (slot, prompt ids); decodes are (slot, token, context length incl. it)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    runs: list[Prefill] = []
    for slot, prompt in prefills:
        tokens += prompt
        positions += range(len(prompt))
        slots += [slot] * len(prompt)
        runs.append(Prefill(slot=slot, start=0, length=len(prompt)))
    num_prefill = len(tokens)
    for slot, token, length in decodes:
        tokens.append(token)
        positions.append(length - 1)
        slots.append(slot)
    rows = [end - 1 for end in itertools.accumulate(r.length for r in runs)] + list(
        range(num_prefill, len(tokens))
    )
    attn = AttentionBatch(
        positions=torch.tensor(positions, dtype=torch.int64),
        slots=torch.tensor(slots, dtype=torch.int64),
        prefills=runs,
        decode_slots=torch.tensor([d[0] for d in decodes], dtype=torch.int64),
        decode_lengths=torch.tensor([d[2] for d in decodes], dtype=torch.int64),
        num_prefill_tokens=num_prefill,
    )
    return StepBatch(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        attention=attn,
        logits_rows=torch.tensor(rows, dtype=torch.int64),
    )


class MoeModel:
    """Forward passes over packed steps (prefill runs + decode tokens) with a slot KV cache."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: DenseWeights,
        dispatcher: ExpertDispatcher,
        max_model_len: int,
    ) -> None:
        self.spec, self.weights, self.dispatcher = spec, weights, dispatcher
        self.max_model_len = max_model_len
        self.dtype = weights.embed.dtype
        self.rope = Rope(spec, max_model_len, self.dtype)

    def new_cache(self) -> KVCache:
        return KVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.dtype)

    async def forward(
        self, batch: StepBatch, cache: KVCache, all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits of each sequence's last token [sequences, vocab] (every token's with all_logits)."""
        s, w = self.spec, self.weights
        x = F.embedding(batch.token_ids, w.embed)  # [tokens, hidden]
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.input_norm, s.rms_norm_eps)
            x = x + attention(h, layer.attention, s, self.rope, batch.attention, cache, i)
            h = rms_norm(x, layer.post_attention_norm, s.rms_norm_eps)
            if layer.dense_mlp is not None:
                x = x + expert_ffn(h, layer.dense_mlp)
            else:
                x = x + await self.dispatcher.moe(i, h, layer, batch.deadline)
        x = rms_norm(x, w.final_norm, s.rms_norm_eps)
        rows = x if all_logits else x[batch.logits_rows]
        return F.linear(rows, w.lm_head).float()  # [rows, vocab]
