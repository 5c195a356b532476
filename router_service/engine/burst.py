"""Decode bursts: several decode steps of a lone sequence in one engine step.

At batch 1 on a CPU a decode step is one kernel call (fused.py) and around it about 1.5 ms of
Python in the engine (scheduling, packing, the compute thread's hand-off, sampling, routing
counts): 10-15% of a step of the `small` model on 2 cores. When one sequence runs alone and
sampling reads nothing but its logits, its next input is drawn from this step's logits (the
argmax, or by its seeded generator for that position), so the compute thread can feed it
straight back: a burst runs up to `decode_burst` steps back to back and returns their tokens
together.

A burst ends early at an ending token, at the deadline, and as soon as a request waits or the
sequence is cancelled, so nobody waits longer than one step for it. Its tokens are those single
steps give: the same kernel on the same inputs, and the same sampling (its randomness is seeded
by position, engine/sampling.py).

A greedy burst on the one-call step of bfloat16 or quantized weights, the LM head in the call,
runs whole in C (FusedDecode.greedy_steps): stepping in Python cost 0.2 ms a token on host C
(Intel Xeon, 2 vCPUs), its interpreter's code and data cold once a step's weights went through
the caches.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from router_service.engine.fused import FusedDecode
from router_service.engine.fused_f32 import FusedDecodeF32
from router_service.engine.layers import Rope
from router_service.settings import MAX_DECODE_BURST


@dataclass
class Burst:
    token: int  # the first step's input: the sequence's last token
    start: int  # its position
    steps: int  # at most this many steps
    table: list[int]  # the block table; it covers positions up to start + steps - 1
    # The token from logits [vocab], at a position; None: the greedy one (FusedDecode.greedy_steps)
    choose: Callable[[torch.Tensor, int], int] | None
    ending: frozenset[int]  # tokens that end the sequence
    # Set (by the engine, on the event loop's thread) once a request waits or the sequence is
    # cancelled: a C int, which a burst in C reads too
    halt: ctypes.c_int = field(default_factory=ctypes.c_int)
    deadline: float | None = None  # time.monotonic()


@dataclass
class Pace:
    """A burst's length: `steps` (--decode-burst), or where more of the last burst's steps fit
    in `window_s` (--decode-burst-ms), that many, up to MAX_DECODE_BURST. Fast steps then stream
    in bursts about window_s long, and pay what a burst costs beside its steps less often."""

    steps: int
    window_s: float
    step_s: float | None = None  # the last burst's seconds a step

    def length(self) -> int:
        if self.steps < 2 or self.window_s <= 0 or not self.step_s:  # 1: no bursts
            return self.steps
        return max(self.steps, min(MAX_DECODE_BURST, int(self.window_s / self.step_s)))

    def ran(self, seconds: float, steps: int) -> None:
        if steps:
            self.step_s = seconds / steps


def run(
    one: FusedDecode | FusedDecodeF32, rope: Rope, block_size: int, burst: Burst
) -> tuple[list[int], list[list[int]]]:
    """`burst`'s tokens, computed on `one`, and each MoE layer's experts over its steps."""
    if burst.choose is None and isinstance(one, FusedDecode):  # greedy: the whole burst in C
        b = burst
        done = one.greedy_steps(
            b.token, b.start, b.steps, b.table, block_size, rope, b.ending, b.halt, b.deadline
        )
        if done is not None:
            return done
    table = torch.tensor([burst.table], dtype=torch.int64)
    tokens: list[int] = []
    chosen: list[list[int]] = [[] for _ in range(one.chosen.shape[0])]
    token = burst.token
    for i in range(burst.steps):
        late = burst.deadline is not None and time.monotonic() >= burst.deadline
        if i and (late or burst.halt.value):
            break
        position = burst.start + i
        slot = burst.table[position // block_size] * block_size + position % block_size
        if burst.choose is None:
            token = one.greedy_at(token, position, table, position + 1, slot, rope)
        else:
            logits = one.at(token, position, table, position + 1, slot, rope)[0]
            token = burst.choose(logits, position + 1)
        tokens.append(token)
        for layer, experts in zip(chosen, one.routed()):
            layer += experts
        if token in burst.ending:
            break
    return tokens, chosen
