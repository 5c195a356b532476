"""BlockPool and block keys: reference counts, publishing, LRU eviction of released cached blocks,
and keys that name a whole prefix."""

from __future__ import annotations

import pytest

from router_service.engine.blocks import BlockPool, block_key


def chain(*blocks: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    for tokens in blocks:
        keys.append(block_key(keys[-1] if keys else None, tokens))
    return keys


def test_a_key_names_the_tokens_and_everything_before_them() -> None:
    a, b = chain([1, 2], [3, 4]), chain([9, 2], [3, 4])
    assert a[0] != b[0] and a[1] != b[1]  # same block tokens, other prefix: other key
    assert chain([1, 2], [3, 4]) == a  # deterministic (across processes too: no salted hash)
    assert block_key(None, [1, 2]) != block_key(None, [2, 1])
    assert block_key(None, [1, 2, 3]) != block_key(None, [1, 2])
    assert len(a[0]) == 16


def test_allocate_and_release_count_references() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used == 3 and pool.num_free == 1
    assert all(pool.refs[b] == 1 for b in a)
    pool.release(a)
    assert pool.num_free == 4 and pool.num_cached == 0  # unpublished: simply free
    with pytest.raises(MemoryError):
        pool.allocate(5)


def test_published_blocks_are_found_along_the_chain_and_shared_by_reference() -> None:
    pool = BlockPool(8)
    keys = chain([1, 2], [3, 4], [5, 6])
    owner = pool.allocate(3)
    assert pool.match(keys) == []  # nothing published yet: written is not enough
    for b, k in zip(owner[:2], keys):
        assert pool.publish(b, k)
    assert pool.match(keys) == owner[:2]  # the run stops at the first unpublished block
    assert pool.match(chain([0, 2], [3, 4])) == []  # another first block: nothing in common
    hits = pool.match(keys)
    assert pool.cost(hits) == 0  # referenced already: taking them uses no free block
    pool.take(hits)
    assert [pool.refs[b] for b in owner] == [2, 2, 1]
    pool.release(owner)
    assert pool.num_cached == 0 and pool.num_used == 2  # the sharer still holds them
    pool.release(hits)
    assert pool.num_cached == 2 and pool.num_used == 0 and pool.num_free == 8
    assert pool.match(keys) == owner[:2]  # released, still cached
    assert pool.cost(owner[:2]) == 2


def test_a_key_is_published_once_and_not_when_caching_is_off() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    key = block_key(None, [1, 2])
    assert pool.publish(a, key)
    assert not pool.publish(b, key)  # computed twice at once: the second copy stays private
    assert not pool.publish(a, block_key(None, [7]))  # a block has one key
    pool.release([b])
    assert pool.num_cached == 0  # the private copy went back to the free list
    off = BlockPool(2, caching=False)
    block = off.allocate(1)[0]
    assert not off.publish(block, key) and off.match([key]) == []


def test_cached_blocks_are_evicted_least_recently_released_first_and_only_when_needed() -> None:
    pool = BlockPool(4)
    keys = chain([1], [2], [3])
    first = pool.allocate(3)
    for b, k in zip(first, keys):
        pool.publish(b, k)
    pool.release(first)  # tail first: the last block is the least recently released
    spare = pool.allocate(1)  # the free list still has one: no eviction
    assert pool.match(keys) == first
    got = pool.allocate(1)
    assert got == [first[2]]  # the tail went first
    assert pool.match(keys) == first[:2] and pool.refs[first[2]] == 1
    pool.take(pool.match(keys[:1]))  # a hit makes it recently used and referenced
    assert pool.allocate(1) == [first[1]]
    assert pool.match(keys) == first[:1]
    with pytest.raises(MemoryError):
        pool.allocate(1)  # the referenced hit is never evicted
    pool.release(spare + got)
    assert pool.num_free == 2


def test_reset_forgets_everything() -> None:
    pool = BlockPool(3)
    b = pool.allocate(2)
    pool.publish(b[0], block_key(None, [1]))
    pool.reset()
    assert pool.num_free == 3 and pool.num_cached == 0 and pool.match([block_key(None, [1])]) == []
