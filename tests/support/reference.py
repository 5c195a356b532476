"""The prompts mesh tests use and what the monolithic engine answers to them (the reference every
placement, transport and fault must reproduce), plus a router engine over expert-service processes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path

from common.sampling import SamplingParams
from moe_mesh.local.processes import start_experts, stop_all
from router_service.build import build_local_engine, build_router
from router_service.engine.engine import Engine, FinishReason
from router_service.settings import RouterSettings

PROMPTS = [[7], [11, 3, 250, 9, 31], list(range(40, 53)), [(i * 37) % 400 + 5 for i in range(29)]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# Every expert remote, over two service processes: a token's experts still often sit in both, and
# each process more costs the suite ~3.5 s of start-up.
ALL_REMOTE = ["*:0-3", "*:4-7"]


async def run_engine(
    engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Every request's whole output; each must end with a finish reason (LENGTH when EOS is ignored)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason | None] = {}
    while engine.has_unfinished():
        for o in await engine.step():
            if o.error is not None:
                raise o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            reasons[o.request_id] = o.finish_reason
    for rid, tokens in out.items():
        if params.ignore_eos and not params.stop_token_ids:
            assert (reasons[rid], len(tokens)) == (FinishReason.LENGTH, params.max_tokens), (
                rid,
                reasons[rid],
                tokens,
            )
        else:
            assert reasons[rid] in (FinishReason.STOP, FinishReason.LENGTH), (
                rid,
                reasons[rid],
                tokens,
            )
    return [out[str(i)] for i in range(len(prompts))]


@cache
def monolithic(path: Path) -> tuple[tuple[int, ...], ...]:
    """Greedy outputs of the in-process engine (run on a worker thread: tests calling this own a running loop)."""
    engine = build_local_engine(RouterSettings(checkpoint=path))
    with ThreadPoolExecutor(1) as pool:
        return tuple(
            map(tuple, pool.submit(lambda: asyncio.run(run_engine(engine, PROMPTS))).result())
        )


@asynccontextmanager
async def mesh_engine(
    path: Path, specs: list[str], workdir: Path, expert_args: Sequence[str] = (), **settings
):
    """Expert-service processes for `specs` (with `expert_args`, e.g. a --dtype) and an in-process
    router engine using them; `settings` are the router's."""
    experts = start_experts(path, specs, workdir, *expert_args)
    try:
        parts = await build_router(
            RouterSettings(
                checkpoint=path, expert_endpoints=[e.address for e in experts], **settings
            )
        )
        try:
            yield parts.engine, experts
        finally:
            await parts.engine.model.dispatcher.close()
            for r in parts.remotes:
                await r.close()
    finally:
        stop_all(experts)
