"""The router as a gRPC service process in front of expert-service processes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from moe_mesh.local.processes import ServiceProcess, start_experts, stop_all
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc
from tests.support.reference import ALL_REMOTE, PROMPTS, monolithic
from tests.support.routers import LENGTH, generate, request, wait_status


@pytest.fixture
def mesh(checkpoint, tmp_path):
    path = checkpoint("olmoe")
    experts = start_experts(path, ALL_REMOTE, tmp_path)
    # A learned per-call timeout would end calls to a paused expert by itself; at 60 s only the
    # request's deadline (what these tests check) bounds them.
    router = ServiceProcess(
        "router_service",
        [
            "--checkpoint",
            str(path),
            "--expert-call-timeout-min-s",
            "60",
            *sum((["--expert", e.address] for e in experts), []),
        ],
        tmp_path,
        "router",
    )
    try:
        yield path, router.wait_ready(), experts
    finally:
        router.stop()
        stop_all(experts)


async def test_streamed_generation_matches_monolithic_and_errors_map_to_status(mesh) -> None:
    path, router, experts = mesh
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for i in range(len(PROMPTS)):
            tokens, last = [], None
            async for msg in stub.Generate(request(i)):
                tokens += msg.token_ids
                last = msg
            assert tuple(tokens) == monolithic(path)[i]
            assert last.finish_reason == LENGTH and last.completion_tokens == 32

        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(request(0, max_tokens=0)):
                pass
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            bad = router_pb2.RouterGenerateRequest(
                request_id="bad", prompt_token_ids=[10**6], params=request(0).params
            )
            async for _ in stub.Generate(bad):
                pass
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "prompt_token_ids" in e.value.details()
        )

        # A paused expert service: the call ends at the deadline and so does the router's work on it
        # (the expert call carries the deadline), while the expert is still paused.
        experts[0].signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, request(1), timeout=2.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The expert stays paused: only the deadline reaching its call frees the router.
            await wait_status(stub, lambda st: st.running == 0 and st.waiting == 0, timeout_s=30)
        finally:
            experts[0].signal(signal.SIGCONT)
        assert await generate(stub, request(1)) == (monolithic(path)[1], LENGTH)

        experts[0].proc.kill()
        experts[0].proc.wait(5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(request(2), timeout=20):
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (
            "no reachable replica for layer" in e.value.details()
            and experts[0].address in e.value.details()
        )


async def test_cancelling_a_request_while_its_remote_step_is_in_flight_frees_it(mesh) -> None:
    path, router, experts = mesh
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        experts[0].signal(signal.SIGSTOP)  # the request's first step now waits on this expert
        try:
            call = stub.Generate(request(3))
            before = await wait_status(stub, lambda st: st.running == 1, timeout_s=5.0)
            # Waiting for something not to happen needs a window: no step completes in it.
            await asyncio.sleep(0.3)
            assert (
                await stub.Status(router_pb2.RouterStatusRequest())
            ).steps == before.steps  # stuck in the step
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()
        finally:
            experts[0].signal(signal.SIGCONT)
        await wait_status(stub, lambda st: st.running == 0 and st.waiting == 0, timeout_s=5.0)
        assert await generate(stub, request(3)) == (monolithic(path)[3], LENGTH)
        assert await generate(stub, request(0)) == (monolithic(path)[0], LENGTH)


def test_router_refuses_expert_service_of_another_checkpoint(checkpoint, tmp_path: Path) -> None:
    experts = start_experts(checkpoint("olmoe", seed=7), ["*:*"], tmp_path, "--model-id", "m")
    try:
        router = ServiceProcess(
            "router_service",
            [
                "--checkpoint",
                str(checkpoint("olmoe")),
                "--model-id",
                "m",
                "--expert",
                experts[0].address,
                "--connect-timeout-s",
                "10",
            ],
            tmp_path,
            "router",
        )
        try:
            assert router.proc.wait(60) == 2
            log = router.log()
            assert "weights_checksum" in log and experts[0].address in log
        finally:
            router.stop()
    finally:
        stop_all(experts)
