"""The router as a gRPC service process in front of expert-service processes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_mesh.protos.moe_mesh.v1 import router_pb2, router_pb2_grpc, types_pb2
from moe_mesh.router_service.app import SERVICE_NAME, RouterApp
from moe_mesh.router_service.settings import RouterSettings
from tests.support.processes import ServiceProcess, start_experts
from tests.support.reference import PROMPTS, monolithic

pytestmark = pytest.mark.e2e  # router and expert-service processes

LENGTH = types_pb2.FINISH_REASON_LENGTH


def request(
    i: int, max_tokens: int = 32, request_id: str | None = None, **params
) -> router_pb2.RouterGenerateRequest:
    sampling = router_pb2.SamplingParams(
        **{"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True, **params}
    )
    return router_pb2.RouterGenerateRequest(
        request_id=request_id or f"r{i}", prompt_token_ids=PROMPTS[i], params=sampling
    )


async def generate(
    stub, req: router_pb2.RouterGenerateRequest, timeout: float = 20.0
) -> tuple[tuple[int, ...], int]:
    """The whole stream: every token and the finish reason of the last message."""
    tokens, reason = [], None
    async for msg in stub.Generate(req, timeout=timeout):
        tokens += msg.token_ids
        reason = msg.finish_reason
    return tuple(tokens), reason


async def wait_status(
    stub, ok: Callable[[router_pb2.RouterStatus], bool], timeout_s: float
) -> router_pb2.RouterStatus:
    """Poll Status until `ok` holds; fail with the last status after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = await stub.Status(router_pb2.RouterStatusRequest(), timeout=5)
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"router status did not settle in {timeout_s}s: {st}"
        await asyncio.sleep(0.05)


@pytest.fixture
def mesh(checkpoint, tmp_path):
    path = checkpoint("olmoe")
    experts = start_experts(path, ["*:0-3", "*:4-7"], tmp_path)
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
        for e in experts:
            e.stop()


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
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, request(1), timeout=2.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 4.0
            await wait_status(stub, lambda st: st.running == 0 and st.waiting == 0, timeout_s=2.0)
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
        for e in experts:
            e.stop()


@pytest.fixture
async def local_router(checkpoint):
    """An in-process router (every expert colocated) serving gRPC on loopback."""
    app = await RouterApp.create(RouterSettings(checkpoint=checkpoint("olmoe"), max_loop_deaths=3))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.server.address) as channel:
            yield (
                app,
                router_pb2_grpc.RouterServiceStub(channel),
                health_pb2_grpc.HealthStub(channel),
            )
    finally:
        await app.stop()


async def test_tiny_temperature_is_greedy_and_does_not_stop_the_router(
    local_router, checkpoint
) -> None:
    app, stub, _ = local_router
    expected = monolithic(checkpoint("olmoe"))
    # 1e-45 (a float32 denormal) once made torch.multinomial raise and ended the serving loop.
    assert await generate(stub, request(1, temperature=1e-45, seed=1), timeout=10) == (
        expected[1],
        LENGTH,
    )
    assert await generate(stub, request(2, temperature=1e-45), timeout=10) == (expected[2], LENGTH)
    assert await generate(stub, request(0), timeout=10) == (expected[0], LENGTH)
    assert app.core.loop_deaths == 0


async def test_duplicate_request_id_in_flight_is_already_exists(local_router, checkpoint) -> None:
    app, stub, _ = local_router
    gate = asyncio.Event()
    forward = app.core.engine.model.forward

    async def gated(
        *args, **kwargs
    ):  # holds the first request in flight until the duplicate was refused
        await asyncio.wait_for(gate.wait(), 10)
        return await forward(*args, **kwargs)

    app.core.engine.model.forward = gated
    first = asyncio.ensure_future(generate(stub, request(0, request_id="same")))
    await wait_status(stub, lambda st: st.running == 1, timeout_s=5.0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(1, request_id="same"), timeout=5)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and e.value.details().startswith(
        "request_id:"
    )
    gate.set()
    assert await first == (
        monolithic(checkpoint("olmoe"))[0],
        LENGTH,
    )  # the holder of the id is unaffected


async def test_engine_loop_deaths_restart_it_then_report_not_serving(
    local_router, checkpoint
) -> None:
    app, stub, health = local_router
    expected = monolithic(checkpoint("olmoe"))
    real_step = app.core.engine.step

    async def dying():
        raise RuntimeError("simulated bug in the serving loop")

    async def serving(service: str) -> int:
        return (
            await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        ).status

    app.core.engine.step = dying
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(0), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated bug" in e.value.details()
    app.core.engine.step = real_step  # the loop was restarted: requests are served again
    assert await generate(stub, request(1), timeout=10) == (expected[1], LENGTH)
    assert await serving("") == health_pb2.HealthCheckResponse.SERVING

    app.core.engine.step = dying  # deaths 2 and 3 within the window: the router gives up
    for i in (2, 3):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, request(i), timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL
    for service in ("", SERVICE_NAME):
        assert await serving(service) == health_pb2.HealthCheckResponse.NOT_SERVING
    app.core.engine.step = real_step
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(0), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stopped serving" in e.value.details()
