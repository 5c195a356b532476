"""An in-process router service over real gRPC: sampling edge cases, duplicate ids, a dying engine loop,
the KV cache in its status, an expert service that never answers at start-up."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import UnavailableError
from moe_mesh.ops.client import kv_line, router_status
from protos.moe_mesh.v1 import router_pb2_grpc
from router_service.app import SERVICE_NAME, RouterApp
from router_service.settings import RouterSettings
from tests.support.reference import monolithic
from tests.support.routers import LENGTH, generate, request, wait_status


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


async def test_min_p_reaches_the_engine_and_out_of_range_is_invalid_argument(
    local_router, checkpoint
) -> None:
    _, stub, _ = local_router
    expected = monolithic(checkpoint("olmoe"))
    # min_p = 1 keeps only the most likely token (exact ties aside): greedy at any temperature.
    assert await generate(stub, request(3, temperature=1.5, min_p=1.0, seed=2), timeout=10) == (
        expected[3],
        LENGTH,
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(0, temperature=1.0, min_p=1.5), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "min_p: must be in [0, 1], got 1.5"


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


async def test_status_shows_the_kv_cache_and_prefix_cache_hits(local_router, checkpoint) -> None:
    app, stub, _ = local_router
    expected = monolithic(checkpoint("olmoe"))
    # The 29-token prompt twice: the second time its first 28 tokens (1 block of 16) are cached.
    for _ in range(2):
        assert await generate(stub, request(3), timeout=10) == (expected[3], LENGTH)
    row = await router_status(app.server.address)
    kv = row["kv"]
    pool = app.core.engine.scheduler.pool
    assert kv == {
        "block_size": 16,
        "blocks_total": pool.num_blocks,
        "blocks_used": 0,
        "blocks_cached": 3,  # 29 + 32 tokens: three full blocks published, kept after the end
        "prefix_query_tokens": 58,
        "prefix_hit_tokens": 16,
        "preemptions": 0,
    }
    line = kv_line(kv)
    assert f"0/{pool.num_blocks} blocks used" in line and "3 cached" in line
    assert "prefix cache hits 27.6% of 58 tokens" in line


async def test_an_expert_service_that_never_answers_fails_start_up_naming_the_flag(
    checkpoint, closed_port
) -> None:
    settings = RouterSettings(
        checkpoint=checkpoint("olmoe"),
        expert_endpoints=[f"127.0.0.1:{closed_port}"],
        connect_timeout_s=0.5,
    )
    with pytest.raises(UnavailableError, match=r"within 0.5s \(--connect-timeout-s\): 127.0.0.1:"):
        await RouterApp.create(settings)
