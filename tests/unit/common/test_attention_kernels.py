"""moe-mesh's attention kernels (common/attention_kernels.py): RoPE and the KV-cache write give
torch's bits, decode attention read in place equals SDPA over the gathered context, a decode
step's attention in one call equals its three kernels in turn, and what a kernel cannot take is
left to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import attention_kernels, bf16
from tests.support.kernels import paged

pytestmark = pytest.mark.skipif(
    bf16.level() < 1, reason="no C compiler or no AVX2+FMA here: the kernels cannot run"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "d"), [(1, 20, 64), (7, 6, 128), (33, 3, 16)])
def test_rope_gives_the_bits_of_torchs_three_ops(dtype, tokens, heads, d, isa) -> None:
    gen = torch.Generator().manual_seed(d)
    qkv = (torch.randn(tokens, heads + 4, d, generator=gen) * 3).to(dtype)
    qkv[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    qkv[0, 1, d // 2 : d // 2 + 3] = torch.tensor([1e-39, -1e-39, 0.0])  # turned: -x, -0 for +0
    qkv[0, 1, 2] = -0.0  # -0 * cos + -(+0) * sin: -0
    x = qkv[:, :heads]  # q and k of a fused projection: a view, tokens heads + 4 rows apart
    angle = torch.randn(tokens, 1, d, generator=gen) * 100
    angle[0, 0, 2] = 0.5  # cos and sin both positive
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    half = d // 2
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    got = attention_kernels.rope(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    numbers = ~want.isnan()  # and zeros' signs too
    assert torch.equal(got.view(bits)[numbers], want.view(bits)[numbers])


def test_rope_leaves_what_it_cannot_take_to_torch() -> None:
    x, cs = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    assert attention_kernels.rope(x.half(), cs.half(), cs.half()) is None  # float16
    assert (
        attention_kernels.rope(x, cs.bfloat16(), cs.bfloat16()) is None
    )  # cos/sin of another dtype
    assert (
        attention_kernels.rope(x[..., :7], cs[..., :7], cs[..., :7]) is None
    )  # odd width, strided
    assert attention_kernels.rope(x[:0], cs[:0], cs[:0]) is None  # no tokens
    assert attention_kernels.rope(x, cs[:1], cs[:1]) is None  # one token's cos/sin for two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_stores_what_index_copy_stores(dtype) -> None:
    k_cache, v_cache = paged(dtype, 2, 32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(3, 8, 32).to(dtype)  # [tokens, q heads 4 | k heads 2 | v heads 2, dim]
    k, v, slots = qkv[:, 4:6], qkv[:, 6:], torch.tensor([5, 200, 17])  # tokens 256 apart
    assert attention_kernels.kv_write(k, v, slots, k_cache, v_cache)
    for cache, new in ((want_k, k), (want_v, v)):
        cache.view(2, -1, 32).index_copy_(1, slots, new.transpose(0, 1))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(2, 4, 64), (4, 1, 32), (1, 3, 128)])
def test_decode_attention_in_place_is_sdpa_over_the_gathered_context(
    dtype, kv_heads, group, dim, isa
) -> None:
    k_cache, v_cache = paged(dtype, kv_heads, dim)
    gen = torch.Generator().manual_seed(kv_heads)
    lengths = torch.tensor([1, 37, 150])
    tables = torch.stack([torch.randperm(64, generator=gen)[:38] for _ in range(3)])  # shuffled
    q = torch.randn(3, kv_heads * group, dim, generator=gen).to(dtype)
    got = attention_kernels.decode_attention(q, k_cache, v_cache, tables, lengths, dim**-0.5)

    def context(cache: torch.Tensor) -> torch.Tensor:  # [seqs, kv_heads, tokens, dim]
        return cache[:, tables].flatten(2, 3).transpose(0, 1)

    mask = (torch.arange(38 * 4) < lengths[:, None])[:, None, None, :]
    q4 = q.unflatten(1, (kv_heads, group))
    sdpa, exact = (
        F.scaled_dot_product_attention(
            q4.to(t), context(k_cache).to(t), context(v_cache).to(t), attn_mask=mask
        ).flatten(1, 2)  # [seqs, heads, dim]
        for t in (dtype, torch.float64)
    )
    scale = exact.abs().amax(-1, keepdim=True)  # errors relative to each row's largest output
    ours, theirs = ((t.double() - exact) / scale for t in (got, sdpa))
    assert got.shape == (3, kv_heads * group, dim) and got.dtype == dtype
    if dtype == torch.float32:
        assert ours.abs().max() < 1e-5
    else:  # as close as SDPA's own bfloat16 result: both round probabilities and output
        assert ours.abs().max() <= theirs.abs().max() * 2
        assert ours.abs().mean() <= theirs.abs().mean() * 1.1


def test_attention_kernels_leave_what_they_cannot_take_to_torch() -> None:
    k_cache, v_cache = paged(torch.float32, 2, 24)  # a head dimension not a multiple of 16
    q = torch.randn(1, 2, 24)
    tables, lengths = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1])
    assert attention_kernels.decode_attention(q, k_cache, v_cache, tables, lengths, 0.2) is None
    k_cache, v_cache = paged(torch.float32, 2, 32)
    assert (
        attention_kernels.decode_attention(
            q.new_zeros(1, 2, 32).bfloat16(), k_cache, v_cache, tables, lengths, 0.2
        )
        is None
    )
    assert (
        attention_kernels.decode_attention(
            torch.randn(1, 3, 32), k_cache, v_cache, tables, lengths, 0.2
        )
        is None
    )
    k = torch.randn(1, 2, 32)
    assert not attention_kernels.kv_write(k.double(), k.double(), lengths, k_cache, v_cache)
    assert not attention_kernels.kv_write(
        k.transpose(1, 2).contiguous().transpose(1, 2), k, lengths, k_cache, v_cache
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_attention_in_one_call_is_its_three_kernels_in_turn(dtype, isa) -> None:
    heads, kv_heads, dim = 4, 2, 32
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos, sin = (torch.randn(3, 1, dim, generator=gen).to(dtype) for _ in range(2))
    lengths = torch.tensor([3, 9, 17])
    tables = torch.stack([torch.randperm(64, generator=gen)[:5] for _ in range(3)])
    slots = tables.gather(1, ((lengths - 1) // 4)[:, None])[:, 0] * 4 + (lengths - 1) % 4
    fused_cache, apart_cache = paged(dtype, kv_heads, dim), paged(dtype, kv_heads, dim)
    fused = attention_kernels.decode_step_attention(
        qkv, (cos, sin), slots, *fused_cache, tables, lengths, 4, 0.3
    )

    rows = qkv.view(3, heads + 2 * kv_heads, dim)
    qk = attention_kernels.rope(rows[:, : heads + kv_heads], cos, sin)
    assert attention_kernels.kv_write(
        qk[:, heads:], rows[:, heads + kv_heads :], slots, *apart_cache
    )
    apart = attention_kernels.decode_attention(qk[:, :heads], *apart_cache, tables, lengths, 0.3)
    assert torch.equal(fused, apart)
    assert all(torch.equal(a, b) for a, b in zip(fused_cache, apart_cache))
