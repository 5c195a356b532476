"""Runs of the engine the one-call and burst tests compare: a model's decode steps after a
prefill, and an engine's requests to the end."""

from __future__ import annotations

import asyncio

import torch

from common.sampling import SamplingParams
from router_service.engine.engine import Engine, FinishReason
from router_service.engine.model import MoeModel, pack_step

BLOCK = 4
PROMPT = [5, 9, 11, 3, 7, 2]


def prompts(sequences: int) -> list[list[int]]:
    """A prompt each, of different tokens and lengths: their tokens route differently."""
    return [[(t + 7 * s) % 50 + 1 for t in PROMPT][: len(PROMPT) - s % 3] for s in range(sequences)]


def decode(m: MoeModel, steps: int, sequences: int = 1) -> tuple[list[torch.Tensor], int]:
    """Greedy logits of `steps` decode steps after the prompts' prefill, and how many of those
    steps ran as one call."""
    calls = 0
    if m.fused is not None:
        step = m.fused.step

        def counted(*args):
            nonlocal calls
            calls += 1
            return step(*args)

        m.fused.step = counted

    async def run() -> list[torch.Tensor]:
        cache, out = m.new_cache(16 * sequences, BLOCK), []
        tables = [list(range(s * 16, s * 16 + 16)) for s in range(sequences)]
        prefills = [(t, 0, p) for t, p in zip(tables, prompts(sequences))]
        logits = await m.forward(pack_step(prefills, [], BLOCK), cache)
        for i in range(steps):
            tokens = logits.argmax(dim=-1).tolist()
            decodes = [(t, a, len(p[2]) + 1 + i) for t, a, p in zip(tables, tokens, prefills)]
            logits = await m.forward(pack_step([], decodes, BLOCK), cache)
            out.append(logits)
        return out

    try:
        return asyncio.run(run()), calls
    finally:
        m.close()


def run(
    e: Engine, requests: dict[str, SamplingParams], prompt: list[int] = PROMPT, close: bool = True
) -> tuple[dict, list[dict]]:
    """Each request's tokens and finish reason, and each step's new tokens per request."""
    for rid, params in requests.items():
        e.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], FinishReason | None]] = {}
    steps: list[dict[str, int]] = []

    async def drive() -> None:
        while e.has_unfinished():
            step = {}
            for o in await e.step():
                ids, _ = out.get(o.request_id, ([], None))
                out[o.request_id] = (ids + o.new_token_ids, o.finish_reason)
                step[o.request_id] = len(o.new_token_ids)
            steps.append(step)

    try:
        asyncio.run(drive())
    finally:
        if close:
            e.close()
    return out, steps
