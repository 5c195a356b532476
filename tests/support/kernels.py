"""Inputs shared by the tests of moe-mesh's C kernels."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from common import bf16

# Row counts at which a product's kernels differ: one row, a pair, every tile width up to 12
# rows, and two and three tiles' worth (common/quant_avx512.c)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 24, 25)


def paged(dtype: torch.dtype, kv_heads: int, dim: int, block_size: int = 4, blocks: int = 64):
    """A layer's cache, random: k and v [kv_heads, blocks, block_size, dim]."""
    gen = torch.Generator().manual_seed(dim)
    shape = (kv_heads, blocks, block_size, dim)
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))


def assert_avx2_bits(outputs: Callable[[], list[torch.Tensor]], level: int = 3) -> None:
    """outputs() computed with the kernels held to AVX2 and at `level` (the CPU's full level, or 2:
    AVX-512 without the kernels whose bits are the CPU's own) are the same bits (compared as
    int16: bfloat16's NaNs and signed zeros too). Skipped where the CPU has no AVX-512: only the
    AVX2 kernels run there."""
    if bf16.level() < 2:
        pytest.skip("this CPU has no AVX-512: only the AVX2 kernels run here")
    lib = bf16.library()
    lib.moe_bf16_limit(1)
    try:
        avx2 = outputs()
        lib.moe_bf16_limit(level)
        wide = outputs()
    finally:
        lib.moe_bf16_limit(3)
    for a, b in zip(avx2, wide, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
