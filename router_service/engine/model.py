"""The MoE decoder as the router runs it: dense layers in-process, MoE blocks through the dispatcher."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import float32
from common.arch import ModelSpec
from common.linear import linear, serial_tokens
from common.moe import expert_ffn
from common.weights import DenseWeights, LayerWeights
from router_service.engine import fused, fused_f32
from router_service.engine.burst import Burst
from router_service.engine.burst import run as burst_run
from router_service.engine.fused import FusedDecode, OneCallStep
from router_service.engine.fused_f32 import FusedDecodeF32
from router_service.engine.gpu import GpuPasses
from router_service.engine.kv_cache import KVCache, block_bytes
from router_service.engine.layers import (
    AttentionBatch,
    Prefill,
    Rope,
    add_norm,
    attention,
    norm,
)
from router_service.engine.pipeline import CallTimes, Compute, PassCosts, inline, run_stretches
from router_service.experts.dispatch import ExpertDispatcher

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [tokens] int64
    attention: AttentionBatch
    logits_rows: torch.Tensor  # [sequences] int64: the row of each sequence's last token
    deadline: float | None = None  # time.monotonic() by which expert calls must finish


def pack_step(
    prefills: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    decodes: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
) -> StepBatch:
    """Lay out one step over the paged cache. Prefills are (block table, tokens already cached,
    new token ids); decodes are (block table, token, context length incl. it). A block table must
    cover every token up to the end of its run."""
    tokens: list[int] = []
    positions, slots, runs = [], [], []
    for table, start, ids in prefills:
        n, total = len(ids), start + len(ids)
        tokens += ids
        pos = torch.arange(start, total)
        blocks = torch.tensor([table[: -(-total // block_size)]], dtype=torch.int64)
        positions.append(pos)
        slots.append(blocks[0, pos // block_size] * block_size + pos % block_size)
        mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=start) if start else None
        runs.append(Prefill(start=start, length=n, blocks=blocks, mask=mask))
    num_prefill = len(tokens)
    tokens += [d[1] for d in decodes]
    # The decodes' indices in Python ints, a tensor each at the end: a decode step is mostly
    # these, and a torch op costs tens of microseconds once the weights streamed through.
    ends = [d[2] for d in decodes]
    width = -(-max(ends) // block_size) if decodes else 0
    padded = [list(t[:width]) + [0] * (width - len(t[:width])) for t, _, _ in decodes]
    at = [(n - 1, row[(n - 1) // block_size]) for n, row in zip(ends, padded)]
    positions.append(torch.tensor([p for p, _ in at], dtype=torch.int64))
    slots.append(torch.tensor([b * block_size + p % block_size for p, b in at], dtype=torch.int64))
    tables = torch.tensor(padded, dtype=torch.int64).view(len(decodes), width)  # [decodes, blocks]
    lengths = torch.tensor(ends, dtype=torch.int64)
    attn = AttentionBatch(
        positions=positions[0] if len(positions) == 1 else torch.cat(positions),
        slots=slots[0] if len(slots) == 1 else torch.cat(slots),
        prefills=runs,
        decode_tables=tables,
        decode_lengths=lengths,
        num_prefill_tokens=num_prefill,
        block_size=block_size,
    )
    rows = [end - 1 for end in itertools.accumulate(r.length for r in runs)] + list(
        range(num_prefill, len(tokens))
    )
    return StepBatch(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        attention=attn,
        logits_rows=torch.tensor(rows, dtype=torch.int64),
    )


class MoeModel:
    """Forward passes over packed steps (prefill runs + decode tokens) with a paged KV cache.

    A pass is one coroutine whose MoE layers are one await each (ExpertDispatcher.moe_layer). It
    runs on `compute` (the router's compute thread) a stretch at a time (run_stretches): a layer
    whose experts are all colocated computes inside the stretch, one that needs remote experts
    ends it while the event loop carries the calls and other micro-batches compute. A monolithic
    router computes a whole pass in one stretch.
    """

    def __init__(
        self,
        spec: ModelSpec,
        weights: DenseWeights,
        dispatcher: ExpertDispatcher,
        max_model_len: int,
        compute: Compute = inline,
        serial_max_tokens: int | None = 0,
        max_num_seqs: int = 256,
    ) -> None:
        self.spec, self.weights, self.dispatcher = spec, weights, dispatcher
        self.max_model_len = max_model_len
        self.compute = compute
        self.dtype, self.device = weights.embed.dtype, weights.embed.device
        if serial_max_tokens is None:  # what this host's CPU runs fastest (none on a GPU)
            serial_max_tokens = serial_tokens(self.dtype) if self.device.type == "cpu" else 0
        self.serial_max_tokens = serial_max_tokens
        if self.dtype == torch.float32 and self.device.type == "cpu":
            float32.faster(torch.get_num_threads())  # measured now, not in the first request
        # The threads a stretch found, before serial_max_tokens: what a one-call step takes.
        self._team = torch.get_num_threads()
        self.rope = Rope(spec, max_model_len, self.dtype, self.device)
        # On a GPU, passes go to GpuPasses first (tests set one on the CPU).
        self.gpu: GpuPasses | None = None
        if self.device.type == "cuda":
            self.gpu = GpuPasses(
                spec, weights, dispatcher, self._layers, max_num_seqs, max_model_len
            )
            self.gpu.prepare()  # before the KV cache is sized from what memory is left
        # A decode step as one kernel call, where the model allows (engine/fused.py, and
        # fused_f32.py for float32).
        self.fused = _one_call_step(spec, weights, self._team)

    def close(self) -> None:
        """Stop the compute thread, if it has one."""
        close = getattr(self.compute, "close", None)
        if close is not None:
            close()

    def new_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        """A paged cache of `num_blocks` blocks of `block_size` tokens for this model."""
        heads, k_dim, v_dim = self.spec.kv_dims
        return KVCache(
            self.spec.num_layers,
            heads,
            k_dim,
            self.dtype,
            num_blocks,
            block_size,
            v_dim,
            self.device,
            scratch=self.gpu is not None,  # where decode graphs' padded rows write
        )

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV-cache block of `block_size` tokens."""
        heads, k_dim, v_dim = self.spec.kv_dims
        return block_bytes(self.spec.num_layers, heads, k_dim, self.dtype, block_size, v_dim)

    async def forward(
        self,
        batch: StepBatch,
        cache: KVCache,
        all_logits: bool = False,
        costs: PassCosts | None = None,
    ) -> torch.Tensor:
        """Float32 logits of each sequence's last token [sequences, vocab] (every token's with
        all_logits), on the model's device."""
        costs = costs or PassCosts()
        costs.moe_layers = max(1, len(self.spec.moe_layer_ids))
        tokens = batch.token_ids.numel()
        return await run_stretches(
            self.compute,
            self._pass(batch, cache, all_logits, costs.remote),
            lambda: self._stretch(tokens, costs),
        )

    async def _pass(
        self, batch: StepBatch, cache: KVCache, all_logits: bool, calls: list[CallTimes]
    ) -> torch.Tensor:
        one = self.fused
        one_call = self._in_one_call(batch, cache, all_logits)
        if one_call is not None and one.trusted:
            return one_call
        moe = functools.partial(self.dispatcher.moe_layer, deadline=batch.deadline, calls=calls)
        if self.gpu is None:
            rows = None if all_logits else batch.logits_rows
            logits = await self._layers(batch.token_ids, batch.attention, rows, cache, moe)
            if one_call is not None:  # rewrote the cache slots the one call wrote
                self._trust(one, one_call, logits)
            return logits
        # On a GPU: the layout's indices go there once a step.
        tokens, layout = batch.token_ids.to(self.device), batch.attention.to(self.device)
        rows = None if all_logits else batch.logits_rows.to(self.device)
        self.dispatcher.replicas.check_deadline(batch.deadline)
        logits = self.gpu.run(tokens, layout, rows, cache)
        if logits is None:
            logits = await self._layers(tokens, layout, rows, cache, moe)
        return logits  # on the GPU: the engine reads back what sampling needs of it

    async def _layers(
        self,
        tokens: torch.Tensor,
        layout: AttentionBatch,
        rows: torch.Tensor | None,
        cache: KVCache,
        moe: Callable[[int, torch.Tensor, LayerWeights], Awaitable[torch.Tensor]],
    ) -> torch.Tensor:
        """Float32 logits of `rows` (every token's with None): the pass, its MoE layers `moe`."""
        s, w = self.spec, self.weights
        # h is the residual stream x normed for what reads it next: each residual addition and
        # the norm after it are one step (add_norm: one kernel call in bfloat16).
        x = F.embedding(tokens, w.embed)  # [tokens, hidden]
        h = norm(x, self._norm_after(-1), s)
        for i, layer in enumerate(w.layers):
            attended = attention(h, layer.attention, s, self.rope, layout, cache, i)
            x, h = add_norm(x, attended, layer.post_attention_norm, s)
            if layer.dense_mlp is not None:
                delta = expert_ffn(h, layer.dense_mlp)  # [tokens, hidden]
            else:
                delta = await moe(i, h, layer)
            x, h = add_norm(x, delta, self._norm_after(i), s)
        return linear(h if rows is None else h[rows], w.lm_head).float()  # [rows, vocab]

    def _in_one_call(
        self, batch: StepBatch, cache: KVCache, all_logits: bool
    ) -> torch.Tensor | None:
        """The pass as one kernel call (engine/fused.py, fused_f32.py) where it is decode tokens
        only, every expert is colocated in one backend and the kernel takes the weights; else
        None."""
        one = self._one_call(cache, wanted=not all_logits and self._one_decode(batch))
        if one is None:
            return None
        self.dispatcher.replicas.check_deadline(batch.deadline)
        # One call wakes the threads once, not once per op: it gains from all of them however
        # few its tokens (on 2 cores, 1.4x at one token), where _stretch chose one for op by op.
        logits = one.step(batch.token_ids.tolist(), batch.attention, self.rope, self._team)
        if one.trusted:  # else _pass computes the step op by op too, and counts it
            self.dispatcher.computed_together(one.routed())
        return logits

    def _trust(self, one: OneCallStep, one_call: torch.Tensor, logits: torch.Tensor) -> None:
        """Trust the float32 one-call step `one` (fused_f32.py) where its first step gave the
        op-by-op path's logits to the bit; else decode op by op from now on."""
        if self.fused is not one:
            return
        if torch.equal(one_call, logits):
            one.trusted = True
            log.info("float32 decode steps of one sequence run as one kernel call")
            return
        log.warning(
            "float32 decode step in one call gave other logits than op by op here (torch's "
            "build or this CPU): decoding op by op"
        )
        self.fused = None

    def _one_call(self, cache: KVCache, wanted: bool = True) -> OneCallStep | None:
        """The one-call step bound to the current experts and `cache`, where it can run now
        and is `wanted`; asked on every pass, so that it lets go of experts moved away."""
        one = self.fused
        if one is None:
            return None
        experts = self.dispatcher.all_colocated()
        if experts is None:  # let go of experts a re-tiering moved away
            one.unbind_experts()
            return None
        if (
            not wanted
            or self.dispatcher.traced()
            or not one.runs_on(self._team)
            or not (one.bind_experts(experts) and one.bind_cache(cache))
        ):
            return None
        return one

    def may_burst(self) -> bool:
        """Whether decode bursts (burst.py) may run: a one-call step over every expert, which
        its kernel takes, and no traced request."""
        one = self.fused
        if one is None or not one.trusted or self.dispatcher.traced():
            return False
        experts = self.dispatcher.all_colocated()
        return experts is not None and not one.refuses(experts)

    async def decode_burst(self, burst: Burst, cache: KVCache) -> list[int] | None:
        """`burst`'s tokens, each step one kernel call (a greedy burst one call in all where the
        LM head is in it), on the compute thread; None where the step cannot be one call now
        (then the engine takes a plain step)."""
        return await self.compute(self._burst, burst, cache)

    def _burst(self, burst: Burst, cache: KVCache) -> list[int] | None:
        if (one := self._one_call(cache)) is None:
            return None
        self.dispatcher.replicas.check_deadline(burst.deadline)
        tokens, chosen = burst_run(one, self.rope, cache.block_size, burst)
        self.dispatcher.computed_together(chosen)
        return tokens

    def _one_decode(self, batch: StepBatch) -> bool:
        """Whether `batch` is decode tokens only (one a sequence, at most the step's max_tokens) of a
        model whose step can be one call."""
        return (
            self.fused is not None
            and not batch.attention.prefills
            and batch.token_ids.numel() <= self.fused.max_tokens
        )

    @contextmanager
    def _stretch(self, tokens: int, costs: PassCosts) -> Iterator[None]:
        """One stretch of a pass of `tokens` tokens on the compute thread, timed into `costs`."""
        began = time.perf_counter()
        threads = self._team = torch.get_num_threads()
        # A pass this small is bound by memory bandwidth: where one core reads most of it, waking
        # the other threads for each of its hundreds of ops costs more than they add.
        serial = threads > 1 and tokens <= self.serial_max_tokens
        if serial:
            torch.set_num_threads(1)
        try:
            with float32.team(threads):  # its products still run on every thread
                yield
        finally:
            if serial:
                torch.set_num_threads(threads)
            costs.compute_s += time.perf_counter() - began

    def _norm_after(self, layer: int) -> torch.Tensor:
        """The weight of the norm that reads layer `layer`'s output (-1: the embeddings)."""
        w = self.weights
        return w.layers[layer + 1].input_norm if layer + 1 < len(w.layers) else w.final_norm


def _one_call_step(
    spec: ModelSpec, weights: DenseWeights, threads: int
) -> FusedDecode | FusedDecodeF32 | None:
    """The model's decode step as one kernel call, where it can be one (else None)."""
    if not fused.enabled():
        return None
    if weights.embed.dtype == torch.float32:
        return None if fused_f32.unfit(spec, weights) else FusedDecodeF32(spec, weights, threads)
    return None if fused.unfit(spec, weights) else FusedDecode(spec, weights)
