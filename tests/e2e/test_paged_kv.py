"""The paged KV cache keeps float32 output token-identical to transformers: across prefix-cache hits,
preemption (recompute) and chunked prefill, alone and with micro-batches."""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

import pytest

from common.checkpoint import Checkpoint
from common.sampling import SamplingParams
from router_service.build import build_model
from router_service.engine import kv_cache
from router_service.engine.engine import Engine, FinishReason
from router_service.settings import RouterSettings
from tests.support.hf import greedy_tokens, load
from tests.support.reference import PROMPTS

NEW_TOKENS = 24
BS = 4
FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "dbrx", "gpt_oss", "glm4_moe"]


@cache
def _hf_greedy(path: Path, prompt: tuple[int, ...], n: int = NEW_TOKENS) -> list[int]:
    return greedy_tokens(load(path), prompt, n)


def paged(path: Path, blocks: int, **settings) -> Engine:
    s = RouterSettings(checkpoint=path, kv_block_size=BS, **settings)
    model = build_model(Checkpoint(path), s)
    return Engine(model, s, model.new_cache(blocks, BS))


async def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(NEW_TOKENS, 0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in await engine.step():
            assert o.error is None and o.finish_reason in (None, FinishReason.LENGTH)
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def want(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [_hf_greedy(path, tuple(p)) for p in prompts]


@pytest.fixture(params=FAMILIES, scope="module")
def path(request, checkpoint) -> Path:
    return checkpoint(request.param)


@pytest.mark.parametrize("micro_batches", ["1", "2"])
def test_prefix_cache_hits_give_transformers_tokens(path: Path, micro_batches: str) -> None:
    engine = paged(path, 256, micro_batches=micro_batches)
    base = PROMPTS[3]  # 29 tokens
    first = asyncio.run(generate(engine, [base]))
    assert first == want(path, [base]) and engine.scheduler.prefix_hit_tokens == 0
    # The same prompt, a prompt sharing 5 blocks, and one continuing the generated sequence (its
    # blocks written by decode steps): all run together, sharing the cached blocks read-only.
    prompts = [base, base[:20] + [5, 6, 7], base + first[0][:9], PROMPTS[2]]
    assert asyncio.run(generate(engine, prompts)) == want(path, prompts)
    s = engine.scheduler
    assert s.prefix_hit_tokens == 28 + 20 + 36  # (29-1)//4, (23-1)//4, (38-1)//4 blocks
    assert s.prefix_hit_tokens / s.prefix_query_tokens > 0.5


@pytest.mark.parametrize("micro_batches", ["1", "2"])
def test_preemption_mid_decode_gives_transformers_tokens(path: Path, micro_batches: str) -> None:
    # 30 blocks of 4 tokens: the four prompts plus 24 new tokens need 8 + 8 + 10 + 14 blocks.
    engine = paged(path, 30, micro_batches=micro_batches)
    assert asyncio.run(generate(engine, PROMPTS)) == want(path, PROMPTS)
    assert engine.scheduler.preemptions > 0
    assert engine.scheduler.pool.num_used == 0


@pytest.mark.parametrize("micro_batches", ["1", "2"])
def test_chunked_prefill_gives_transformers_tokens(path: Path, micro_batches: str) -> None:
    # No prefix caching: every prompt token goes through the chunks.
    engine = paged(
        path, 256, max_prefill_tokens=5, micro_batches=micro_batches, enable_prefix_caching=False
    )
    assert asyncio.run(generate(engine, PROMPTS)) == want(path, PROMPTS)


def test_decode_attention_a_sequence_at_a_time_gives_transformers_tokens(
    path: Path, monkeypatch
) -> None:
    """Long contexts are gathered a few sequences at a time (kv_cache.GATHER_BYTES): the same
    tokens as gathering them all at once."""
    monkeypatch.setattr(kv_cache, "GATHER_BYTES", 1)  # one sequence per group
    engine = paged(path, 256)
    assert engine.cache.group(1) == 1
    assert asyncio.run(generate(engine, PROMPTS)) == want(path, PROMPTS)
