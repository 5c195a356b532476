"""moe-mesh's attention kernels (bf16_kernel.c, built and loaded by common.bf16): RoPE, the
KV-cache write, and decode attention read in place from the paged cache, in float32 and
bfloat16, each one call instead of several torch calls (a decode step at batch 1 runs a few
hundred small ops, and each torch call costs tens of microseconds once the weights have streamed
through the caches). RoPE and the KV write round as torch's ops round; attention does not
reproduce SDPA's exp and summation order, so its outputs may differ from SDPA's in the last bit.
Each returns None (or False) where its kernel cannot take the tensors: torch computes them.
"""

from __future__ import annotations

import torch

from common.bf16 import FLOATS, call, dense, kernel

_ROPE = {torch.float32: "moe_rope_f32", torch.bfloat16: "moe_rope_bf16"}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [tokens, heads, d] rotated by cos, sin [tokens, 1, d]: x * cos + rotate_half(x) * sin in
    one call instead of six torch calls, rounded as those ops round (float32 or bfloat16, so the
    same bits); None where the kernel cannot take them."""
    run = kernel(_ROPE[x.dtype]) if x.dtype in _ROPE else None
    if run is None or x.dim() != 3 or x.device.type != "cpu" or not x.numel():
        return None
    n, heads, d = x.shape
    if not _rows_of_heads(x) or d % 2 or {cos.dtype, sin.dtype} != {x.dtype}:
        return None
    if cos.numel() != n * d or sin.numel() != n * d:
        return None
    c, s = dense(cos), dense(sin)  # held for the call: [n, 1, d] is [n, d] in memory
    out = torch.empty(n, heads, d, dtype=x.dtype)
    run(x.data_ptr(), x.stride(0), c.data_ptr(), s.data_ptr(), out.data_ptr(), n, heads, d)
    return out


def _rows_of_heads(t: torch.Tensor) -> bool:
    """Whether t [tokens, heads, dim] has contiguous heads (tokens may be further apart)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _takes_cache(
    name: str, dtype: torch.dtype, cache_k: torch.Tensor, cache_v: torch.Tensor
) -> bool:
    """Whether KV kernel `name` takes a layer's cache [kv_heads, blocks, block_size, dim] whose
    tensors hold `dtype`: float32 or bfloat16, contiguous, and the kernel runs here."""
    return (
        cache_k.device.type == "cpu"  # first: on a GPU the C library is not even built
        and kernel(name) is not None
        and dtype in FLOATS
        and {cache_k.dtype, cache_v.dtype} == {dtype}
        and cache_k.is_contiguous()
        and cache_v.is_contiguous()
    )


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> bool:
    """Store keys/values [tokens, kv_heads, dim] at `slots` of one layer's cache [kv_heads,
    blocks, block_size, dim] in one call (index_copy_ over transposed views takes two plus
    theirs); False where the kernel cannot take them."""
    dtype = k.dtype
    if (
        not _takes_cache("moe_kv_write", dtype, cache_k, cache_v)
        or v.dtype != dtype
        or not (_rows_of_heads(k) and _rows_of_heads(v))
        or slots.dtype != torch.int64
    ):
        return False
    heads, blocks, block_size = cache_k.shape[:3]
    s = dense(slots)
    new = (dtype == torch.bfloat16, k, k.stride(0), v, v.stride(0), s, s.numel())
    geometry = (heads, k.shape[2], v.shape[2], blocks * block_size)
    call(kernel("moe_kv_write"), *new, *geometry, cache_k, cache_v)
    return True


def decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one new token per sequence, q [decodes, heads, dim] (heads contiguous, the g
    sharing a KV head adjacent), over its first lengths[s] cached tokens, read through its block
    table from one layer's cache [kv_heads, blocks, block_size, dim]: [decodes, heads, v_dim].
    One call instead of gathering the contexts and calling SDPA; None where it cannot."""
    dtype = q.dtype
    kv_heads, blocks, block_size, hd = cache_k.shape
    vd = cache_v.shape[3]
    d, heads = q.shape[:2]
    if (
        not _takes_cache("moe_decode_attention", dtype, cache_k, cache_v)
        or not _rows_of_heads(q)
        or q.shape[2] != hd
        or heads % kv_heads
        or hd % 16
        or vd % 16
    ):
        return None
    t, n = dense(tables), dense(lengths)  # held here while the kernel reads them
    out = torch.empty(d, heads, vd, dtype=dtype)
    inputs = (dtype == torch.bfloat16, q, q.stride(0), cache_k, cache_v, t, t.shape[1], n)
    geometry = (d, kv_heads, heads // kv_heads, hd, vd, blocks, block_size)
    run = kernel("moe_decode_attention")
    if d and call(run, *inputs, *geometry, scale, out, torch.get_num_threads()):
        raise MemoryError("decode attention: no memory for a context's scores")
    return out


def decode_step_attention(
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    heads: int,
    scale: float,
) -> torch.Tensor | None:
    """A step of decodes only, from the qkv product [decodes, (heads + 2 * kv_heads) * dim] to
    attention's output [decodes, heads, dim], in one call: `rope` of q and k by cos, sin
    [decodes, 1, dim], `kv_write` at `slots`, then `decode_attention`. None where it cannot."""
    dtype, d = qkv.dtype, qkv.shape[0]
    kv_heads, blocks, block_size, hd = cache_k.shape
    if (
        not _takes_cache("moe_decode_step_attention", dtype, cache_k, cache_v)
        or {cos_sin[0].dtype, cos_sin[1].dtype} != {dtype}
        or {cos_sin[0].numel(), cos_sin[1].numel()} != {d * hd}
        or qkv.dim() != 2
        or qkv.stride(1) != 1
        or qkv.shape[1] != (heads + 2 * kv_heads) * hd
        or cache_v.shape[3] != hd
        or heads % kv_heads
        or hd % 16
        or slots.dtype != torch.int64
        or not d
    ):
        return None
    cos, sin = (dense(c) for c in cos_sin)  # held for the call: [d, 1, hd] is [d, hd]
    t, n, s = dense(tables), dense(lengths), dense(slots)
    qk = torch.empty(d, heads + kv_heads, hd, dtype=dtype)
    out = torch.empty(d, heads, hd, dtype=dtype)
    inputs = (dtype == torch.bfloat16, qkv, qkv.stride(0), cos, sin, qk, s, cache_k, cache_v)
    geometry = (d, heads, kv_heads, hd, blocks, block_size)
    run = kernel("moe_decode_step_attention")
    if call(run, *inputs, t, t.shape[1], n, *geometry, scale, out, torch.get_num_threads()):
        raise MemoryError("decode attention: no memory for a context's scores")
    return out
