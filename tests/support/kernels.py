"""Inputs shared by the tests of moe-mesh's C kernels."""

from __future__ import annotations

import torch


def paged(dtype: torch.dtype, kv_heads: int, dim: int, block_size: int = 4, blocks: int = 64):
    """A layer's cache, random: k and v [kv_heads, blocks, block_size, dim]."""
    gen = torch.Generator().manual_seed(dim)
    shape = (kv_heads, blocks, block_size, dim)
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
