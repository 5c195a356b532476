"""The dispatcher's counters as Prometheus metrics, and each backend call's duration by transport."""

from __future__ import annotations

import torch

from common.checkpoint import Checkpoint
from common.telemetry import Telemetry
from router_service.experts.backends import ColocatedExperts
from router_service.experts.dispatch import ExpertDispatcher
from router_service.experts.replicas import DispatchPolicy
from tests.support.backends import Recording
from tests.support.metrics import scrape, total


async def test_a_failover_an_ejection_and_the_tokens_routed_are_exported(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("mixtral"))
    weights, layer = ckpt.load_experts(ckpt.all_expert_pairs()), ckpt.load_dense().layers[0]
    down, up, local = Recording(weights, fail=True), Recording(weights), ColocatedExperts(weights)
    telemetry = Telemetry.create("router", metrics_port=0)
    dispatcher = ExpertDispatcher(
        ckpt.spec,
        {pair: [down, up] for pair in weights},
        telemetry=telemetry,
        policy=DispatchPolicy(probe_interval_s=0),
    )
    try:
        x = torch.randn(8, ckpt.spec.hidden_size, generator=torch.Generator().manual_seed(0))
        await dispatcher.moe_layer(0, x, layer)
        dispatcher.set_placement({pair: [local] for pair in weights})
        await dispatcher.moe_layer(1, x, ckpt.load_dense().layers[1])
        samples = scrape(telemetry)
        assert total(samples, "moe_router_failovers_total") == 1
        assert total(samples, "moe_router_ejections_total") == 1
        assert total(samples, "moe_router_hedges_total") == 0
        routed = "moe_router_tokens_routed_total"
        assert total(samples, routed) == 2 * 8 * ckpt.spec.top_k
        assert total(samples, routed, moe_layer="1") == 8 * ckpt.spec.top_k
        calls = "moe_router_dispatch_duration_seconds_count"
        # Layer 0: the failed call and the one that failed over; layer 1: one computed here.
        assert total(samples, calls, moe_transport="grpc") == 2
        assert total(samples, calls, moe_transport="colocated") == 1
    finally:
        await dispatcher.close()
        telemetry.shutdown()
