"""KV-cache blocks: a fixed pool with reference counts, and the prefix cache over it.

A block holds the keys and values of `block_size` consecutive tokens of a sequence. A full block
whose keys and values a successful step wrote is published under its key: a hash of its token ids
and of its parent block's key, so the key names the whole prefix up to the block's end. A later
sequence whose tokens start the same way takes those blocks instead of computing them. Published
blocks are read-only: a sequence writes only past its last full block, and only full blocks are
published. A block nobody references any more stays published and is reused, least recently
released first, only when no free block is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its token ids, hashed.

    A cryptographic hash (BLAKE2b, 128 bits): a collision would let one sequence read another's
    keys and values, and prompts are chosen by clients, so a hash that can be steered will not do.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """`num_blocks` blocks: free, referenced by running sequences, or cached (published, unreferenced).

    Not thread-safe; the engine drives it from one event loop.
    """

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.caching = num_blocks, caching
        self.refs = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and unpublished
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, published; LRU first
        self._by_key: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a published prefix."""
        return len(self._cached)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The published blocks of the longest run of `keys` from the first; takes no reference."""
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cost(self, blocks: Sequence[int]) -> int:
        """How many free blocks taking `blocks` uses up: those nobody references now."""
        return sum(1 for b in blocks if self.refs[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference published blocks (from `match`)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._cached[b]
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n blocks for one sequence's own writes; evicts the least recently released cached ones
        when the free list runs out. Raises MemoryError when fewer than n are free (check first)."""
        if n > self.num_free:
            raise MemoryError(f"{n} KV blocks asked, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_key[self._key[b]]
                self._key[b] = None
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of a sequence's blocks. Released last block first, so its
        tail is evicted before its head (a shared prefix outlives the tails hanging off it)."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self._key[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None

    def publish(self, block: int, key: bytes) -> bool:
        """Make a full, written block findable by `key`. False when caching is off or another block
        already holds that key (two sequences computed the same prefix at once): it stays private."""
        if not self.caching or key in self._by_key or self._key[block] is not None:
            return False
        self._key[block] = key
        self._by_key[key] = block
        return True

    def is_published(self, block: int) -> bool:
        return self._key[block] is not None

    def reset(self) -> None:
        """Every block free and nothing cached (after a failure the state cannot be trusted)."""
        self.__init__(self.num_blocks, self.caching)
