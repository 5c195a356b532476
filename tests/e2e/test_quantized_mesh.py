"""Precision as a tier, through `moe-mesh up`: cold experts in int4 expert services, hot ones in
bfloat16 in the router, the OpenAI API served throughout, re-tiering under load losing nothing."""

from __future__ import annotations

import asyncio
import json

import openai

from moe_mesh.local.processes import running_up
from router_service.build import build_local_engine
from router_service.settings import RouterSettings
from tests.support.cli import moe_mesh
from tests.support.net import free_port
from tests.support.polling import eventually
from tests.support.reference import ALL_REMOTE, PROMPTS, mesh_engine, run_engine


def _status(ready) -> dict:
    shown = moe_mesh("placement", "show", "--ready-file", ready, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


async def test_hot_experts_move_from_int4_services_to_bfloat16_in_the_router_under_load(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral", dtype="bfloat16", router_skew=4.0)
    ready = tmp_path / "mesh.json"
    router = "--colocate-budget 17% --tier-interval-s 0.3 --tier-min-dwell-s 0"
    flags = [
        *("--expert-services", "2", "--quantize", "int4", "--quantize-group-size", "32"),
        *("--grpc-port", str(free_port()), "--http-port", str(free_port())),
        f"--router-arg={router}",
    ]
    with running_up(
        path, flags, ready_file=ready, run_dir=tmp_path / "run", log_path=tmp_path / "up.log",
        ready_timeout_s=120, stop_timeout_s=60,
    ) as running:  # fmt: skip
        before = _status(ready)
        assert {s["precision"] for s in before["services"]} == {"int4-g32"}
        base = f"http://{running.info['gateway_http']}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            failures: list[BaseException] = []

            async def stream(i: int) -> None:
                try:
                    out = await client.completions.create(
                        model=model,
                        prompt=f"request {i}: the mesh",
                        max_tokens=12,
                        temperature=0.0,
                    )
                    assert out.choices[0].text and out.usage.completion_tokens >= 1
                except BaseException as e:  # counted, not raised: the load goes on
                    failures.append(e)

            async def promoted() -> bool:
                await asyncio.gather(*(stream(i) for i in range(4)))
                routers = (await asyncio.to_thread(_status, ready))["routers"]
                return any(r["promotions"] >= 1 for r in routers)

            await eventually(promoted, 60, "a promotion of an int4 expert into the router")
            await asyncio.gather(*(stream(i) for i in range(8)))
        after = _status(ready)
        assert failures == []
        (r,) = after["routers"]
        assert r["colocated"] and r["precision"] == "bfloat16"
        assert {s["precision"] for s in after["services"]} == {"int4-g32"}
        shown = moe_mesh("placement", "show", "--ready-file", ready)
        assert "int4-g32" in shown.stdout and "bfloat16" in shown.stdout
        status = json.loads(moe_mesh("status", "--ready-file", ready, "--json").stdout)
        assert {e["precision"] for e in status["experts"]} == {"int4-g32"}


def test_int8_expert_services_give_the_tokens_of_an_int8_engine(checkpoint, tmp_path) -> None:
    """The same kernels in both places, a row's bits independent of its batch-mates: the mesh of
    int8 expert services decodes what the monolithic engine with int8 experts decodes."""
    path = checkpoint("mixtral", dtype="bfloat16")
    engine = build_local_engine(RouterSettings(checkpoint=path, quantize="int8"))
    try:
        local = asyncio.run(run_engine(engine, PROMPTS))
    finally:
        engine.close()

    async def remote() -> list[list[int]]:
        args = ("--quantize", "int8")
        async with mesh_engine(path, ALL_REMOTE, tmp_path, expert_args=args) as (mesh, _):
            return await run_engine(mesh, PROMPTS)

    assert asyncio.run(remote()) == local
