"""Timing the compute sides of a MoE layer with the serving code itself (for `moe-mesh profile`).

The router side (Ta) runs the router's own layers (RMSNorm, attention over the paged KV cache, the
post-attention norm, gating, grouping, combine, a shared expert if the family has one) for a decode
micro-batch; the expert side (Te) runs common.moe.expert_ffn over the groups the real gate makes.
Both report wall seconds (median) and process CPU seconds per run: the planner needs the CPU time
to know how much of a shared node a process takes, and the OpenMP pools sleep when idle
(runtime.configure), so CPU time is work done, not spinning.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common import bf16
from common.arch import ModelSpec
from common.checkpoint import Checkpoint
from common.linear import linear
from common.moe import (
    combine,
    expert_ffn,
    group_by_expert,
    route,
    shared_expert_output,
)
from common.weights import DenseWeights, FFNWeights, LayerWeights
from router_service.engine.kv_cache import KVCache
from router_service.engine.layers import AttentionBatch, Rope, attention, norm
from router_service.engine.model import pack_step
from router_service.settings import RouterSettings

BLOCK_SIZE = RouterSettings.model_fields["kv_block_size"].default  # what a router runs with


@dataclass(frozen=True)
class Timing:
    wall_s: float  # median of the repeats
    cpu_s: float  # process CPU seconds per repeat (every thread)


def timed(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> Timing:
    """Run fn warmup + repeats times; the warm-up pages weights in and sizes torch's buffers."""
    for _ in range(warmup):
        fn()
    walls = []
    cpu = cpu_clock()
    for _ in range(repeats):
        start = clock()
        fn()
        walls.append(clock() - start)
    return Timing(statistics.median(walls), (cpu_clock() - cpu) / repeats)


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of process `pid` (every thread, exited ones included) in seconds, from
    /proc/<pid>/stat; None when it cannot be read (not Linux, not this machine's, gone). Its unit
    is a clock tick (10 ms): time enough calls that a tick is noise."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LayerBench:
    """One checkpoint's weights (dense part + one MoE layer's experts) and inputs to time them on."""

    def __init__(
        self, checkpoint: Checkpoint, seed: int = 0, experts: Checkpoint | None = None
    ) -> None:
        """`experts`: where the expert weights come from, opened as an expert service opens
        them (its layout may differ from the router's; common/linear.py); default `checkpoint`."""
        self.expert_checkpoint = experts or checkpoint
        self.spec: ModelSpec = checkpoint.spec
        self.dense: DenseWeights = checkpoint.load_dense()
        self.layer_id = self.spec.moe_layer_ids[0]  # every MoE layer has the same shapes
        self.layer: LayerWeights = self.dense.layers[self.layer_id]
        pairs = [(self.layer_id, e) for e in range(self.spec.num_experts)]
        self.experts: dict[int, FFNWeights] = {
            e: w for (_, e), w in self.expert_checkpoint.load_experts(pairs).items()
        }
        self.dtype = self.dense.embed.dtype
        self._gen = torch.Generator().manual_seed(seed)

    def hidden(self, n: int) -> torch.Tensor:
        """Embeddings of random token ids: activations of the model's own scale, so the gate
        spreads tokens as it would (random normals would not)."""
        ids = torch.randint(0, self.spec.vocab_size, (n,), generator=self._gen)
        return F.embedding(ids, self.dense.embed)  # [n, hidden]

    def routed(self, n: int, layer: LayerWeights | None = None) -> torch.Tensor:
        """n tokens as the gate of `layer` sees them (after its post-attention norm)."""
        layer = layer or self.layer
        return norm(self.hidden(n), layer.post_attention_norm, self.spec)

    def _decode(self, b: int, context: int) -> tuple[AttentionBatch, KVCache, Rope]:
        s = self.spec
        per_seq = -(-context // BLOCK_SIZE)
        heads, k_dim, v_dim = s.kv_dims
        cache = KVCache(1, heads, k_dim, self.dtype, b * per_seq, BLOCK_SIZE, v_dim)
        for t in (cache.k, cache.v):
            t.normal_(generator=self._gen)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        batch = pack_step([], [(t, 0, context) for t in tables], BLOCK_SIZE).attention
        return batch, cache, Rope(s, context, self.dtype)

    def router_layer(self, b: int, context: int, repeats: int) -> Timing:
        """Ta(b): the router's share of one MoE layer for b decoding sequences of `context` tokens."""
        s, w = self.spec, self.layer
        batch, cache, rope = self._decode(b, context)
        x = self.hidden(b)

        def step() -> torch.Tensor:
            h = norm(x, w.input_norm, s)
            y = x + attention(h, w.attention, s, rope, batch, cache, 0)
            h = norm(y, w.post_attention_norm, s)
            routing = route(h, w.router, s, w.router_bias, w.router_correction)
            groups = group_by_expert(routing, s.num_experts)
            # The rows the router sends stand in for the experts' answers: combine costs the same.
            out = combine(groups, [h[g.tokens] for g in groups], routing, b, h)
            if w.shared_expert is not None:
                out = out + shared_expert_output(h, w.shared_expert, w.shared_expert_gate)
            return y + out

        return timed(step, repeats)

    def dense_layer(self, b: int, context: int, repeats: int) -> Timing | None:
        """A non-MoE layer (Qwen's mlp_only_layers) for b sequences; None when the model has none."""
        dense = [i for i, moe in enumerate(self.spec.moe_layers) if not moe]
        if not dense:
            return None
        s, w = self.spec, self.dense.layers[dense[0]]
        batch, cache, rope = self._decode(b, context)
        x = self.hidden(b)

        def step() -> torch.Tensor:
            h = norm(x, w.input_norm, s)
            y = x + attention(h, w.attention, s, rope, batch, cache, 0)
            return y + expert_ffn(norm(y, w.post_attention_norm, s), w.dense_mlp)

        return timed(step, repeats)

    def head(self, b: int, repeats: int) -> Timing:
        """Once per step: embedding, final norm and LM head for b sequences."""
        w = self.dense
        ids = torch.randint(0, self.spec.vocab_size, (b,), generator=self._gen)

        def step() -> torch.Tensor:
            x = norm(F.embedding(ids, w.embed), w.final_norm, self.spec)
            return linear(x, w.lm_head).float()  # [b, vocab]

        return timed(step, repeats)

    def expert_layer(self, b: int, repeats: int) -> Timing:
        """Te(b): every expert FFN of the layer for b tokens routed by the layer's real gate."""
        h = self.routed(b)
        w = self.layer
        routing = route(h, w.router, self.spec, w.router_bias, w.router_correction)
        groups = group_by_expert(routing, self.spec.num_experts)
        inputs = [(h[g.tokens], self.experts[g.expert]) for g in groups]

        def step() -> None:
            for rows, w in inputs:
                expert_ffn(rows, w)

        return timed(step, repeats)

    def expert_call(self, pair: tuple[int, int], rows: torch.Tensor, repeats: int) -> Timing:
        """One expert's FFN on exactly the rows of a Forward call (what to subtract from its round trip)."""
        return self.experts_call(pair[0], [(pair[1], rows)], repeats)

    def experts_call(
        self, layer: int, groups: list[tuple[int, torch.Tensor]], repeats: int
    ) -> Timing:
        """The FFNs of a Forward call carrying rows for several experts of `layer`, one after another
        as the service's compute thread runs them."""
        weights = self.expert_checkpoint.load_experts([(layer, e) for e, _ in groups])
        inputs = [(rows, weights[(layer, e)]) for e, rows in groups]

        def run() -> None:
            for rows, w in inputs:
                expert_ffn(rows, w)

        return timed(run, repeats)

    def load_shares(self, tokens: int) -> dict[int, list[float]]:
        """Per MoE layer, each expert's share of the layer's routed tokens (top-k slots) on `tokens`
        random embeddings: what a plan assumes when the utilization record says nothing."""
        out = {}
        for layer in self.spec.moe_layer_ids:
            w = self.dense.layers[layer]
            h = self.routed(tokens, w)
            experts = route(h, w.router, self.spec, w.router_bias, w.router_correction).experts
            counts = torch.bincount(experts.reshape(-1), minlength=self.spec.num_experts)
            out[layer] = (counts.double() / counts.sum()).tolist()
        return out


def read_bandwidth(nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s this machine reads from memory with all torch threads: the faster of two readers
    of a buffer of `nbytes` (default: `past_caches()`), each its best of `repeats` passes.
    torch's float32 sum, and where moe-mesh's bfloat16 kernel runs, a one-row product over the
    same bytes as panels, which prefetches: on host C (Intel Xeon, AMX) the sum read 22-26 GB/s
    and the product 28, so a share of the sum's figure came out above 100%."""
    nbytes = nbytes or past_caches()
    buf = torch.ones(nbytes // 4)
    seconds = _best(buf.sum, repeats)
    rows = nbytes // 2 // _READ_WIDTH
    if bf16.kernel("moe_linear") is not None and rows % bf16.COLUMNS == 0:
        panels = bf16.Panels.of(buf.view(torch.bfloat16)[: rows * _READ_WIDTH], (rows, _READ_WIDTH))
        x = torch.zeros(1, _READ_WIDTH, dtype=torch.bfloat16)
        seconds = min(seconds, _best(lambda: panels(x), repeats))
    return nbytes / seconds


def past_caches(cpus: Path = Path("/sys/devices/system/cpu")) -> int:
    """A read buffer the last-level caches cannot hold: four times their size (every L3 instance
    once: sockets and AMD's core complexes each have their own), in 256 MiB steps, at least
    256 MiB and at most 2 GiB (a bound on the probe's memory, below four L3s of some servers). On
    a 16-core Xeon with 300 MiB of L3 (the GPU host's CPU), the probe read 216-260 GB/s over
    256 MiB in runs where 1.25 GiB gave 78-88."""
    step, instances = 2**28, {}
    for cache in cpus.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (cache / "level").read_text().strip() != "3":
                continue
            text = (cache / "size").read_text().strip()
            size = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]]
            instances[(cache / "shared_cpu_list").read_text().strip()] = size
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return min(2**31, max(step, -(-4 * sum(instances.values()) // step) * step))


_READ_WIDTH = 4096  # the panels' input width: a row of a 7B-class model's projection


def _best(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after an untimed one."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        run()
        if i:
            best = min(best, time.perf_counter() - start)
    return best
