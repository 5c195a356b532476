"""Traces and metrics of a live mesh: one request is one trace across gateway, router and expert
service, its spans count every routed token, and each service's Prometheus endpoint counts the work."""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.checkpoint import Checkpoint
from common.telemetry import Telemetry
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc
from router_service.app import RouterApp
from router_service.settings import RouterSettings
from tests.support.metrics import scrape, total

PROMPT = [11, 3, 250, 9, 31]
MAX_TOKENS = 6


@asynccontextmanager
async def mesh(path, telemetry: dict[str, Telemetry]):
    """Expert service, router and gateway on loopback in this process, each with its own telemetry."""
    expert = await ExpertApp.create(
        ExpertSettings(checkpoint=path, experts="*:0-3", fast_path="off"), telemetry["expert"]
    )
    local_half = "*:4-7"  # the router computes these itself: spans of both transports
    address = await expert.start()
    router = await RouterApp.create(
        RouterSettings(
            checkpoint=path, expert_endpoints=[address], colocate=local_half, fast_path="off"
        ),
        telemetry["router"],
    )
    await router.start()
    gateway = await GatewayApp.create(
        GatewaySettings(checkpoint=path, routers=[router.server.address]), telemetry["gateway"]
    )
    await gateway.start()
    try:
        yield gateway.grpc.address
    finally:
        await gateway.stop()
        await router.stop()
        await expert.stop()


async def generate(address: str, **fields) -> inference_pb2.GenerateResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(**fields)
        )


async def test_one_request_is_one_trace_across_three_services_counting_every_routed_token(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    spec = Checkpoint(path).spec
    exporter = InMemorySpanExporter()
    telemetry = {
        name: Telemetry.create(name, sample=1.0, exporters=[exporter])
        for name in ("expert", "router", "gateway")
    }
    async with mesh(path, telemetry) as address:
        exporter.clear()  # start-up calls (the router's Describe) are traces of their own
        reply = await generate(
            address, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert len(reply.token_ids) == MAX_TOKENS
    spans = exporter.get_finished_spans()

    assert len({s.context.trace_id for s in spans}) == 1
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["/moe_mesh.v1.Inference/Generate"]
    assert all(
        s.parent.span_id in by_id for s in spans if s.parent is not None
    )  # every parent is in the trace
    assert {s.resource.attributes["service.name"] for s in spans} == {"gateway", "router", "expert"}

    def chain(span) -> list[str]:
        names = []
        while span.parent is not None:
            span = by_id[span.parent.span_id]
            names.append(f"{span.resource.attributes['service.name']}:{span.name}")
        return names

    expert_rpc = next(s for s in spans if s.resource.attributes["service.name"] == "expert")
    assert chain(expert_rpc) == [
        "router:/moe_mesh.v1.ExpertService/Forward",
        "router:moe.expert_call",
        "router:moe.dispatch",
        "router:moe.router.step",
        "router:moe.router.request",
        "router:/moe_mesh.v1.RouterService/Generate",
        "gateway:/moe_mesh.v1.RouterService/Generate",
        "gateway:moe.gateway.request",
        "gateway:/moe_mesh.v1.Inference/Generate",
    ]

    # Every forward pass routes each of its tokens to top-k experts in every MoE layer.
    forwarded = len(PROMPT) + MAX_TOKENS - 1  # the last token is sampled, never forwarded
    expected = forwarded * len(spec.moe_layer_ids) * spec.top_k
    dispatch = [s for s in spans if s.name == "moe.dispatch"]
    assert sum(sum(s.attributes["moe.expert_tokens"]) for s in dispatch) == expected
    calls = [s for s in spans if s.name == "moe.expert_call"]
    assert sum(sum(s.attributes["moe.expert_tokens"]) for s in calls) == expected
    assert {s.attributes["moe.transport"] for s in calls} == {"grpc", "colocated"}
    remote = sum(
        sum(s.attributes["moe.expert_tokens"])
        for s in calls
        if s.attributes["moe.transport"] == "grpc"
    )
    served = [s for s in spans if s.resource.attributes["service.name"] == "expert"]
    assert sum(sum(s.attributes["moe.expert_tokens"]) for s in served) == remote > 0
    request = next(s for s in spans if s.name == "moe.gateway.request")
    assert request.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert request.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS


async def test_unsampled_requests_leave_no_spans(checkpoint) -> None:
    exporter = InMemorySpanExporter()
    telemetry = {
        name: Telemetry.create(name, sample=0.0, exporters=[exporter])
        for name in ("expert", "router", "gateway")
    }
    assert all(t.tracer is None for t in telemetry.values())  # sampling 0: no provider at all
    async with mesh(checkpoint("mixtral"), telemetry) as address:
        await generate(address, prompt_token_ids=PROMPT, max_tokens=3)
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize("requests", [3])
async def test_prometheus_endpoints_count_a_known_workload(checkpoint, requests) -> None:
    path = checkpoint("mixtral")
    spec = Checkpoint(path).spec
    telemetry = {
        name: Telemetry.create(name, metrics_port=0) for name in ("expert", "router", "gateway")
    }
    async with mesh(path, telemetry) as address:
        for _ in range(requests):
            await generate(address, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await generate(address, prompt_token_ids=PROMPT, max_tokens=0)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        gateway, router, expert = (scrape(telemetry[n]) for n in ("gateway", "router", "expert"))

    routed = requests * (len(PROMPT) + MAX_TOKENS - 1) * len(spec.moe_layer_ids) * spec.top_k
    assert total(router, "moe_router_tokens_routed_total") == routed
    assert total(router, "moe_router_tokens_routed_total", moe_layer="0") == routed / len(
        spec.moe_layer_ids
    )
    steps = total(router, "moe_router_batch_size_count")
    assert (
        total(router, "moe_router_batch_size_sum") == requests * MAX_TOKENS and steps >= MAX_TOKENS
    )
    calls = total(router, "moe_router_dispatch_duration_seconds_count", moe_transport="grpc")
    assert (
        calls > 0
        and total(router, "moe_router_dispatch_duration_seconds_count", moe_transport="colocated")
        > 0
    )

    # The expert service computed exactly the rows the router sent it (experts 0-3 of every layer).
    assert total(expert, "moe_expert_batch_tokens_sum") == total(
        router, "moe_router_tokens_routed_total", moe_expert="0"
    ) + sum(total(router, "moe_router_tokens_routed_total", moe_expert=str(e)) for e in (1, 2, 3))
    assert total(expert, "moe_expert_queue_duration_seconds_count") > 0
    assert total(expert, "moe_expert_compute_duration_seconds_count") == total(
        expert, "moe_expert_batch_tokens_count"
    )

    assert (
        total(gateway, "gen_ai_server_request_duration_seconds_count", rpc_grpc_status_code="OK")
        == requests
    )
    assert total(gateway, "gen_ai_server_time_to_first_token_seconds_count") == requests
    assert total(gateway, "gen_ai_server_time_per_output_token_seconds_count") == requests
    assert total(gateway, "moe_errors_total", rpc_grpc_status_code="INVALID_ARGUMENT") == 1
    assert total(gateway, "moe_gateway_queue_depth") == 0
    assert total(gateway, "moe_gateway_in_flight") == 0
    assert total(gateway, "moe_gateway_failovers_total") == 0
    assert total(gateway, "moe_gateway_router_ejections_total") == 0

    # Blocks by state add up to the pool; the same short prompt never fills a block to share.
    assert total(router, "moe_router_kv_blocks", moe_state="used") == 0
    assert total(router, "moe_router_kv_blocks", moe_state="free") > 0
    assert total(router, "moe_router_prefix_cache_query_tokens_total") == requests * len(PROMPT)
    assert total(router, "moe_router_prefix_cache_hit_tokens_total") == 0
    assert total(router, "moe_router_preemptions_total") == 0
