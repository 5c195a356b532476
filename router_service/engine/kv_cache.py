"""The paged KV cache: every layer's keys and values in fixed blocks, allocated once.

Which sequence owns which block is blocks.py's business (the block tables); this module holds the
tensors, writes a step's keys and values by slot (block * block_size + offset), gathers a
sequence's blocks back into one contiguous context for attention, and sizes the pool from the
`kv_cache_bytes` setting.
"""

from __future__ import annotations

import math
import os

import torch

from common import attention_kernels
from common.errors import InvalidArgumentError
from common.units import parse_size

AUTO_SHARE = 0.3  # `auto`: this share of the memory available at start-up, at most what is useful
# On a GPU the cache is most of what the device is for: `auto` takes this share of its memory
# free once the weights are loaded, the rest left to activations and captured decode graphs.
GPU_AUTO_SHARE = 0.8
# Contexts gathered at once for attention: small enough to stay in a server CPU's last-level cache
# (32 MiB here) until SDPA reads them. Decode attention over 1,000-4,000 tokens, float32, then
# takes 1.1-1.7x the slot cache's time (whose contexts were views) instead of about 2x.
GATHER_BYTES = 8 * 2**20
# On a GPU a gather is bounded by memory, not by a cache: whole batches at once, mostly.
GPU_GATHER_BYTES = 512 * 2**20


class KVCache:
    """k: [layers, kv_heads, num_blocks, block_size, head_dim], v: the same with v_dim (head_dim
    unless given: MLA caches a latent and a rope key of different sizes), zero-filled up front.

    The whole budget is touched at start-up, so the memory is the process's from then on:
    running out of blocks later means waiting or preemption, never an allocation failure.

    Attention reads a sequence's context as one [tokens, head_dim] matrix per KV head, which is
    what SDPA reads fastest (a strided context costs it a copy of its own). Heads outermost make
    that a single index_select per tensor into [kv_heads, seqs, tokens, head_dim], into a
    workspace kept between steps: a fresh buffer per layer would page-fault in every one.
    Gathering costs a copy of the contexts per layer; CPUs have no paged-attention kernel in torch.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int = 16,
        v_dim: int | None = None,
        device: torch.device | None = None,
        scratch: bool = False,
    ) -> None:
        self.num_layers, self.kv_heads, self.dtype = num_layers, kv_heads, dtype
        self.device = torch.device("cpu") if device is None else device
        self.head_dim, self.v_dim = head_dim, head_dim if v_dim is None else v_dim
        # `scratch`: one more block, owned by no sequence, where the padded rows of a replayed
        # decode graph (engine/graphs.py) write. The block pool hands out `pool_blocks`.
        self.pool_blocks, self.block_size = num_blocks, block_size
        self.num_blocks = num_blocks + scratch
        self.scratch_slot = num_blocks * block_size if scratch else None
        shape = (num_layers, kv_heads, self.num_blocks, block_size)
        self.k = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, self.v_dim, dtype=dtype, device=device)
        self._work = torch.empty(0, dtype=dtype, device=device)  # gather's output, grown on demand
        self._tables: torch.Tensor | None = None  # the latest tables gathered ...
        # ... as rows of [heads * blocks, bs * hd]
        self._rows = torch.empty(0, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values [tokens, kv_heads, head_dim] at their slots [tokens]."""
        if attention_kernels.kv_write(k, v, slots, self.k[layer], self.v[layer]):
            return
        rows = (self.kv_heads, self.num_blocks * self.block_size)
        self.k[layer].view(*rows, self.head_dim).index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].view(*rows, self.v_dim).index_copy_(1, slots, v.transpose(0, 1))

    def group(self, blocks: int) -> int:
        """How many sequences of `blocks` blocks to gather at once: their keys and values within
        GATHER_BYTES, so attention reads them back from the cache the gather just wrote them to
        rather than from memory (long contexts then cost about what contiguous ones did)."""
        dims = self.head_dim + self.v_dim
        per_seq = self.kv_heads * blocks * self.block_size * dims * self.dtype.itemsize
        budget = GATHER_BYTES if self.device.type == "cpu" else GPU_GATHER_BYTES
        return max(1, budget // per_seq)

    def gather(
        self, layer: int, tables: torch.Tensor, seqs: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of sequences' blocks, tables[seqs] [seqs, blocks] -> [seqs, kv_heads,
        blocks * block_size, head_dim / v_dim]. Views of a workspace: valid until the next gather
        (attention calls run one at a time, on the compute thread)."""
        if tables is not self._tables:  # every layer of a step gathers the same tables
            heads = torch.arange(self.kv_heads, device=self.device)[:, None, None] * self.num_blocks
            self._tables, self._rows = tables, heads + tables  # [kv_heads, seqs, blocks]
        chosen = self._rows[:, seqs]
        s, n = chosen.shape[1:]
        rows = chosen.reshape(-1)
        k_row, v_row = self.block_size * self.head_dim, self.block_size * self.v_dim
        k_size, v_size = rows.numel() * k_row, rows.numel() * v_row
        if self._work.numel() < k_size + v_size:
            need = k_size + v_size
            self._work = torch.empty(
                max(need, self._work.numel() * 3 // 2), dtype=self.dtype, device=self.device
            )
        # One row per (head, block): index_select over rows of whole blocks copies at memcpy
        # speed; selecting along the block dimension of [heads, blocks, ...] is 3x slower.
        blocks = self.kv_heads * self.num_blocks
        ks = self._work[:k_size].view(-1, k_row)
        vs = self._work[k_size : k_size + v_size].view(-1, v_row)
        torch.index_select(self.k[layer].view(blocks, k_row), 0, rows, out=ks)
        torch.index_select(self.v[layer].view(blocks, v_row), 0, rows, out=vs)
        context = (self.kv_heads, s, n * self.block_size)
        return (
            ks.view(*context, self.head_dim).transpose(0, 1),
            vs.view(*context, self.v_dim).transpose(0, 1),
        )


def block_bytes(
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    v_dim: int | None = None,
) -> int:
    """Bytes of one block: keys and values of block_size tokens in every layer."""
    dims = head_dim + (head_dim if v_dim is None else v_dim)
    return num_layers * block_size * kv_heads * dims * dtype.itemsize


def available_memory() -> int:
    """Bytes the OS could give this process now without swapping (Linux MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks(
    setting: str,
    block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    available: int | None = None,
    auto_share: float = AUTO_SHARE,
) -> int:
    """How many blocks of `block` bytes the `kv_cache_bytes` setting buys.

    'auto': `auto_share` of the available memory, at most what max_num_seqs sequences of
    max_model_len tokens can use (more would only hold prefix cache), at least one such sequence.
    A size ('4GiB') or a share of the available memory ('30%') is taken as given, and must hold
    one sequence of max_model_len tokens: InvalidArgumentError naming kv_cache_bytes otherwise.
    """
    per_seq = math.ceil(max_model_len / block_size)
    if setting.strip().lower() == "auto":
        share = int(auto_share * (available_memory() if available is None else available))
        return max(per_seq, min(share // block, per_seq * max_num_seqs))
    whole = None
    if setting.strip().endswith("%"):
        whole = available_memory() if available is None else available
    try:
        budget = parse_size(setting, whole)
    except ValueError as e:
        raise InvalidArgumentError("kv_cache_bytes", str(e)) from None
    blocks = budget // block
    if blocks < per_seq:
        raise InvalidArgumentError(
            "kv_cache_bytes",
            f"{setting!r} ({budget} bytes) holds {blocks * block_size} tokens ({blocks} blocks "
            f"of {block_size} tokens, {block} bytes each), fewer than one sequence of "
            f"max_model_len={max_model_len} tokens needs ({per_seq * block} bytes); "
            "raise kv_cache_bytes or lower max_model_len",
        )
    return blocks
