"""Which sequences the next step computes, how many of their tokens, and in which KV blocks.

Every step takes running sequences first, in priority then arrival order: one token each for
those decoding, the next chunk for those still prefilling. Then it admits waiting sequences while
their blocks fit. Prompt tokens per step are bounded by max_prefill_tokens: with chunked prefill
a long prompt is split over several steps (running decodes keep their pace), without it a prompt
runs whole and the bound only limits what else is admitted with it.

A sequence is admitted with blocks for all its tokens (minus the prefix-cache hits it shares),
plus headroom of one block per running sequence for their growth. When a decoding sequence needs
a block and none is left, the lowest-priority, newest running sequence is preempted: its blocks
are released and it waits again at the head of its priority, output kept, to be recomputed
(prompt + output as one prefill, mostly from the prefix cache if its blocks survived) later.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from common.sampling import SamplingParams
from router_service.engine.blocks import BlockPool, block_key


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    seed: int | None  # None: greedy
    deadline: float | None = None  # time.monotonic()
    output: list[int] = field(default_factory=list)
    arrival: int = 0  # its place among requests of one priority
    aborted: bool = False
    blocks: list[int] = field(
        default_factory=list
    )  # block table: block i holds tokens [i*bs, (i+1)*bs)
    num_computed: int = 0  # tokens whose keys and values are in its blocks
    num_published: int = 0  # its leading blocks that are in the prefix cache
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]


@dataclass(eq=False)
class Chunk:
    """What one step computes for one sequence: `length` tokens from position `start`."""

    seq: Sequence
    start: int
    length: int

    @property
    def decode(self) -> bool:
        """One token over a cached context: the batched decode path."""
        return self.length == 1 and self.start > 0

    @property
    def last(self) -> bool:
        """It reaches the sequence's end, so its logits give the next token."""
        return self.start + self.length == self.seq.num_tokens


def _order(seq: Sequence) -> tuple[int, int]:
    return (-seq.priority, seq.arrival)


class Scheduler:
    """Running and waiting sequences, their block tables, admission and preemption."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        chunked_prefill: bool = True,
    ) -> None:
        self.pool, self.block_size = pool, block_size
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.running: list[Sequence] = []  # in _order
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by _order
        self.preemptions = 0
        self.prefix_query_tokens = 0  # tokens of admitted sequences (re-admissions too)
        self.prefix_hit_tokens = 0  # ... of those found in the prefix cache

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, s in self._waiting if not s.aborted)

    @property
    def has_waiting(self) -> bool:
        """Whether any sequence waits (cancelled ones too)."""
        return bool(self._waiting)

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (_order(seq), seq))

    def schedule(self) -> list[Chunk]:
        """The next step's chunks, running sequences first; may preempt. Blocks are reserved for
        every chunk's tokens before it is returned."""
        chunks: list[Chunk] = []
        budget = self.max_prefill_tokens
        self.running.sort(key=_order)  # a recomputed sequence takes its place back
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            todo = seq.num_tokens - seq.num_computed
            prefill = todo > 1 or seq.num_computed == 0
            n = min(todo, budget) if prefill and self.chunked_prefill else todo
            if n == 0:  # this step's prompt tokens are spent: it goes on next step
                i += 1
                continue
            if not self._grow(seq, seq.num_computed + n):
                continue  # it was the one to preempt: it left self.running
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n if prefill else 0
            i += 1
        self._admit(chunks, budget)
        return chunks

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `tokens` tokens of `seq`, preempting from the back of the running list as
        needed. False when `seq` itself was preempted."""
        need = -(-tokens // self.block_size) - len(seq.blocks)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        return True

    def reserve(self, seq: Sequence, tokens: int) -> int:
        """Blocks for up to `tokens` tokens of `seq` from the free ones, preempting nothing;
        returns how many tokens its blocks now hold. Blocks it does not fill stay its own."""
        need = min(-(-tokens // self.block_size) - len(seq.blocks), self.pool.num_free)
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        return len(seq.blocks) * self.block_size

    def _admit(self, chunks: list[Chunk], budget: int) -> None:
        admitted = False
        while self._waiting and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][1]
            if seq.aborted:
                heapq.heappop(self._waiting)
                continue
            if self.chunked_prefill and budget <= 0:
                break
            hits = self._hits(seq)
            todo = seq.num_tokens - len(hits) * self.block_size
            if not self.chunked_prefill and admitted and todo > budget:
                break
            blocks = -(-seq.num_tokens // self.block_size)
            need = blocks - len(hits) + self.pool.cost(hits)
            # Each running sequence may need a block before the next admission: keep them that.
            if need + len(self.running) > self.pool.num_free:
                break
            heapq.heappop(self._waiting)
            self.running.append(seq)  # before taking blocks: a failure then releases them
            self.pool.take(hits)
            seq.blocks = list(hits)
            seq.blocks += self.pool.allocate(blocks - len(hits))
            seq.num_computed, seq.num_published = len(hits) * self.block_size, len(hits)
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed
            n = min(todo, budget) if self.chunked_prefill else todo
            budget -= n
            chunks.append(Chunk(seq, seq.num_computed, n))
            admitted = True

    def _hits(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can start from; never its last token's block, which must be
        computed for its logits."""
        if not self.pool.caching:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        self._extend_keys(seq, full)
        return self.pool.match(seq.keys[:full])

    def _extend_keys(self, seq: Sequence, blocks: int) -> None:
        bs = self.block_size
        while len(seq.keys) < blocks:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else None
            seq.keys.append(block_key(parent, seq.token_ids(i * bs, (i + 1) * bs)))

    def computed(self, chunks: list[Chunk]) -> None:
        """A step wrote these chunks' keys and values: count them, and publish the blocks that
        are now full. Only then: a failed step must leave nothing half-written findable."""
        for c in chunks:
            seq = c.seq
            seq.num_computed = c.start + c.length
            if not self.pool.caching:
                continue
            full = seq.num_computed // self.block_size
            self._extend_keys(seq, full)
            for i in range(seq.num_published, full):
                self.pool.publish(seq.blocks[i], seq.keys[i])
            seq.num_published = max(seq.num_published, full)

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's blocks and queue it again; it will be recomputed."""
        self.running.remove(seq)
        self._free(seq)
        self.preemptions += 1
        heapq.heappush(self._waiting, (_order(seq), seq))

    def finish(self, seqs: list[Sequence]) -> None:
        """Sequences that ended (finished, failed, cancelled): release their blocks."""
        gone = set(map(id, seqs))
        self.running = [s for s in self.running if id(s) not in gone]
        for seq in seqs:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.num_published = [], 0, 0

    def clear(self) -> list[Sequence]:
        """Forget every sequence and empty the cache; returns the running and waiting ones."""
        seqs = self.running + [s for _, s in self._waiting]
        self.running, self._waiting = [], []
        self.pool.reset()
        for seq in seqs:
            seq.blocks, seq.num_computed, seq.num_published = [], 0, 0
        return seqs
