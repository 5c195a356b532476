"""Dense layers shared by every family: RMSNorm, RoPE, attention over the slot KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_mesh.common.arch import ModelSpec
from moe_mesh.common.weights import AttentionWeights
from moe_mesh.router_service.engine.kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class Rope:
    """Default RoPE with a precomputed cos/sin table (same float ops as transformers, so same values)."""

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype) -> None:
        dim = spec.head_dim
        inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq  # [len, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [len, dim]
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; positions: [tokens]."""
        cos, sin = self.cos[positions, None], self.sin[positions, None]  # [tokens, 1, dim]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


@dataclass
class Prefill:
    """A run of consecutive new tokens of one sequence (a whole prompt, or a chunk of it)."""

    slot: int
    start: int  # tokens of this sequence already in the cache
    length: int


@dataclass
class AttentionBatch:
    """Token layout of one step: prefill runs first (in list order), then one decode token per sequence."""

    positions: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [tokens] int64: cache slot of each token
    prefills: list[Prefill]
    decode_slots: torch.Tensor  # [decodes] int64
    decode_lengths: torch.Tensor  # [decodes] int64: context length including the new token
    num_prefill_tokens: int


def attention(
    x: torch.Tensor,
    w: AttentionWeights,
    spec: ModelSpec,
    rope: Rope,
    batch: AttentionBatch,
    cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """Self-attention for all tokens of a step; writes their keys/values into the cache. x: [tokens, hidden]."""
    n, hd = x.shape[0], spec.head_dim
    q = F.linear(x, w.q, w.q_bias)  # [tokens, heads * hd]
    k = F.linear(x, w.k, w.k_bias)  # [tokens, kv_heads * hd]
    v = F.linear(x, w.v, w.v_bias)
    if spec.qk_norm == "full":
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q, k, v = q.view(n, -1, hd), k.view(n, -1, hd), v.view(n, -1, hd)  # [tokens, heads, hd]
    if spec.qk_norm == "per_head":
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    q, k = rope.apply(q, batch.positions), rope.apply(k, batch.positions)
    cache.write(layer, batch.slots, batch.positions, k, v)

    out = torch.empty_like(q)  # [tokens, heads, hd]
    row = 0
    for p in batch.prefills:
        total = p.start + p.length
        qs = q[row : row + p.length].transpose(0, 1)[None]  # [1, heads, len, hd]
        ks, vs = cache.k[layer][p.slot, :, :total][None], cache.v[layer][p.slot, :, :total][None]
        mask = None
        if p.start:  # a later chunk also sees everything cached before it
            mask = torch.ones(p.length, total, dtype=torch.bool).tril(diagonal=p.start)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        out[row : row + p.length] = o[0].transpose(0, 1)
        row += p.length
    if batch.decode_slots.numel():
        out[row:] = _decode_attention(q[row:], batch, cache, layer)
    return F.linear(out.reshape(n, -1), w.o, w.o_bias)


def _decode_attention(
    q: torch.Tensor, batch: AttentionBatch, cache: KVCache, layer: int
) -> torch.Tensor:
    """One new token per sequence, batched over sequences with a length mask. q: [decodes, heads, hd]."""
    slots, lengths = batch.decode_slots, batch.decode_lengths
    longest = int(lengths.max())
    d = slots.numel()
    # The engine keeps decoding slots compact, and a micro-batch takes a run of them: a view, no copy.
    first = int(slots[0])
    if int(slots[-1]) - first == d - 1:
        ks = cache.k[layer][first : first + d, :, :longest]
        vs = cache.v[layer][first : first + d, :, :longest]
    else:
        ks, vs = cache.k[layer][slots, :, :longest], cache.v[layer][slots, :, :longest]
    mask = (torch.arange(longest)[None, :] < lengths[:, None])[
        :, None, None, :
    ]  # [decodes, 1, 1, longest]
    o = F.scaled_dot_product_attention(q[:, :, None], ks, vs, attn_mask=mask, enable_gqa=True)
    return o[:, :, 0]  # [decodes, heads, hd]
