"""Micro-batches change no token: m = 2, 3, 4 against m = 1 and the monolithic engine (itself
token-exact against transformers, test_parity.py), every attention kind, every expert remote or
some colocated, while requests join and leave mid-run."""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from moe_mesh.local.processes import start_experts, stop_all
from router_service.build import build_router
from router_service.engine.engine import FinishReason
from router_service.settings import RouterSettings
from tests.support.reference import ALL_REMOTE, PROMPTS, monolithic

# The four families the issue names, then the two whose attention keeps its own KV cache (MLA)
# or sinks; dbrx and glm4_moe attend as the first four do (their m = 1 mesh is in test_mesh.py).
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
EVERY_SPLIT = [(colocate, m) for colocate in ("", "*:0,5") for m in ("1", "2", "3", "4")]
# After the first four, two splits each (suite time): all-remote, and with experts colocated.
SOME_SPLITS = [("", "4"), ("*:0,5", "3")]
# step -> [(prompt, max_tokens)]: 0 and 1 start together, 1 leaves early, 2 and 3 join later
SCHEDULE = {0: [(0, 32), (1, 6)], 3: [(2, 32)], 9: [(3, 10)]}


async def drive(engine) -> tuple[dict[str, list[int]], int]:
    """Run SCHEDULE; every request's tokens and the most micro-batches a step used."""
    got: dict[str, list[int]] = {}
    step, most = 0, 1
    while step <= max(SCHEDULE) or engine.has_unfinished():
        for i, n in SCHEDULE.get(step, []):
            engine.add_request(str(i), PROMPTS[i], SamplingParams(n, 0.0, ignore_eos=True))
        for out in await engine.step():
            assert out.error is None, out.error
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.finish_reason is FinishReason.LENGTH
        most = max(most, engine.planner.last)
        step += 1
    return got, most


@pytest.mark.parametrize("family", FAMILIES)
async def test_micro_batches_give_the_same_tokens(family, checkpoint, tmp_path) -> None:
    path = checkpoint(family)
    want = {str(i): list(monolithic(path)[i][:n]) for plan in SCHEDULE.values() for i, n in plan}
    experts = start_experts(path, ALL_REMOTE, tmp_path)
    try:
        for colocate, m in EVERY_SPLIT if family in FAMILIES[:4] else SOME_SPLITS:
            parts = await build_router(
                RouterSettings(
                    checkpoint=path,
                    expert_endpoints=[e.address for e in experts],
                    colocate=colocate,
                    micro_batches=m,
                )
            )
            try:
                got, most = await drive(parts.engine)
            finally:
                for r in parts.remotes:
                    await r.close()
                parts.engine.model.close()
            assert got == want, f"m={m} colocate={colocate!r}"
            # At most three requests run together in SCHEDULE.
            assert most == min(int(m), 3), "the steps were not split as asked"
    finally:
        stop_all(experts)
