"""KVCache: per-token writes land at (slot, position), growth keeps what is cached, moves copy a prefix."""

from __future__ import annotations

import torch

from moe_mesh.router_service.engine.kv_cache import KVCache

LAYERS, HEADS, DIM = 2, 3, 4


def cache(slots: int = 2, capacity: int = 4) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, torch.float32, slots=slots, capacity=capacity)


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    """n distinct [kv_heads, head_dim] entries, one per token."""
    return torch.arange(n * HEADS * DIM, dtype=torch.float32).view(n, HEADS, DIM) + start


def test_shapes_and_bytes() -> None:
    c = cache(slots=2, capacity=4)
    assert (c.slots, c.capacity) == (2, 4)
    assert all(t.shape == (2, HEADS, 4, DIM) for t in c.k + c.v)
    assert c.nbytes == 2 * LAYERS * 2 * HEADS * 4 * DIM * 4


def test_write_stores_each_token_at_its_slot_and_position_in_its_layer_only() -> None:
    c = cache()
    k, v = rows(3), rows(3, start=1000)
    c.write(1, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3]), k, v)
    assert torch.equal(c.k[1][0, :, 2], k[0]) and torch.equal(c.v[1][0, :, 2], v[0])
    assert torch.equal(c.k[1][1, :, 0], k[1]) and torch.equal(c.k[1][1, :, 3], k[2])
    assert torch.equal(c.v[1][1, :, 3], v[2])
    assert c.k[0].count_nonzero() == 0 and c.v[0].count_nonzero() == 0  # other layer untouched
    assert c.k[1][0, :, [0, 1, 3]].count_nonzero() == 0  # other positions untouched


def test_reserve_doubles_until_it_fits_and_keeps_what_is_cached() -> None:
    c = cache(slots=2, capacity=4)
    k = rows(2)
    c.write(0, torch.tensor([1, 1]), torch.tensor([0, 3]), k, k + 1)
    before = [t.clone() for t in c.k + c.v]
    c.reserve(slots=2, length=4)  # already fits: no reallocation
    assert all(a is b or torch.equal(a, b) for a, b in zip(c.k + c.v, before))
    c.reserve(slots=5, length=9)
    assert (c.slots, c.capacity) == (8, 16)  # powers of two times the old size, not exact fits
    for grown, old in zip(c.k + c.v, before):
        assert torch.equal(grown[:2, :, :4], old)
        assert grown[2:].count_nonzero() == 0 and grown[:, :, 4:].count_nonzero() == 0
    c.reserve(slots=3, length=17)  # one dimension at a time
    assert (c.slots, c.capacity) == (8, 32)


def test_move_copies_a_prefix_to_another_slot_in_every_layer() -> None:
    c = cache(slots=3, capacity=4)
    for layer in range(LAYERS):
        c.write(layer, torch.tensor([2] * 4), torch.arange(4), rows(4, 10 * layer), rows(4, -5))
    c.move(src=2, dst=0, length=3)
    for layer in range(LAYERS):
        assert torch.equal(c.k[layer][0, :, :3], c.k[layer][2, :, :3])
        assert torch.equal(c.v[layer][0, :, :3], c.v[layer][2, :, :3])
        assert c.k[layer][0, :, 3].count_nonzero() == 0  # only the first `length` tokens
    assert c.k[0][1].count_nonzero() == 0  # the third slot is untouched
