"""Sliding windows and attention sinks (gpt-oss) against transformers' eager attention and masks,
for a prefill chunk past cached tokens and for batched decodes of different lengths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from router_service.engine.layers import _attend, _mask
from router_service.engine.model import pack_step

HEADS, KV_HEADS, HD = 4, 2, 16


def reference(q, k, v, sinks, allowed) -> torch.Tensor:
    """transformers' eager gpt-oss attention. q [1, heads, n, hd], k/v [1, kv_heads, keys, hd],
    allowed [n, keys] -> [1, heads, n, hd]."""
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=HD**-0.5)
    return out.transpose(1, 2)


def hf_allowed(queries: range, keys: int, window: int | None) -> torch.Tensor:
    """transformers' mask functions (masking_utils) for these query positions: bool [queries, keys]."""
    rule = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return rule(0, 0, torch.tensor(queries)[:, None], torch.arange(keys)[None]).expand(-1, keys)


@pytest.mark.parametrize("window", [None, 1, 4, 64])
def test_a_prefill_chunk_past_cached_tokens(window) -> None:
    torch.manual_seed(0)
    start, n = 9, 7
    batch = pack_step(
        [(list(range(8)), 0, [1] * 5), (list(range(8, 16)), start, [2] * n)], [], 4
    ).attention
    allowed = _mask(batch, 1, window, sink=True)
    assert torch.equal(allowed[:, :-1], hf_allowed(range(start, start + n), start + n, window))
    assert allowed[:, -1].all()  # the sink is always seen
    assert _mask(batch, 1, window, sink=True) is allowed  # made once per step
    q, k, v = torch.randn(1, HEADS, n, HD), *torch.randn(2, 1, KV_HEADS, start + n, HD)
    sinks = 2 * torch.randn(HEADS)
    ours = _attend(q, k, v, allowed, sinks[:, None, None], gqa=True)
    assert (ours - reference(q, k, v, sinks, allowed[:, :-1])).abs().max() < 1e-6


@pytest.mark.parametrize("window", [None, 3])
def test_batched_decodes(window) -> None:
    torch.manual_seed(1)
    lengths = [1, 6, 13]
    batch = pack_step(
        [], [(list(range(4 * i, 4 * i + 4)), 5, n) for i, n in enumerate(lengths)], 4
    ).attention
    allowed = _mask(batch, -1, window, sink=True)  # [decodes, 1, 1, blocks * 4 + 1]
    keys = allowed.shape[-1] - 1
    q = torch.randn(len(lengths), KV_HEADS, HEADS // KV_HEADS, HD)  # grouped, as decode runs it
    k, v = torch.randn(2, len(lengths), KV_HEADS, keys, HD)
    sinks = 2 * torch.randn(HEADS)
    ours = _attend(q, k, v, allowed, sinks.view(KV_HEADS, -1, 1))
    for s, n in enumerate(lengths):
        want_allowed = hf_allowed(range(n - 1, n), n, window)
        assert (
            torch.equal(allowed[s, 0, 0, :n], want_allowed[0]) and not allowed[s, 0, 0, n:-1].any()
        )
        want = reference(
            q[s].reshape(1, HEADS, 1, HD), k[s, None, :, :n], v[s, None, :, :n], sinks, want_allowed
        )
        assert (ours[s].reshape(HEADS, HD) - want[0, :, 0]).abs().max() < 1e-6


def test_without_sinks_a_window_is_a_plain_masked_sdpa() -> None:
    batch = pack_step([(list(range(8)), 0, list(range(10)))], [], 4).attention
    allowed = _mask(batch, 0, 3, sink=False)
    assert torch.equal(allowed, hf_allowed(range(10), 10, 3))
    q, k, v = torch.randn(3, 1, HEADS, 10, HD)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert torch.equal(_attend(q, k, v, allowed, None), want)
