"""DeepSeek's multi-head latent attention (MLA) over the paged KV cache.

A token's cache entry is what MLA compresses its keys and values into, shared by every head: the
kv_a_layernorm-normalised latent [kv_lora] as the entry's "key" and the rotated rope key [rope] as
its "value" (spec.kv_dims). Prefill expands its context's latents through kv_b into per-head keys
and values, as transformers does; decode attends over the latents themselves (`_decode`), which
reads the cache once instead of expanding it for every new token: the same products
reassociated, so 16-bit decode rounds a unit or two apart from transformers' (prefill rounds
alike; docs/families/deepseek_v3.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.arch import ModelSpec
from common.linear import linear
from common.weights import MLAWeights
from router_service.engine.kv_cache import KVCache
from router_service.engine.layers import AttentionBatch, Rope, rms_norm

# The q_a and kv_a norms take RMSNorm's default eps in transformers (and DeepSeek's own code),
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_attention(
    x: torch.Tensor,
    w: MLAWeights,
    spec: ModelSpec,
    rope: Rope,
    batch: AttentionBatch,
    cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """Self-attention for all tokens of a step; writes their latents into the cache. x: [tokens, hidden]."""
    m, n, heads = spec.mla, x.shape[0], spec.num_heads
    nope, rot = m.qk_nope_head_dim, m.qk_rope_head_dim
    if batch.rope is None:
        batch.rope = rope.at(batch.positions)
    a = linear(x, w.a, w.a_bias)  # [tokens, (q_out or q_lora) + kv_lora + rope]
    q, latent, k_rot = a.split([a.shape[1] - m.kv_lora_rank - rot, m.kv_lora_rank, rot], dim=-1)
    if w.q_b is not None:
        q = linear(rms_norm(q, w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q = q.view(n, heads, nope + rot)
    # The queries' rope parts and the shared key's rotate together: one pass of the rope ops.
    rotated = rope.rotate(torch.cat([q[..., nope:], k_rot[:, None]], dim=1), batch.rope)
    q = torch.cat([q[..., :nope], rotated[:, :heads]], dim=-1)  # [tokens, heads, nope + rope]
    latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)  # [tokens, kv_lora]
    k_rot = rotated[:, heads:]  # [tokens, 1, rope]
    cache.write(layer, batch.slots, latent[:, None], k_rot)

    out = x.new_empty(n, heads, m.v_head_dim)
    row = 0
    for p in batch.prefills:
        if p.start:  # a later chunk, or past a prefix-cache hit: it also sees the cached tokens
            lat, kr = cache.gather(layer, p.blocks)  # [1, 1, blocks * bs, kv_lora / rope]
            total = p.start + p.length
            lat, kr = lat[:, 0, :total], kr[:, 0, :total]
        else:  # the whole context is this run: its latents are at hand
            lat, kr = latent[None, row : row + p.length], k_rot[None, row : row + p.length, 0]
        k, v = _expand(lat, kr, w, spec)
        qs = q[row : row + p.length].transpose(0, 1)[None]  # [1, heads, len, nope + rope]
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=spec.attention_scale
        )
        out[row : row + p.length] = o[0].transpose(0, 1)
        row += p.length
    if batch.decode_tables.numel():
        out[row:] = _decode(q[row:], w, spec, batch, cache, layer)
    return linear(out.reshape(n, -1), w.o, w.o_bias)


def _expand(
    latent: torch.Tensor, k_rot: torch.Tensor, w: MLAWeights, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of contexts: latent [seqs, T, kv_lora] and k_rot [seqs, T, rope]
    -> keys [seqs, heads, T, nope + rope], values [seqs, heads, T, v]."""
    m, heads = spec.mla, spec.num_heads
    s, t = latent.shape[:2]
    kv = linear(latent.reshape(s * t, -1), w.kv_b).view(s, t, heads, -1)  # [s, T, heads, nope + v]
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rot[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


def _decode(
    q: torch.Tensor,
    w: MLAWeights,
    spec: ModelSpec,
    batch: AttentionBatch,
    cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """One new token per sequence, batched over sequences with a length mask, without expanding
    the context: kv_b's key rows are absorbed into the query (q_nope·(W_k c) = (W_kᵀ q_nope)·c) and
    its value rows applied after attention, so every head attends over the cached entries
    themselves, as query rows of one shared head. q: [decodes, heads, nope + rope] -> [decodes, heads, v]."""
    m, heads = spec.mla, spec.num_heads
    nope = m.qk_nope_head_dim
    kv_b = w.kv_b.view(heads, nope + m.v_head_dim, m.kv_lora_rank)
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), kv_b[:, :nope]).transpose(0, 1)
    q = torch.cat([q_lat, q[..., nope:]], dim=-1)[:, None]  # [decodes, 1, heads, kv_lora + rope]
    tables, mask = batch.decode_tables, batch.decode_mask
    o = q.new_empty(*q.shape[:3], m.kv_lora_rank)  # [decodes, 1, heads, kv_lora]
    step = cache.group(tables.shape[1])
    for s in range(0, q.shape[0], step):  # long contexts: a few sequences at a time
        seqs = slice(s, s + step)
        lat, kr = cache.gather(layer, tables, seqs)  # [seqs, 1, blocks * bs, kv_lora / rope]
        keys = torch.cat([lat, kr], dim=-1)  # [seqs, 1, blocks * bs, kv_lora + rope]
        o[seqs] = F.scaled_dot_product_attention(
            q[seqs], keys, lat, attn_mask=mask[seqs], scale=spec.attention_scale
        )
    return torch.bmm(o[:, 0].transpose(0, 1), kv_b[:, nope:].transpose(1, 2)).transpose(0, 1)
