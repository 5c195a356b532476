"""Decode steps replayed from CUDA graphs, captured once per batch size and context width.

A decode step on a GPU is hundreds of small kernels; launched one by one from Python, the launches
take longer than the kernels (vLLM and SGLang measured the same, and capture decode for the batch
sizes that recur). A step whose pass has no host synchronisation (engine/device_pass.py: every
expert on this GPU) is captured into a graph over static input tensors, per bucket of
(sequences, blocks per table): a step is padded up to its bucket, copied into that bucket's
inputs, and replayed. Padded rows decode token 0 at position 0 over block 0, writing their key
and value into the cache's scratch slot, which no sequence owns; their logits and routing are
cut off before anyone reads them. Prefill steps, and steps larger than the largest bucket, run
eagerly.

What capture and replay do is a `GraphBackend`: CUDA's (`CudaGraphs`) on a GPU; tests on a CPU
use a stand-in that honours the same contract (capture runs the pass over the static inputs and
returns outputs that each replay refreshes in place).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from common.device import device_lost
from router_service.engine.layers import AttentionBatch

log = logging.getLogger(__name__)

# Pass(token_ids [n], attention, logits_rows [n]) -> (logits [n, vocab], chosen [moe layers, n, k])
Pass = Callable[[torch.Tensor, AttentionBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Sequences per captured graph; a step is padded up to the next one (vLLM's sizes, in spirit).
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Blocks per table: attention reads a bucket's whole width, so widths grow by 4x, not to the max.
FIRST_WIDTH = 4


class GraphBackend(Protocol):
    def capture(self, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[object, tuple]:
        """A graph of `run` (after warm-up runs) and the outputs its replays refresh."""
        ...

    def replay(self, graph: object) -> None: ...


class CudaGraphs:
    """CUDA graphs on one device, sharing one memory pool (captures happen one at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[object, tuple]:
        with torch.cuda.device(self.device):
            # Warm up on a side stream, as torch's docs ask: lazy initialisation (cuBLAS
            # workspaces, the caching allocator's first blocks) must not happen inside capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
                # The second run refuses to wait on the device: an op that would fail the
                # capture fails here, before any capture began.
                mode = torch.cuda.get_sync_debug_mode()
                with warnings.catch_warnings():  # "a prototype feature", said once a process
                    warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
            before = torch.cuda.current_stream()
            before.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the event loop's thread may touch CUDA meanwhile (staging rows)
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    outputs = run()
            except Exception:
                # A capture that fails to end leaves the allocator sending this thread's
                # allocations to the pool, and the thread on the capture stream: undo both.
                end = getattr(torch._C, "_cuda_endAllocateToPool", None)
                if end is not None:
                    with contextlib.suppress(RuntimeError):
                        end(self.device.index, self.pool)
                torch.cuda.set_stream(before)
                raise
        return graph, outputs

    def replay(self, graph: object) -> None:
        with torch.cuda.device(self.device):
            graph.replay()  # type: ignore[attr-defined]


@dataclass
class _Captured:
    graph: object
    outputs: tuple[torch.Tensor, torch.Tensor]
    tokens: torch.Tensor  # [size] int64: the static inputs the graph reads
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor  # [size, width]
    lengths: torch.Tensor
    rows: torch.Tensor  # [size]: the logits rows; the graph reads its memory, so it is held here


class DecodeGraphs:
    """Captured decode steps of one model and KV cache; `step` replays one or answers None."""

    def __init__(
        self,
        run: Pass,
        backend: GraphBackend,
        max_seqs: int,
        max_blocks: int,
        block_size: int,
        scratch_slot: int,
        device: torch.device,
        before_capture: Callable[[], None] = lambda: None,
    ) -> None:
        self.run, self.backend = run, backend
        self.sizes = [s for s in SIZES if s < max_seqs] + [max_seqs]
        widths, w = [], FIRST_WIDTH
        while w < max_blocks:
            widths.append(w)
            w *= 4
        self.widths = [*widths, max_blocks]
        self.block_size, self.scratch_slot, self.device = block_size, scratch_slot, device
        self.before_capture = before_capture  # forget what the pass cached of eager steps
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.replays = 0
        self.failed: str | None = None  # why capture failed; every step eager from then on

    def bucket(self, sequences: int, blocks: int) -> tuple[int, int] | None:
        """The (size, width) a step of `sequences` decodes over `blocks`-block tables runs in."""
        if sequences > self.sizes[-1] or blocks > self.widths[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, sequences)]
        return size, self.widths[bisect.bisect_left(self.widths, max(blocks, 1))]

    def step(self, tokens: torch.Tensor, attention: AttentionBatch) -> tuple | None:
        """(logits [n, vocab], chosen [moe layers, n, k]) of a decode-only step, replayed; None
        where it has prefills or fits no bucket (the caller runs it eagerly)."""
        n, blocks = attention.decode_tables.shape
        if attention.prefills or not n:
            return None
        key = self.bucket(n, blocks)
        if key is None or self.failed is not None:
            return None
        captured = self.graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(*key)
            except RuntimeError as e:  # e.g. an op that reads the device inside capture
                if device_lost(e):  # not the capture's fault: no eager step would run either
                    raise
                self.failed = repr(e)
                log.warning(
                    "decode graphs off: capturing %s sequences x %s blocks failed: %s", *key, e
                )
                return None
        self._load(captured, tokens, attention)
        self.backend.replay(captured.graph)
        self.replays += 1
        logits, chosen = captured.outputs
        # A copy: the next replay (another micro-batch's, or another bucket's sharing the pool)
        # overwrites the graph's outputs before the engine samples these.
        return logits[:n].clone(), chosen[:, :n]

    def _load(self, c: _Captured, tokens: torch.Tensor, a: AttentionBatch) -> None:
        n, blocks = a.decode_tables.shape
        c.tokens[:n].copy_(tokens, non_blocking=True)
        c.positions[:n].copy_(a.positions, non_blocking=True)
        c.slots[:n].copy_(a.slots, non_blocking=True)
        c.lengths[:n].copy_(a.decode_lengths, non_blocking=True)
        c.tables[:n, :blocks].copy_(a.decode_tables, non_blocking=True)
        c.tables[:n, blocks:].zero_()
        self._pad(c, n)

    def _pad(self, c: _Captured, n: int) -> None:
        """Rows past n: token 0 at position 0 of block 0, written to the scratch slot."""
        c.tokens[n:].zero_()
        c.positions[n:].zero_()
        c.slots[n:].fill_(self.scratch_slot)
        c.lengths[n:].fill_(1)
        c.tables[n:].zero_()

    def _capture(self, size: int, width: int) -> _Captured:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=self.device)

        c = _Captured(
            None, (), zeros(size), zeros(size), zeros(size), zeros(size, width), zeros(size),
            torch.arange(size, device=self.device),
        )  # fmt: skip
        self._pad(c, 0)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            # A new layout object each run: what a pass caches on it (RoPE rows, masks) is then
            # computed inside the capture, from the static tensors, not kept from a warm-up.
            attention = AttentionBatch(
                positions=c.positions,
                slots=c.slots,
                prefills=[],
                decode_tables=c.tables,
                decode_lengths=c.lengths,
                num_prefill_tokens=0,
                block_size=self.block_size,
            )
            self.before_capture()
            return self.run(c.tokens, attention, c.rows)

        c.graph, c.outputs = self.backend.capture(run)
        self.graphs[(size, width)] = c
        return c
