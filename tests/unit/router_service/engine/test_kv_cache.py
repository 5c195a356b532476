"""KVCache: writes land at (block, offset) of their layer only, gathers give a sequence's tokens in
order whatever blocks hold them; the pool's size from kv_cache_bytes, and its start-up errors."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidArgumentError
from router_service.engine import kv_cache
from router_service.engine.kv_cache import AUTO_SHARE, KVCache, block_bytes, num_blocks

LAYERS, HEADS, DIM, BS = 2, 3, 4, 4


def cache(blocks: int = 6) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, torch.float32, blocks, BS)


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    """n distinct [kv_heads, head_dim] entries, one per token."""
    return torch.arange(n * HEADS * DIM, dtype=torch.float32).view(n, HEADS, DIM) + start


def test_shapes_and_bytes_are_fixed_up_front() -> None:
    c = cache(blocks=6)
    assert c.k.shape == c.v.shape == (LAYERS, HEADS, 6, BS, DIM)
    assert c.nbytes == 6 * block_bytes(LAYERS, HEADS, DIM, torch.float32, BS)
    assert c.k.count_nonzero() == 0  # zero-filled: padding read under a mask is finite


def test_a_scratch_block_is_one_more_block_the_pool_never_hands_out() -> None:
    c = KVCache(LAYERS, HEADS, DIM, torch.float32, 6, BS, scratch=True)
    assert c.pool_blocks == 6 and c.num_blocks == 7 and c.k.shape[2] == 7
    assert c.scratch_slot == 6 * BS  # the extra block's first slot
    c.write(0, torch.tensor([c.scratch_slot]), rows(1), rows(1))
    assert c.k[0, :, :6].count_nonzero() == 0  # nothing a sequence owns was written
    plain = cache(blocks=6)
    assert plain.pool_blocks == plain.num_blocks == 6 and plain.scratch_slot is None


def test_write_stores_each_token_at_its_block_and_offset_in_its_layer_only() -> None:
    c = cache()
    k, v = rows(3), rows(3, start=1000)
    c.write(1, torch.tensor([2 * BS + 1, 0, 5 * BS + 3]), k, v)
    assert torch.equal(c.k[1, :, 2, 1], k[0]) and torch.equal(c.v[1, :, 2, 1], v[0])
    assert torch.equal(c.k[1, :, 0, 0], k[1]) and torch.equal(c.v[1, :, 5, 3], v[2])
    assert c.k[0].count_nonzero() == 0 and c.v[0].count_nonzero() == 0  # other layer untouched
    assert c.k[1].count_nonzero() == 3 * HEADS * DIM - 1  # nothing else (k[1][0,0] has a 0 entry)


def test_gather_returns_each_sequences_tokens_in_order_from_scattered_blocks() -> None:
    c = cache()
    tables = [[4, 1], [0, 5]]  # two sequences of 8 tokens, blocks out of order
    for layer in range(LAYERS):
        for i, table in enumerate(tables):
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(2 * BS)])
            c.write(layer, slots, rows(2 * BS, 100 * i + layer), rows(2 * BS, -100 * i))
    ks, vs = c.gather(1, torch.tensor(tables))
    assert ks.shape == vs.shape == (2, HEADS, 2 * BS, DIM)  # [seqs, kv_heads, tokens, hd]
    for i in range(2):
        assert torch.equal(ks[i], rows(2 * BS, 100 * i + 1).transpose(0, 1))
        assert torch.equal(vs[i], rows(2 * BS, -100 * i).transpose(0, 1))
        assert ks[i, 0].is_contiguous()  # each head's context one matrix, as SDPA reads best
    # The workspace is reused: a smaller gather needs no new buffer, a larger one grows it.
    work = c._work
    one_k, _ = c.gather(0, torch.tensor([[5]]))  # the second block of sequence 1, layer 0
    assert c._work is work and torch.equal(one_k[0], rows(2 * BS, 100)[BS:].transpose(0, 1))
    c.gather(0, torch.tensor([[0, 1, 4, 5, 0, 1]]))
    assert c._work is not work


def test_a_few_sequences_at_a_time_gather_the_same_contexts(monkeypatch) -> None:
    c = cache(blocks=8)
    c.k.normal_(generator=torch.Generator().manual_seed(1))
    c.v.normal_(generator=torch.Generator().manual_seed(2))
    tables = torch.tensor([[4, 1], [0, 5], [7, 7], [2, 3]])
    all_k, all_v = (t.clone() for t in c.gather(0, tables))
    for seqs in (slice(0, 1), slice(1, 3), slice(3, 4)):
        k, v = c.gather(0, tables, seqs)
        assert torch.equal(k, all_k[seqs]) and torch.equal(v, all_v[seqs])
    per_seq = 2 * HEADS * 2 * BS * DIM * 4  # keys and values of one 2-block context
    monkeypatch.setattr(kv_cache, "GATHER_BYTES", 3 * per_seq)
    assert c.group(2) == 3 and c.group(100) == 1  # at least one sequence


BLOCK = 1000  # bytes


@pytest.mark.parametrize(
    ("setting", "blocks"),
    [
        ("64000", 64),
        ("64KB", 64),
        ("1MiB", 2**20 // BLOCK),
        ("10%", 10_000 // BLOCK),  # of the 100 kB available below
        ("auto", 30),  # 30% of the available memory: 30 blocks
    ],
)
def test_num_blocks_from_the_setting(setting: str, blocks: int) -> None:
    assert AUTO_SHARE == 0.3
    assert (
        num_blocks(setting, BLOCK, BS, max_model_len=40, max_num_seqs=8, available=100_000)
        == blocks
    )


def test_auto_is_capped_by_what_the_batch_can_use_and_holds_at_least_one_sequence() -> None:
    # 8 sequences of 40 tokens use 80 blocks at most, whatever the memory.
    assert num_blocks("auto", BLOCK, BS, 40, 8, available=10**12) == 80
    # Too little memory: still one sequence of max_model_len (10 blocks).
    assert num_blocks("auto", BLOCK, BS, 40, 8, available=1000) == 10


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("9000", "holds 36 tokens .* fewer than one sequence of max_model_len=40"),
        ("1%", "holds 4 tokens"),
        ("lots", "not a size"),
        ("150%", "at most 100%"),
    ],
)
def test_a_budget_that_cannot_hold_one_sequence_is_a_start_up_error_naming_the_field(
    setting: str, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as info:
        num_blocks(setting, BLOCK, BS, max_model_len=40, max_num_seqs=8, available=100_000)
    assert info.value.field == "kv_cache_bytes"
