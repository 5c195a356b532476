"""Tiered placement over expert-service processes: live re-tiering, identical outputs, regions, flags."""

from __future__ import annotations

import asyncio
import random
import re
import sys

import grpc
import pytest

from common.registry import open_registry
from common.sampling import SamplingParams
from moe_mesh.local.processes import start_experts
from moe_mesh.local.registry import EmbeddedConsul
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from router_service.app import RouterApp
from router_service.build import build_router
from router_service.settings import RouterSettings
from tests.support.polling import calls, eventually
from tests.support.reference import ALL_REMOTE, PROMPTS, monolithic, run_engine


async def warm_up_and_tier(path, tmp_path, budget: str, prompts: list[list[int]]):
    experts = await asyncio.to_thread(start_experts, path, ALL_REMOTE, tmp_path)
    parts = await build_router(
        RouterSettings(
            checkpoint=path,
            expert_endpoints=[e.address for e in experts],
            colocate_budget=budget,
            tier_min_dwell_s=0,
        )
    )
    try:
        await run_engine(
            parts.engine, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
        await parts.tierer.step()
        return parts, experts
    except BaseException:
        await close(parts, experts)
        raise


async def close(parts, experts) -> None:
    for r in parts.remotes:
        await r.close()
    for e in experts:
        await asyncio.to_thread(e.stop)


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(24)] for _ in range(n)]


async def test_skewed_traffic_colocates_the_hottest_experts_up_to_the_budget(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral", router_skew=4.0)
    parts, experts = await warm_up_and_tier(
        path, tmp_path, "17%", random_prompts(12, 500)
    )  # 4 of 24 experts
    try:
        tierer, d = parts.tierer, parts.engine.model.dispatcher
        load = d.window.counts()
        mean = load.sum(1, keepdim=True) / load.shape[1]
        ranked = sorted(
            ((float(load[p]), p) for p in map(tuple, (load >= 1.5 * mean).nonzero().tolist())),
            reverse=True,
        )
        assert len(ranked) > 4  # more hot experts than the budget holds: it is the limit
        assert tierer.hot == {p for _, p in ranked[:4]}
        assert (
            tierer.colocated_bytes() == 4 * tierer.config.expert_bytes <= tierer.config.budget_bytes
        )
        assert all(d.placement[p][0].local and len(d.placement[p]) == 2 for p in tierer.hot)

        before = d.tokens_colocated
        assert tuple(map(tuple, await run_engine(parts.engine, PROMPTS))) == monolithic(path)
        assert d.tokens_colocated > before  # the hot experts now run in-process
    finally:
        await close(parts, experts)


async def test_router_service_retiers_live_and_reports_its_tiers(checkpoint, tmp_path) -> None:
    path = checkpoint("mixtral", router_skew=4.0)
    experts = await asyncio.to_thread(start_experts, path, ALL_REMOTE, tmp_path)
    app = await RouterApp.create(
        RouterSettings(
            checkpoint=path,
            expert_endpoints=[e.address for e in experts],
            colocate_budget="17%",
            tier_interval_s=0.2,
            tier_min_dwell_s=0,
        )
    )
    address = await app.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            params = router_pb2.SamplingParams(
                max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True
            )
            for p in random_prompts(12, 500):
                async for _ in stub.Generate(
                    router_pb2.RouterGenerateRequest(prompt_token_ids=p, params=params)
                ):
                    pass

            async def status() -> router_pb2.RouterStatus:
                return await stub.Status(router_pb2.RouterStatusRequest(), timeout=5)

            async def promoted() -> bool:
                return (await status()).promotions >= 4

            await eventually(promoted, what="the background re-tiering")
            st = await status()
            colocated = next(p.experts for p in st.placement if p.backend == "colocated")
            assert (
                st.colocated_bytes == 4 * st.expert_bytes
                and st.colocate_budget_bytes >= st.colocated_bytes
            )
            assert sum(st.utilization) == sum(st.tokens_routed) > 0 and list(st.moe_layers) == [
                0,
                1,
                2,
            ]

            shown = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "moe_mesh",
                "placement",
                "show",
                "--router",
                address,
                stdout=asyncio.subprocess.PIPE,
            )
            text = (await shown.communicate())[0].decode()
            assert (
                shown.returncode == 0 and colocated in text and len(re.findall(r"\d+H", text)) == 4
            ), text
    finally:
        await app.stop()
        for e in experts:
            await asyncio.to_thread(e.stop)


async def test_unskewed_traffic_colocates_few_or_none(checkpoint, tmp_path) -> None:
    path = checkpoint("mixtral")
    parts, experts = await warm_up_and_tier(path, tmp_path, "50%", random_prompts(12, 500))
    try:
        assert len(parts.tierer.hot) <= 2
    finally:
        await close(parts, experts)


async def test_greedy_outputs_identical_while_experts_move_between_tiers(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    experts = await asyncio.to_thread(start_experts, path, ALL_REMOTE, tmp_path)
    parts = await build_router(
        RouterSettings(checkpoint=path, expert_endpoints=[e.address for e in experts])
    )
    tierer, engine = parts.tierer, parts.engine
    pairs = sorted(parts.engine.model.dispatcher.placement)
    rng = random.Random(1)
    moves_during_generation = 0

    async def churn() -> None:
        nonlocal moves_during_generation
        while True:
            await tierer.apply(set(rng.sample(pairs, rng.randrange(len(pairs) + 1))))
            moves_during_generation += engine.has_unfinished()
            await asyncio.sleep(0.002)

    try:
        task = asyncio.create_task(churn())
        try:
            for _ in range(2):
                assert tuple(map(tuple, await run_engine(engine, PROMPTS))) == monolithic(path)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert tierer.promotions > 10 and tierer.demotions > 10 and moves_during_generation > 10
    finally:
        await close(parts, experts)


async def test_router_uses_its_region_falls_back_and_returns(
    checkpoint, tmp_path, monkeypatch
) -> None:
    path = checkpoint("mixtral")
    expected = monolithic(path)
    registry = EmbeddedConsul()
    address = await registry.start()
    monkeypatch.setenv("CONSUL_HTTP_ADDR", address)

    async def expert_in(region: str, name: str):
        (tmp_path / name).mkdir()
        [proc] = await asyncio.to_thread(
            start_experts,
            path,
            ["*:0-7"],
            tmp_path / name,
            "--registry",
            "consul",
            "--region",
            region,
        )
        return proc

    a, b = await expert_in("a", "a1"), await expert_in("b", "b1")
    # No hedging: on a loaded machine a slow call to region a would also go to b, and this test
    # counts which region served.
    settings = RouterSettings(
        checkpoint=path,
        registry="consul",
        registry_address=address,
        region="a",
        hedge_min_delay_s=60.0,
    )
    parts = await build_router(settings, open_registry("consul", address))
    membership, procs = parts.membership, [a, b]
    try:
        await eventually(
            lambda: len(membership.backends) == 2, what="both regions in the placement"
        )
        assert tuple(map(tuple, await run_engine(parts.engine, PROMPTS))) == expected
        assert await calls(a.address) > 0 and await calls(b.address) == 0

        assert await asyncio.to_thread(a.stop) == 0  # region a goes away: b serves
        await eventually(lambda: len(membership.backends) == 1, what="region a to leave")
        assert tuple(map(tuple, await run_engine(parts.engine, PROMPTS))) == expected
        served_by_b = await calls(b.address)
        assert served_by_b > 0

        a2 = await expert_in("a", "a2")  # region a is back: the router returns to it
        procs.append(a2)
        await eventually(lambda: len(membership.backends) == 2, what="region a to come back")
        assert tuple(map(tuple, await run_engine(parts.engine, PROMPTS))) == expected
        assert await calls(a2.address) > 0 and await calls(b.address) == served_by_b
    finally:
        await membership.stop()
        for p in procs:
            await asyncio.to_thread(p.stop)
        await registry.stop()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--colocate-budget", "lots"], "--colocate-budget: 'lots' is not a size"),
        (["--colocate-budget", "120%"], "--colocate-budget: '120%': a percentage is at most 100%"),
        (["--colocate", "0:1", "--pin-remote", "0:1"], "pin_remote"),
        (["--region", "eu west"], "region"),
    ],
)
def test_bad_tiering_flags_fail_clearly(checkpoint, flags, needle) -> None:
    from tests.support.cli import moe_mesh

    out = moe_mesh(
        "serve-router", "--checkpoint", checkpoint("mixtral"), "--expert", "127.0.0.1:1", *flags
    )
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, (
        out.stderr
    )
