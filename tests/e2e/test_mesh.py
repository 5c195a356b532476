"""The mesh: a router dispatching to expert-service processes gives the monolithic engine's output."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import replace

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.errors import ExpertUnavailableError
from common.fastpath.ucx import load_ucxx
from moe_mesh.local.processes import ServiceProcess
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc
from router_service.engine.engine import FinishReason
from router_service.engine.model import pack_step
from tests.support.hf import greedy as hf_greedy
from tests.support.polling import calls
from tests.support.reference import ALL_REMOTE, GREEDY, PROMPTS, mesh_engine, monolithic, run_engine


@pytest.mark.parametrize(
    "arch",
    ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "glm4_moe"],
)
async def test_all_remote_mesh_matches_monolithic_and_transformers(
    checkpoint, tmp_path, arch
) -> None:
    path = checkpoint(arch)
    async with mesh_engine(path, ALL_REMOTE, tmp_path) as (engine, _):
        dispatcher = engine.model.dispatcher
        assert all(not b.local for bs in dispatcher.placement.values() for b in bs)
        tokens = await run_engine(engine, PROMPTS)
        assert tuple(map(tuple, tokens)) == monolithic(path) == hf_greedy(path)  # the latter cached
        if load_ucxx(loopback=True) is not None:
            # The fast path is on by default, over UCX's shared memory here (test_fastpath.py runs
            # UCX_TLS=tcp): it carried every call, and none fell back.
            links = {b.fast_path for bs in dispatcher.placement.values() for b in bs}
            assert None not in links and not any(link.fallbacks for link in links)
            assert sum(link.calls for link in links) == dispatcher.remote_calls > 0

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        cache_ = engine.model.new_cache(len(PROMPTS) * 4, 16)
        tables = [[4 * i + b for b in range(4)] for i in range(len(PROMPTS))]
        logits = await engine.model.forward(
            pack_step([(t, 0, p) for t, p in zip(tables, PROMPTS)], [], 16), cache_, all_logits=True
        )
        row = 0
        for prompt in PROMPTS:
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0]
            assert (logits[row : row + len(prompt)] - ref).abs().max().item() <= 1e-4
            row += len(prompt)


async def test_dbrx_top4_of_16_all_remote_with_joins_and_leaves_matches_transformers(
    checkpoint, tmp_path
) -> None:
    """DBRX's published routing shape (4 of 16 experts, weights over their p-norm, here 2) with
    clipped q/k/v, every expert remote, requests joining mid-run and leaving early."""
    overrides = {
        "attn_config": {"clip_qkv": 0.2},
        "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "moe_normalize_expert_weights": 2.0},
    }
    path = checkpoint("dbrx", overrides=overrides)
    plan = {0: [(0, 32), (1, 6)], 3: [(2, 32)], 9: [(3, 10)]}  # step -> [(prompt, max_tokens)]
    got: dict[str, list[int]] = {}
    async with mesh_engine(path, ["*:0-7", "*:8-15"], tmp_path) as (engine, _):
        assert all(not b.local for bs in engine.model.dispatcher.placement.values() for b in bs)
        step = 0
        while step <= max(plan) or engine.has_unfinished():
            for i, n in plan.get(step, []):
                engine.add_request(str(i), PROMPTS[i], replace(GREEDY, max_tokens=n))
            for out in await engine.step():
                assert out.error is None, out.error
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            step += 1
    want = hf_greedy(path)
    assert got == {str(i): list(want[i][:n]) for runs in plan.values() for i, n in runs}


async def _stats(address: str) -> expert_pb2.ExpertStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return (
            await expert_pb2_grpc.ExpertServiceStub(channel).Describe(expert_pb2.DescribeRequest())
        ).stats


async def test_mixed_placement_with_replicas_matches_monolithic(checkpoint, tmp_path) -> None:
    """Expert 0 colocated; layer 0 spread over three services; (0,3) and (2,7) have two replicas each."""
    path = checkpoint("qwen2_moe")
    specs = ["0:1-4", "0:3,5-7; 2:7", "1-2:1-4", "1-2:5-7"]
    async with mesh_engine(path, specs, tmp_path, colocate="*:0") as (engine, experts):
        placement = engine.model.dispatcher.placement
        assert [b.local for b in placement[(1, 0)]] == [True]
        assert len(placement[(0, 3)]) == 2 and len(placement[(2, 7)]) == 2
        assert tuple(map(tuple, await run_engine(engine, PROMPTS))) == monolithic(path)
        calls = [(await _stats(e.address)).forward_calls for e in experts]
        assert all(c > 0 for c in calls), calls  # every service took part


async def test_unreachable_expert_fails_request_with_its_layer_and_expert(
    checkpoint, tmp_path
) -> None:
    path = checkpoint("mixtral")
    async with mesh_engine(path, ["*:0-3", "*:4-7", "*:4-7"], tmp_path) as (engine, experts):
        experts[1].proc.kill()  # one of two replicas of experts 4-7: requests fail over and succeed
        experts[1].proc.wait(5)
        assert tuple(map(tuple, await run_engine(engine, PROMPTS[:2]))) == monolithic(path)[:2]
        # Routed around the dead replica: by failover when its death shows at once (gRPC), or by a
        # hedge when the call waits for it (a UCX shared-memory peer is noticed only at timeout).
        dispatcher = engine.model.dispatcher
        assert dispatcher.failovers + dispatcher.hedges_won > 0

        experts[0].proc.kill()  # the only replica of experts 0-3
        experts[0].proc.wait(5)
        engine.add_request("doomed", PROMPTS[1], GREEDY)
        outputs = await engine.step()
        [failed] = [o for o in outputs if o.request_id == "doomed"]
        assert failed.finish_reason is FinishReason.ERROR
        assert isinstance(failed.error, ExpertUnavailableError)
        assert re.search(r"layer \d+ expert\(s\) [0-3]", str(failed.error)), str(failed.error)
        assert experts[0].address in str(failed.error)
        assert not engine.running and not engine.has_unfinished()  # the slot was freed


async def test_a_hung_replica_is_hedged_around_and_tokens_do_not_change(
    checkpoint, tmp_path
) -> None:
    """SIGSTOP one of two replicas mid-service: calls to it are hedged to the other and it is ejected,
    so the batch neither stalls for the 30 s expert timeout nor changes a token."""
    path = checkpoint("mixtral")
    async with mesh_engine(path, ["*:0-7", "*:0-7"], tmp_path) as (engine, experts):
        dispatcher = engine.model.dispatcher
        start = time.monotonic()
        assert tuple(map(tuple, await run_engine(engine, PROMPTS[:2]))) == monolithic(path)[:2]
        undisturbed_s = time.monotonic() - start
        experts[0].signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            tokens = await asyncio.wait_for(run_engine(engine, PROMPTS[:2]), 60)
            hung_s = time.monotonic() - start
        finally:
            experts[0].signal(signal.SIGCONT)
        assert tuple(map(tuple, tokens)) == monolithic(path)[:2]
        assert hung_s < undisturbed_s + 1.0, (hung_s, undisturbed_s)
        assert dispatcher.hedges_won >= 1 and dispatcher.ejections >= 1


async def test_a_killed_replica_restarted_on_its_port_takes_calls_again_within_seconds(
    checkpoint, tmp_path
) -> None:
    """Static endpoints, no registry: one of two replicas of every expert is killed, ejected by the
    calls routed around it, and restarted on its port. Checks of the ejected replica notice it
    answering, so calls reach it within seconds rather than when its ejection (30 s) ends."""
    path = checkpoint("mixtral")
    want = monolithic(path)[:2]
    specs = ["*:0-7", "*:0-7"]
    async with mesh_engine(path, specs, tmp_path, expert_ejection_s=30.0) as (engine, experts):
        dispatcher, victim = engine.model.dispatcher, experts[1]
        [backend] = {
            b for bs in dispatcher.placement.values() for b in bs if b.address == victim.address
        }
        health = dispatcher.replicas.replica(backend).health
        victim.proc.kill()
        victim.proc.wait(5)
        start = time.monotonic()
        while not health.ejected:
            assert time.monotonic() - start < 30, "the killed replica was not ejected"
            assert tuple(map(tuple, await run_engine(engine, PROMPTS[:2]))) == want
        port = victim.address.rsplit(":", 1)[1]
        args = ["--checkpoint", str(path), "--experts", specs[1], "--compute-threads", "1"]
        restarted = ServiceProcess(
            "expert_service", [*args, "--port", port], tmp_path, "expert1-restarted"
        )
        try:
            assert restarted.wait_ready().address == victim.address
            ready = time.monotonic()
            while not await calls(restarted.address):
                assert time.monotonic() - ready < 5, "the restarted replica takes no calls"
                assert tuple(map(tuple, await run_engine(engine, PROMPTS[:2]))) == want
            assert dispatcher.prober.readmitted >= 1
            assert tuple(map(tuple, await run_engine(engine, PROMPTS[:2]))) == want
            assert not health.ejected and health.streak == 0  # its calls succeed again
        finally:
            restarted.stop()
