"""Continuous batching: requests join and leave the running batch at token boundaries.

Every step packs one token of every decoding sequence and the prompt chunks the scheduler
picked (scheduler.py: admission by free KV blocks, chunked prefill, preemption) into forward
passes: one, or one per micro-batch (pipeline.py) so that their expert calls overlap with each
other's compute. Each sequence reads and writes the KV cache through its own block table; a
micro-batch writes only its own sequences' unshared blocks.

No request can stop the engine: a failure while sampling fails only that sequence, an expert
failure fails its micro-batch's sequences, any other failure in a step fails the step's
sequences, and the engine keeps serving the rest. Only a device error is raised (a CUDA error
leaves the device unusable: common.device.device_lost), and the serving loop then gives up.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from common.device import device_lost, free_bytes
from common.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    MoeMeshError,
)
from common.limits import check_context_length, check_kv_capacity
from common.sampling import SamplingParams
from router_service.engine.blocks import BlockPool
from router_service.engine.burst import Burst, Pace
from router_service.engine.kv_cache import AUTO_SHARE, GPU_AUTO_SHARE, KVCache, num_blocks
from router_service.engine.model import MoeModel, pack_step
from router_service.engine.pipeline import MicroBatchPlanner, PassCosts
from router_service.engine.sampling import (
    TokenLogprobs,
    penalized_logits,
    position_seed,
    sample,
    token_logprobs,
)
from router_service.engine.scheduler import Chunk, Scheduler, Sequence
from router_service.settings import RouterSettings

log = logging.getLogger(__name__)


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"  # the step failed (e.g. an expert was unreachable); StepOutput.error says why


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: MoeMeshError | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked


class Engine:
    """Schedules sequences onto the model step by step. Not thread-safe; drive it from one event loop."""

    def __init__(
        self, model: MoeModel, settings: RouterSettings, cache: KVCache | None = None
    ) -> None:
        """`cache`: the KV cache to use; default one of `settings.kv_cache_bytes` (an
        InvalidArgumentError naming it when it cannot hold one sequence of max_model_len)."""
        self.model, self.settings = model, settings
        if cache is None:
            bs = settings.kv_block_size
            on_gpu = (free := free_bytes(model.device)) is not None
            blocks = num_blocks(
                settings.kv_cache_bytes,
                model.block_bytes(bs),
                bs,
                model.max_model_len,
                settings.max_num_seqs,
                available=free,  # a GPU's free memory; the host's without one
                auto_share=GPU_AUTO_SHARE if on_gpu else AUTO_SHARE,
            )
            cache = model.new_cache(blocks, bs)
        self.cache = cache
        self.scheduler = Scheduler(
            BlockPool(cache.pool_blocks, settings.enable_prefix_caching),
            cache.block_size,
            settings.max_num_seqs,
            settings.max_prefill_tokens,
            settings.enable_chunked_prefill,
        )
        self._by_id: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._rng = random.Random()
        self._generator = torch.Generator()  # re-seeded for every sampled token: see sampling.py
        self._cancelled: list[Sequence] = []
        # cancellations reaped between steps, reported by the next step
        self._pending: list[StepOutput] = []
        self._stepping = False
        self._halt: ctypes.c_int | None = None  # the running burst's (burst.py)
        self.pace = Pace(settings.decode_burst, settings.decode_burst_ms / 1e3)
        self.eos_ids = frozenset(model.spec.eos_token_ids)
        self.planner = MicroBatchPlanner(settings.micro_batches)

    @property
    def running(self) -> list[Sequence]:
        """Sequences holding KV blocks, in scheduling order."""
        return self.scheduler.running

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Queue a request; raises InvalidArgumentError / CapacityError naming the bad field.

        `deadline` (time.monotonic()) bounds the expert calls made on the request's behalf.
        """
        self._validate(request_id, prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            priority,
            None if params.greedy else seed,
            deadline,
            arrival=next(self._arrival),
        )
        self._by_id[request_id] = seq
        self.scheduler.add(seq)
        self._halt_burst()

    def _halt_burst(self) -> None:
        """End a running burst at its next token: a request waits, or one was cancelled."""
        if self._halt is not None:
            self._halt.value = 1

    def _validate(self, request_id: str, prompt: list[int], p: SamplingParams) -> None:
        """What any router client may send wrong: the params' limits (SamplingParams.validate) and
        what depends on this router (vocabulary, context length, KV-cache size)."""
        vocab = self.model.spec.vocab_size
        if request_id in self._by_id:
            raise AlreadyExistsError(
                "request_id", f"{request_id!r} is already in flight on this router"
            )
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        p.validate(vocab_size=vocab)
        check_context_length(len(prompt), p.max_tokens, self.model.max_model_len)
        check_kv_capacity(len(prompt), p.max_tokens, self.scheduler.capacity_tokens)

    def close(self) -> None:
        """Stop the model's compute thread (after the last step)."""
        self.model.close()

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its batch place and KV blocks are freed at the next token boundary."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.aborted:
            return False
        seq.aborted = True
        self._halt_burst()
        self._cancelled.append(seq)
        if not self._stepping:
            self._reap_cancelled()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._by_id or self._pending)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- stepping --------------------------------------------------------------------------

    async def step(self) -> list[StepOutput]:
        """Run one forward pass over the batch; return new tokens and finished/cancelled/failed sequences.

        A failure inside the step does not raise: the sequences it concerns end with FinishReason.ERROR.
        """
        self._reap_cancelled()
        outputs, self._pending = self._pending, []
        try:
            await self._step(outputs)
        # A bug or a torch error not pinned on one request: fail the step's requests.
        except Exception as e:
            if device_lost(e):
                raise  # the serving loop gives up (router_service/core.py)
            log.exception("engine step failed")
            error = (
                e if isinstance(e, MoeMeshError) else InternalError(f"engine step failed: {e!r}")
            )
            outputs += self._fail(list(self.running), error)
        finally:
            self._stepping = False
        return outputs

    async def _step(self, outputs: list[StepOutput]) -> None:
        chunks = self.scheduler.schedule()
        if not chunks or await self._burst(chunks, outputs):
            return
        prefills = [c for c in chunks if not c.decode]
        decodes = [c for c in chunks if c.decode]
        m = self.planner.choose(len(chunks), self.model.dispatcher.remote)
        parts = _partition(prefills, decodes, m)
        self.planner.ran(len(parts))
        self._stepping = True
        began = time.perf_counter()
        try:
            # Each micro-batch its own pass: while one waits on its experts, another computes.
            results = await asyncio.gather(
                *(self._forward(p, d) for p, d in parts), return_exceptions=True
            )
        finally:
            self._stepping = False
        if not prefills and not any(isinstance(r, BaseException) for r in results):
            self.planner.observe_step(len(decodes), len(parts), time.perf_counter() - began)
        done: list[Sequence] = []
        failed: list[tuple[list[Sequence], MoeMeshError]] = []
        for (p, d), result in zip(parts, results):
            if isinstance(result, Exception):
                if device_lost(result):
                    raise result  # step() lets it through
                # An expert was unreachable (expected: no traceback), or a bug in this
                # micro-batch: either way only its sequences end; the others keep their tokens.
                if not isinstance(result, MoeMeshError):
                    log.error("micro-batch failed", exc_info=result)
                    result = InternalError(f"engine step failed: {result!r}")
                failed.append(([c.seq for c in p + d], result))
                continue
            if isinstance(result, BaseException):  # cancelled: the serving loop is stopping
                raise result
            self.scheduler.computed(p + d)
            for chunk, row in zip(p + d, result):
                seq = chunk.seq
                if seq.aborted or not chunk.last:  # a prompt chunk before the last: no token yet
                    continue
                out = self._next_token(seq, row)
                outputs.append(out)
                if out.finish_reason is not None:
                    done.append(seq)
        self._release(done)
        for seqs, error in failed:
            outputs += self._fail(seqs, error)
        self._hand_over(outputs)

    def _hand_over(self, outputs: list[StepOutput]) -> None:
        """End a step: cancellations reaped, and every output pending added to `outputs`."""
        self._reap_cancelled()
        outputs += self._pending
        self._pending = []

    async def _burst(self, chunks: list[Chunk], outputs: list[StepOutput]) -> bool:
        """A lone sequence's next tokens in one burst of decode steps (burst.py); False
        where this step is a plain one."""
        steps = self._burst_steps(chunks)
        seq, start = chunks[0].seq, chunks[0].start
        if steps > 1:
            steps = min(steps, self.scheduler.reserve(seq, start + steps) - start)
        if steps < 2:
            return False
        p = seq.params
        burst = Burst(
            seq.token_ids(start, start + 1)[0],
            start,
            steps,
            list(seq.blocks),
            self._chooser(seq),
            frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids),
            deadline=seq.deadline,
        )
        self._halt = burst.halt  # nothing waits now (_burst_steps): add_request and abort set it
        self._stepping, began = True, time.perf_counter()
        try:
            tokens = await self.model.decode_burst(burst, self.cache)
        except MoeMeshError as e:  # e.g. its deadline passed: as a failed micro-batch ends
            outputs += self._fail([seq], e)
            return True
        finally:
            burst.halt.value = 1  # left running (this step was cancelled): its next token ends it
            self._stepping, self._halt = False, None
        if tokens is None:
            return False
        self.pace.ran(time.perf_counter() - began, len(tokens))
        if not seq.aborted:
            out = self._appended(seq, tokens)
            # After the tokens are the sequence's: the prefix cache keys its full blocks by them.
            self.scheduler.computed([Chunk(seq, start, len(out.new_token_ids))])
            outputs.append(out)
            if out.finish_reason is not None:
                self._release([seq])
        self._hand_over(outputs)
        return True

    def _chooser(self, seq: Sequence) -> Callable[[torch.Tensor, int], int] | None:
        """How a burst picks `seq`'s token at a position from its logits, as _next_token does;
        None where that is the greedy token (computed beside the step)."""
        p = seq.params
        if p.greedy:
            return None
        if seq.seed is None:
            return lambda logits, _: sample(logits, p, None)
        generator = torch.Generator()  # the burst's own: it runs on the compute thread
        return lambda logits, at: sample(
            logits, p, generator.manual_seed(position_seed(seq.seed, at))
        )

    def _appended(self, seq: Sequence, tokens: list[int]) -> StepOutput:
        """A burst's `tokens` appended to `seq`, up to the first that ends it."""
        new: list[int] = []
        reason = None
        for token in tokens:
            seq.output.append(token)
            new.append(token)
            if (reason := self._finish_reason(seq, token)) is not None:
                break
        return StepOutput(seq.request_id, new, reason, len(seq.prompt), len(seq.output))

    def _burst_steps(self, chunks: list[Chunk]) -> int:
        """How many decode steps this step may run at once: a burst's length (Pace) for one
        sequence that runs alone, with nobody waiting, and whose sampling reads nothing but its
        logits (no penalties, logprobs or unmet min_tokens); else 1."""
        n = self.pace.length()
        if n < 2 or len(chunks) != 1 or not chunks[0].decode or len(self.running) != 1:
            return 1
        seq = chunks[0].seq
        p = seq.params
        if not _logits_only(seq) or self.scheduler.has_waiting or not self.model.may_burst():
            return 1
        left = self.model.max_model_len - seq.num_tokens
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - len(seq.output))
        return min(n, left)

    async def _forward(self, prefills: list[Chunk], decodes: list[Chunk]) -> torch.Tensor:
        """One micro-batch's logits [chunks, vocab], prefills first."""
        batch = pack_step(
            [
                (c.seq.blocks, c.start, c.seq.token_ids(c.start, c.start + c.length))
                for c in prefills
            ],
            [
                (c.seq.blocks, c.seq.token_ids(c.start, c.start + 1)[0], c.start + 1)
                for c in decodes
            ],
            self.cache.block_size,
        )
        deadlines = [c.seq.deadline for c in prefills + decodes]
        # Expert calls serve every sequence of the micro-batch: they may run until the latest deadline.
        batch.deadline = None if None in deadlines else max(deadlines)  # type: ignore[type-var]
        costs = PassCosts()
        logits = await self.model.forward(batch, self.cache, costs=costs)
        if not prefills:
            self.planner.observe(len(decodes), costs)
        return logits

    def _next_token(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        """Sample and append one token; a sampling failure ends this sequence only."""
        p = seq.params
        if logits.device.type != "cpu" and not (p.greedy and _logits_only(seq)):
            # A GPU's logits row comes to host memory only where sampling reads more than its
            # argmax: a plain greedy row is argmaxed where it is ([sequences, vocab] float32 is
            # ~78 MB a step at 128 sequences and Qwen3's vocabulary).
            logits = logits.cpu()
        try:
            gen = None
            # The token's absolute position picks its randomness: see sampling.py.
            if seq.seed is not None:
                gen = self._generator.manual_seed(position_seed(seq.seed, seq.num_tokens))
            token = sample(self._processed(seq, logits), seq.params, gen)
            logprobs = (
                None
                if seq.params.logprobs is None
                else [token_logprobs(logits, token, seq.params.logprobs)]
            )
        except Exception as e:
            if device_lost(e):  # its first read of the device may be here: step() lets it through
                raise
            log.exception("sampling failed for request %s", seq.request_id)
            return _ended(seq, FinishReason.ERROR, InternalError(f"sampling failed: {e!r}"))
        seq.output.append(token)
        reason = self._finish_reason(seq, token)
        return StepOutput(
            seq.request_id, [token], reason, len(seq.prompt), len(seq.output), None, logprobs
        )

    def _processed(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the request's penalties, and its ending tokens barred until min_tokens."""
        p = seq.params
        if p.penalized:
            logits = penalized_logits(logits, p, seq.prompt, seq.output)
        if len(seq.output) < p.min_tokens:
            ending = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_ids)]
            if ending:
                logits = logits.float().index_fill(
                    0, torch.tensor(ending, dtype=torch.long), float("-inf")
                )
        return logits

    def fail_all(self, error: MoeMeshError) -> list[StepOutput]:
        """End every request, running or waiting, with `error` and start empty.

        The last resort when the serving loop died mid-step and the batch state cannot be trusted.
        """
        seqs = list(self._by_id.values())
        self.scheduler.clear()
        self._by_id, self._cancelled, self._pending = {}, [], []
        self._stepping = False
        return [_ended(s, FinishReason.ERROR, error) for s in seqs if not s.aborted]

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.model.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, finished: list[Sequence]) -> None:
        """Free the KV blocks of sequences that ended and forget them."""
        self.scheduler.finish(finished)
        for seq in finished:
            self._by_id.pop(seq.request_id, None)

    def _fail(self, seqs: list[Sequence], error: MoeMeshError) -> list[StepOutput]:
        """End every sequence of a failed step: its KV cache is incomplete for this step."""
        self._release(seqs)
        self._reap_cancelled()
        failed = [_ended(s, FinishReason.ERROR, error) for s in seqs if not s.aborted]
        outputs, self._pending = failed + self._pending, []
        return outputs

    def _reap_cancelled(self) -> None:
        cancelled, self._cancelled = self._cancelled, []
        self._release(cancelled)
        for seq in cancelled:
            self._by_id.pop(seq.request_id, None)
            self._pending.append(_ended(seq, FinishReason.CANCELLED))


def _ended(seq: Sequence, reason: FinishReason, error: MoeMeshError | None = None) -> StepOutput:
    """A sequence's last output, with no token."""
    return StepOutput(seq.request_id, [], reason, len(seq.prompt), len(seq.output), error)


def _logits_only(seq: Sequence) -> bool:
    """Whether sampling `seq`'s next token reads nothing but the step's logits: no penalties
    (its tokens so far), no logprobs, no ending tokens barred by min_tokens."""
    p = seq.params
    return not p.penalized and p.logprobs is None and len(seq.output) >= p.min_tokens


def _partition(
    prefills: list[Chunk], decodes: list[Chunk], m: int
) -> list[tuple[list[Chunk], list[Chunk]]]:
    """Split a step into at most m micro-batches of about equal tokens, in order (prefills, then
    decodes). A sequence is in one micro-batch and writes only its own unshared blocks, so
    micro-batches never write the same blocks."""
    chunks = prefills + decodes
    weights = [c.length for c in chunks]
    total, parts, current, acc = sum(weights), [], [], 0
    for chunk, w in zip(chunks, weights):
        current.append(chunk)
        acc += w
        if len(parts) < m - 1 and acc * m >= total * (len(parts) + 1):
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    n = len(prefills)
    out, start = [], 0
    for part in parts:
        end = start + len(part)
        out.append((chunks[start : min(end, n)], chunks[max(start, n) : end]))
        start = end
    return out
