"""Dense layers shared by every family: RMSNorm, RoPE, attention over the paged KV cache (with
sliding windows and attention sinks where the family has them)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common import attention_kernels, bf16
from common.arch import ModelSpec
from common.arch.spec import RopeSpec, yarn_mscale
from common.linear import linear
from common.weights import AttentionWeights, MLAWeights
from router_service.engine.kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""
    if x.dtype == torch.float32:  # one fused op; the same bits as the three below
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    if (fused := bf16.rms_norm(x, weight, eps)) is not None:
        return fused[1]
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The family's block norm: RMSNorm, or LayerNorm without bias (DBRX)."""
    if spec.norm == "layer":
        return F.layer_norm(x, x.shape[-1:], weight, None, spec.rms_norm_eps)
    return rms_norm(x, weight, spec.rms_norm_eps)


def add_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding `delta`, and its norm: one kernel call in bfloat16."""
    if spec.norm == "rms" and (fused := bf16.rms_norm(x, weight, spec.rms_norm_eps, delta)):
        return fused
    x = x + delta
    return x, norm(x, weight, spec)


class Rope:
    """RoPE with a precomputed cos/sin table (same float ops as transformers, so same values).

    Covers what the families configure (common/arch/spec.py RopeSpec): YaRN frequency scaling and
    its attention factor, rotation of only a head's first `rotary_dim` dims (GLM), and DeepSeek's
    interleaved pairs, whose output transformers lays out as halves (so do we: q and k alike).
    """

    def __init__(
        self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        r = spec.rope
        head = spec.mla.qk_rope_head_dim if spec.mla is not None else spec.head_dim
        dim = self.dim = r.rotary_dim or head
        self.interleaved = r.interleaved
        inv_freq, scale = _inv_freq(spec.rope_theta, dim, r)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq  # [len, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [len, dim]
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, dim] of these positions: once per step, used by every layer."""
        return self.cos[positions, None], self.sin[positions, None]

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [tokens, heads, head_dim] rotated by its tokens' positions (its first `dim` dims)."""
        cos, sin = cos_sin
        if x.shape[-1] != self.dim:  # partial rotary: the rest passes through
            rot, rest = x[..., : self.dim], x[..., self.dim :]
            return torch.cat((self.rotate(rot, cos_sin), rest), dim=-1)
        half = x.shape[-1] // 2
        if self.interleaved:
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if (y := attention_kernels.rope(x, cos, sin)) is not None:  # one call, the same bits
            return y
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _inv_freq(theta: float, dim: int, r: RopeSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the cos/sin scale (YaRN's attention factor, else 1)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if r.scaling == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN (arXiv 2309.00071), as transformers computes it: frequencies below the correction
    # range are interpolated by `factor`, those above kept, a linear ramp in between.
    factor = r.factor
    scale = r.attention_factor
    if scale is None:
        scale = (
            yarn_mscale(factor, r.mscale) / yarn_mscale(factor, r.mscale_all_dim)
            if r.mscale and r.mscale_all_dim
            else yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        wavelength = r.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(scale)


@dataclass
class Prefill:
    """A run of consecutive new tokens of one sequence (a whole prompt, or a chunk of it)."""

    start: int  # tokens of this sequence already in the cache
    length: int
    blocks: torch.Tensor  # [1, blocks] int64: its block table up to the run's end
    mask: torch.Tensor | None  # [length, start + length] bool when start > 0: causal past the cache


@dataclass
class AttentionBatch:
    """Token layout of one step: prefill runs first (in list order), then one decode token per sequence.

    Built once per step (model.pack_step): the same indices serve every layer.
    """

    positions: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [tokens] int64: cache slot of each token, block * block_size + offset
    prefills: list[Prefill]
    decode_tables: torch.Tensor  # [decodes, blocks] int64: block tables, padded with block 0
    decode_lengths: torch.Tensor  # [decodes] int64: each one's context, its new token included
    num_prefill_tokens: int
    block_size: int
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of `positions`, filled once
    # Masks of sliding windows and sinks (gpt-oss), made by the first layer that needs each: _mask.
    masks: dict[tuple[int, int | None, bool], torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> AttentionBatch:
        """This layout with its index tensors on `device` (where a GPU model computes)."""
        runs = [
            Prefill(
                p.start,
                p.length,
                p.blocks.to(device),
                None if p.mask is None else p.mask.to(device),
            )
            for p in self.prefills
        ]
        return AttentionBatch(
            positions=self.positions.to(device),
            slots=self.slots.to(device),
            prefills=runs,
            decode_tables=self.decode_tables.to(device),
            decode_lengths=self.decode_lengths.to(device),
            num_prefill_tokens=self.num_prefill_tokens,
            block_size=self.block_size,
        )

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[decodes, 1, 1, blocks * block_size] bool: the context each decode attends. Made by
        the first layer that reads it: the attention kernels read the lengths instead."""
        width = self.decode_tables.shape[1] * self.block_size
        context = torch.arange(width, device=self.decode_lengths.device)
        return (context[None, :] < self.decode_lengths[:, None])[:, None, None, :]


def attention(
    x: torch.Tensor,
    w: AttentionWeights | MLAWeights,
    spec: ModelSpec,
    rope: Rope,
    batch: AttentionBatch,
    cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """Self-attention for all tokens of a step; writes their keys/values into the cache. x: [tokens, hidden]."""
    if spec.mla is not None:  # DeepSeek's latent attention: other projections, another cache entry
        from router_service.engine.mla import mla_attention

        return mla_attention(x, w, spec, rope, batch, cache, layer)
    n, hd, heads, kv_heads = x.shape[0], spec.head_dim, spec.num_heads, spec.num_kv_heads
    if batch.rope is None:
        batch.rope = rope.at(batch.positions)
    qkv = linear(x, w.qkv, w.qkv_bias)  # [tokens, (heads + 2 * kv_heads) * hd]
    window = spec.sliding_window if spec.is_sliding(layer) else None
    plain = window is None and w.sinks is None
    raw_qk = spec.qk_norm == "none" and spec.clip_qkv is None  # q and k go to RoPE as computed
    whole_rope = not rope.interleaved and rope.dim == hd
    if plain and raw_qk and whole_rope and not batch.prefills:
        # decodes alone: rope, cache write and attention in one kernel call where it can
        k, v, scale = cache.k[layer], cache.v[layer], hd**-0.5
        tables, lengths = batch.decode_tables, batch.decode_lengths
        fused = attention_kernels.decode_step_attention(
            qkv, batch.rope, batch.slots, k, v, tables, lengths, heads, scale
        )
        if fused is not None:
            return linear(fused.reshape(n, -1), w.o, w.o_bias)
    if raw_qk:
        qkv = qkv.view(n, heads + 2 * kv_heads, hd)
        # q and k rotate together: one pass of the rope ops instead of two.
        qk, v = rope.rotate(qkv[:, : heads + kv_heads], batch.rope), qkv[:, heads + kv_heads :]
    else:
        qk, v = _normed_qk(qkv, w, spec, rope, batch)
    q, k = qk[:, :heads], qk[:, heads:]
    cache.write(layer, batch.slots, k, v)

    if not batch.prefills:  # decodes alone: their attention is the whole output
        out = _decode_attention(q, batch, cache, layer, window, w.sinks)
        return linear(out.reshape(n, -1), w.o, w.o_bias)
    # The first four families have neither: they run exactly the ops they always ran.
    out = torch.empty_like(q)  # [tokens, heads, hd]
    row = 0
    for run, p in enumerate(batch.prefills):
        qs = q[row : row + p.length].transpose(0, 1)[None]  # [1, heads, len, hd]
        if p.start:  # a later chunk, or past a prefix-cache hit: it also sees the cached tokens
            ks, vs = cache.gather(layer, p.blocks)  # [1, kv_heads, blocks * bs, hd]
            total = p.start + p.length
            ks, vs = ks[:, :, :total], vs[:, :, :total]
        else:  # the whole context is this run: its keys and values are at hand
            ks = k[row : row + p.length].transpose(0, 1)[None]  # [1, kv_heads, len, hd]
            vs = v[row : row + p.length].transpose(0, 1)[None]
        if plain:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
            )
        else:
            sinks = None if w.sinks is None else w.sinks[:, None, None]  # [heads, 1, 1]
            o = _attend(qs, ks, vs, _mask(batch, run, window, sinks is not None), sinks, True)
        out[row : row + p.length] = o[0].transpose(0, 1)
        row += p.length
    if batch.decode_tables.numel():
        out[row:] = _decode_attention(q[row:], batch, cache, layer, window, w.sinks)
    return linear(out.reshape(n, -1), w.o, w.o_bias)


def _normed_qk(
    qkv: torch.Tensor, w: AttentionWeights, spec: ModelSpec, rope: Rope, batch: AttentionBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normed and clipped as the family does, then rotated together, and v:
    [tokens, heads + kv_heads, hd] and [tokens, kv_heads, hd]."""
    n, hd, heads, kv_heads = qkv.shape[0], spec.head_dim, spec.num_heads, spec.num_kv_heads
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    if spec.qk_norm == "full":
        q, k = (
            rms_norm(q, w.q_norm, spec.rms_norm_eps),
            rms_norm(k, w.k_norm, spec.rms_norm_eps),
        )
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q, k, v = q.view(n, -1, hd), k.view(n, -1, hd), v.view(n, -1, hd)  # [tokens, heads, hd]
    if spec.qk_norm == "per_head":
        q, k = (
            rms_norm(q, w.q_norm, spec.rms_norm_eps),
            rms_norm(k, w.k_norm, spec.rms_norm_eps),
        )
    return rope.rotate(torch.cat([q, k], dim=1), batch.rope), v


def _mask(batch: AttentionBatch, run: int, window: int | None, sink: bool) -> torch.Tensor:
    """Which keys each query of prefill run `run` (-1: the decodes) sees, bool [..., queries,
    keys]: the causal ones, on a sliding layer only the last `window` positions (transformers'
    rule: key > query - window), and the sink key, appended, always. Made once per step."""
    key = (run, window, sink)
    if key in batch.masks:
        return batch.masks[key]
    device = batch.positions.device
    if run < 0:  # [decodes, 1, 1, blocks * block_size]
        allowed = batch.decode_mask
        query = batch.positions[batch.num_prefill_tokens :, None, None, None]
    else:  # [length, start + length]
        p = batch.prefills[run]
        query = torch.arange(p.start, p.start + p.length, device=device)[:, None]
        allowed = torch.arange(p.start + p.length, device=device) <= query
    if window is not None:
        allowed = allowed & (torch.arange(allowed.shape[-1], device=device) > query - window)
    if sink:
        allowed = F.pad(allowed, (0, 1), value=True)
    batch.masks[key] = allowed
    return allowed


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor | None,
    gqa: bool = False,
) -> torch.Tensor:
    """SDPA over the `allowed` keys, with gpt-oss's attention sinks when given (broadcastable to
    q[..., :1]: one per query head). q [..., heads, queries, hd], k and v [..., kv_heads, keys, hd].

    A sink is a learned per-head logit in the softmax's denominator that brings no value. It is
    one more key, last, of value zero; for its logit to be the head's sink whatever the query, q
    and k get one more dimension: 0 in every key, 1 in the sink key, sink / scale in each query
    head. The mask stays one for all heads (a float mask per head would be heads times larger)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    hd = q.shape[-1]
    scale = hd**-0.5
    q = torch.cat([q, (sinks / scale).to(q.dtype).expand(*q.shape[:-1], 1)], dim=-1)
    k = F.pad(k, (0, 1, 0, 1))  # [..., keys + 1, hd + 1]
    k[..., -1, -1] = 1
    v = F.pad(v, (0, 1, 0, 1))  # zero; its extra dimension only keeps SDPA on its fused kernel
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return o[..., :hd]


def _decode_attention(
    q: torch.Tensor,
    batch: AttentionBatch,
    cache: KVCache,
    layer: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence, batched over sequences with a length mask. q: [decodes, heads, hd]."""
    tables = batch.decode_tables
    d, kv_heads = tables.shape[0], cache.kv_heads
    if window is None and sinks is None:  # read in place from the cache, in one call
        k, v, scale = cache.k[layer], cache.v[layer], q.shape[-1] ** -0.5
        if (
            out := attention_kernels.decode_attention(q, k, v, tables, batch.decode_lengths, scale)
        ) is not None:
            return out
    # The g query heads that share a kv head go in as g query rows of that head: plain SDPA, no
    # GQA expansion (6× faster in bfloat16 at 32 sequences, the same bits).
    q = q.unflatten(1, (kv_heads, -1))  # [decodes, kv_heads, g, hd]
    mask = batch.decode_mask
    attend = F.scaled_dot_product_attention
    if window is not None or sinks is not None:  # gpt-oss
        mask = _mask(batch, -1, window, sinks is not None)
        sinks = None if sinks is None else sinks.view(kv_heads, -1, 1)  # [kv_heads, g, 1]

        def attend(q, k, v, attn_mask):
            return _attend(q, k, v, attn_mask, sinks)

    step = cache.group(tables.shape[1])
    if step >= d:
        ks, vs = cache.gather(layer, tables)  # [decodes, kv_heads, blocks * bs, hd]
        o = attend(q, ks, vs, attn_mask=mask)
    else:  # long contexts: a few sequences at a time, gathered where SDPA reads them fastest
        o = torch.empty_like(q)
        for s in range(0, d, step):
            seqs = slice(s, s + step)
            ks, vs = cache.gather(layer, tables, seqs)
            o[seqs] = attend(q[seqs], ks, vs, attn_mask=mask[seqs])
    return o.flatten(1, 2)  # [decodes, heads, hd]
