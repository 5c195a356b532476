"""`moe-mesh autoscale` on a running `moe-mesh up`: under load a group gets a second replica, once
the load stops it goes back to one, and no request fails or changes its tokens meanwhile; every
decision is a JSON line and a metric."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from moe_mesh.local.processes import running_up
from tests.support.metrics import scrape, total
from tests.support.polling import eventually

PROMPTS = [[5, 9, 13], [7, 7, 100, 3], [40, 41, 42, 43, 44], [250, 11]]
# 8 streams compute 300-1000 token rows/s a group on 2 cores (AMD EPYC, busy to idle), an idle mesh
# none: a target of 100 asks for a second replica under load however busy the host is.
POLICY = ["--metric", "token_rows", "--target", "100", "--max-replicas", "2", "--interval-s", "1",
          "--scale-down-window-s", "6", "--step-period-s", "3"]  # fmt: skip


def replicas(ready: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in json.loads(ready.read_text())["experts"]:
        counts[e["experts"]] = counts.get(e["experts"], 0) + 1
    return counts


async def complete(h: httpx.AsyncClient, prompt: list[int]) -> tuple[int, list[int]]:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    r = await h.post("/v1/completions", json=body, timeout=60)
    choice = r.json()["choices"][0] if r.status_code == 200 else {}
    return r.status_code, choice.get("token_ids", [])


async def load_until(
    h: httpx.AsyncClient, done, streams: int = 8
) -> list[tuple[int, list[int], int]]:
    """`streams` clients sending PROMPTS in turn until done() (bounded by eventually's timeout)."""
    out: list[tuple[int, list[int], int]] = []
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        while not stop.is_set():
            k = (i + len(out)) % len(PROMPTS)
            out.append((*await complete(h, PROMPTS[k]), k))

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    try:
        await eventually(done, timeout_s=90, what="a scale-up under load")
        await asyncio.sleep(2)  # the new replica serves part of the load
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return out


async def test_autoscale_scales_a_local_mesh_up_under_load_and_back_down(checkpoint, tmp_path):
    ready, decisions = tmp_path / "mesh.json", tmp_path / "decisions.jsonl"
    with running_up(
        checkpoint("mixtral"), ["--expert-services", "2"], ready_file=ready,
        run_dir=tmp_path / "run", log_path=tmp_path / "up.log", ready_timeout_s=120,
    ) as mesh:  # fmt: skip
        start = replicas(ready)
        async with httpx.AsyncClient(base_url=f"http://{mesh.info['gateway_http']}") as h:
            expected = [await complete(h, p) for p in PROMPTS]  # one at a time: the reference
        exe = shutil.which("moe-mesh", path=str(Path(sys.executable).parent))
        argv = [exe, "autoscale", "--ready-file", str(ready), "--decisions-file", str(decisions),
                "--metrics-port", "0", "--max-duration-s", "150", *POLICY]  # fmt: skip
        scaler = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        try:
            metrics = scaler.stderr.readline().split("http://")[1].split("/metrics")[0]
            async with httpx.AsyncClient(base_url=f"http://{mesh.info['gateway_http']}") as h:
                served = await load_until(h, lambda: max(replicas(ready).values()) == 2)
                await eventually(lambda: replicas(ready) == start, 60, "the scale-down")
                seen = scrape(metrics)
        finally:
            scaler.terminate()
            scaler.wait(30)
            scaler.stderr.close()
    assert all(code == 200 for code, _ in expected)
    assert [(code, tokens) for code, tokens, _ in served] == [expected[k] for *_, k in served]
    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    actions = [e["action"] for e in lines if "action" in e]
    assert "up" in actions and "down" in actions and "failed" not in actions
    up = next(e for e in lines if e.get("action") == "up")
    assert up["load"] > 100 * 1.1 and up["desired"] == 2 and up["metric"] == "token_rows"
    assert {e["group"] for e in lines} == set(start)
    assert {total(seen, "moe_autoscaler_replicas", moe_group=g) for g in start} == {1}
    assert total(seen, "moe_autoscaler_decisions_total", moe_action="down") >= 1
