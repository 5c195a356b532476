"""A slot-based KV cache: one slot per running sequence, grown geometrically on demand."""

from __future__ import annotations

import torch


class KVCache:
    """k[layer], v[layer]: [slots, kv_heads, capacity, head_dim]. Slot i belongs to one sequence."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        slots: int = 4,
        capacity: int = 128,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = (
            num_layers,
            kv_heads,
            head_dim,
            dtype,
        )
        self.k = [self._alloc(slots, capacity) for _ in range(num_layers)]
        self.v = [self._alloc(slots, capacity) for _ in range(num_layers)]

    def _alloc(self, slots: int, capacity: int) -> torch.Tensor:
        return torch.zeros(slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.k[0].numel() * self.k[0].element_size()

    def reserve(self, slots: int, length: int) -> None:
        """Make room for `slots` sequences of up to `length` tokens (doubling to amortise copies)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots, new_cap = self.slots, self.capacity
        while new_slots < slots:
            new_slots *= 2
        while new_cap < length:
            new_cap *= 2
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                grown = self._alloc(new_slots, new_cap)
                grown[: old.shape[0], :, : old.shape[2]] = old
                cache[i] = grown

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store keys/values [tokens, kv_heads, head_dim] at (slot, position) per token."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first `length` cached tokens from slot src to slot dst."""
        for cache in (self.k, self.v):
            for t in cache:
                t[dst, :, :length] = t[src, :, :length]
