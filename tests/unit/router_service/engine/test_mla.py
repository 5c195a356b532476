"""Multi-head latent attention: the cache holds a latent and a rope key per token and layer, not
per-head keys and values; decode over that latent (weights absorbed) computes what prefill's
expanded form does over the same cache."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import Checkpoint
from router_service.build import build_model
from router_service.engine import kv_cache
from router_service.engine.layers import attention
from router_service.engine.model import pack_step
from router_service.settings import RouterSettings

BS = 4


@pytest.fixture(scope="module")
def model(checkpoint):
    return build_model(Checkpoint(checkpoint("deepseek_v3")), RouterSettings())


def test_the_cache_holds_the_latent_and_the_rope_key_per_token(model) -> None:
    s, m = model.spec, model.spec.mla
    latent = s.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4  # float32 bytes per token
    full = s.num_layers * s.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert model.block_bytes(BS) == BS * latent and latent * 4 == full  # tiny: a quarter
    cache = model.new_cache(5, BS)
    assert cache.nbytes == 5 * BS * latent
    assert (cache.kv_heads, cache.head_dim, cache.v_dim) == (1, m.kv_lora_rank, m.qk_rope_head_dim)


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_decode_matches_a_one_token_prefill_chunk(model, monkeypatch, one_at_a_time) -> None:
    if one_at_a_time:  # contexts gathered a sequence at a time
        monkeypatch.setattr(kv_cache, "GATHER_BYTES", 1)
    s, w = model.spec, model.weights.layers[1].attention
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(16, BS)
    tables, lengths = [[3, 0, 5], [7, 2, 9, 4]], [7, 10]
    prompt = pack_step([(t, 0, [1] * n) for t, n in zip(tables, lengths)], [], BS).attention
    attention(
        torch.randn(sum(lengths), s.hidden_size, generator=gen), w, s, model.rope, prompt, cache, 1
    )
    x = torch.randn(2, s.hidden_size, generator=gen)
    decode = pack_step([], [(t, 1, n + 1) for t, n in zip(tables, lengths)], BS).attention
    chunk = pack_step([(t, n, [1]) for t, n in zip(tables, lengths)], [], BS).attention
    decoded = attention(x, w, s, model.rope, decode, cache, 1)
    expanded = attention(x, w, s, model.rope, chunk, cache, 1)
    assert torch.allclose(decoded, expanded, atol=1e-5, rtol=0)
