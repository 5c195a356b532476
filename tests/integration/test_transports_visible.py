"""Which transport carried each expert call is visible: `moe.transport` on every `moe.expert_call`
span, dispatch-duration histograms and fast-path fallbacks by cause on the router's /metrics, and
each replica's transport and fast-path record in RouterStatus and `moe-mesh status`.

One router in this process reaches one expert service over UCX, another over gRPC (its fast path
off), and computes the remaining experts itself, so one request shows all three transports. A peer
speaking an old frame version is a clean gRPC fallback, counted under its cause."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.fastpath.server import FrameServer
from common.fastpath.ucx import load_ucxx
from common.telemetry import Telemetry
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from moe_mesh.ops.client import pipeline_line, replica_line, router_status
from protos.moe_mesh.v1 import router_pb2_grpc
from router_service.app import RouterApp
from router_service.build import fast_path_config
from router_service.experts.remote import Identity, RemoteExperts
from router_service.settings import RouterSettings
from tests.support.fastpath import speak_previous_frame_version
from tests.support.metrics import scrape, total
from tests.support.routers import generate, request

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None,
    reason="ucxx cannot be imported (the fastpath extra: pip install 'moe-mesh[fastpath]')",
)
DISPATCHES = "moe_router_dispatch_duration_seconds_count"
FALLBACKS = "moe_router_fast_path_fallbacks_total"


@dataclass
class Mesh:
    ucx: ExpertApp  # experts 0-3, fast path on
    grpc: ExpertApp  # experts 4-5, fast path off
    router: RouterApp  # experts 6-7 colocated
    exporter: InMemorySpanExporter
    telemetry: Telemetry

    async def generate(self, i: int = 1) -> tuple[int, ...]:
        async with grpc.aio.insecure_channel(self.router.server.address) as channel:
            tokens, _ = await generate(router_pb2_grpc.RouterServiceStub(channel), request(i, 8))
        return tokens

    def calls(self) -> list:
        return [s for s in self.exporter.get_finished_spans() if s.name == "moe.expert_call"]


@asynccontextmanager
async def mesh(checkpoint) -> AsyncIterator[Mesh]:
    path = checkpoint("mixtral")
    experts = []
    try:
        for spec, fast_path in (("*:0-3", "auto"), ("*:4-5", "off")):
            app = await ExpertApp.create(
                ExpertSettings(checkpoint=path, experts=spec, fast_path=fast_path, grace_s=1.0)
            )
            experts.append(app)
            await app.start()
        exporter = InMemorySpanExporter()
        telemetry = Telemetry.create("router", sample=1.0, exporters=[exporter], metrics_port=0)
        router = await RouterApp.create(
            RouterSettings(
                checkpoint=path,
                expert_endpoints=[e.address for e in experts],
                colocate="*:6-7",
                fast_path="auto",
                fast_path_backoff_s=60.0,  # a replica that fell back stays on gRPC for the test
                # The 0.5 s default fell back once on a fresh clone's loaded 2 cores; a lost fast
                # path has tests of its own (the next one).
                fast_path_timeout_s=10.0,
                grace_s=1.0,
            ),
            telemetry,
        )
        await router.start()
        try:
            yield Mesh(experts[0], experts[1], router, exporter, telemetry)
        finally:
            await router.stop()
    finally:
        for app in experts:
            await app.stop()


async def test_spans_histograms_and_status_name_the_transport_of_every_call(checkpoint) -> None:
    async with mesh(checkpoint) as m:
        assert m.ucx.fast_paths and not m.grpc.fast_paths
        await m.generate()
        spans = m.calls()
        by_replica = {(s.attributes["moe.replica"], s.attributes["moe.transport"]) for s in spans}
        assert by_replica == {
            (m.ucx.address, "ucx"),
            (m.grpc.address, "grpc"),
            ("colocated", "colocated"),
        }
        per_transport = Counter(s.attributes["moe.transport"] for s in spans)
        samples = scrape(m.telemetry)
        # Every call is timed under its transport, traced or not: the histogram counts the spans.
        for transport in ("ucx", "grpc", "colocated"):
            assert total(samples, DISPATCHES, moe_transport=transport) == per_transport[transport]
        assert total(samples, FALLBACKS) == 0

        row = await router_status(m.router.server.address)
        replicas = {r["backend"]: r for r in row["replicas"]}
        assert set(replicas) == {m.ucx.address, m.grpc.address, "colocated"}
        assert replicas[m.ucx.address] == {
            "backend": m.ucx.address,
            "transport": "ucx",
            "fast_path": m.ucx.fast_paths[0],
            "fast_path_calls": per_transport["ucx"],
            "fast_path_fallbacks": 0,
            "fallback_causes": {},
        }
        assert replicas[m.grpc.address]["transport"] == "grpc"
        assert replicas[m.grpc.address]["fast_path"] == ""
        assert replicas["colocated"]["transport"] == "colocated"
        assert "ucx" in replica_line(replicas[m.ucx.address])
        assert "no fast path" in replica_line(replicas[m.grpc.address])
        # Decode passes that called experts taught `auto` what a layer costs on each side.
        pipeline = row["micro_batches"]
        assert pipeline["setting"] == "auto" and pipeline["last"] >= 1
        assert pipeline["ta_ms"] > 0 and pipeline["te_ms"] > 0
        assert "micro-batches" in pipeline_line(pipeline)


async def test_a_lost_fast_path_is_counted_by_cause_and_shown_per_replica(checkpoint) -> None:
    async with mesh(checkpoint) as m:
        want = await m.generate()
        await m.ucx.fast_path.server.stop()  # the listener goes; the service's gRPC stays up
        m.exporter.clear()
        assert await m.generate() == want  # re-sent over gRPC: no request fails, same tokens

        samples = scrape(m.telemetry)
        counted = {
            k: v for k, v in samples.items() if k.startswith(FALLBACKS + "{") and "moe_cause=" in k
        }
        assert sum(counted.values()) >= 1
        row = await router_status(m.router.server.address)
        replica = next(r for r in row["replicas"] if r["backend"] == m.ucx.address)
        assert replica["transport"] == "grpc"  # backing off: the next call goes over gRPC
        assert replica["fast_path_fallbacks"] == sum(counted.values())
        assert sum(replica["fallback_causes"].values()) == replica["fast_path_fallbacks"]
        for cause, n in replica["fallback_causes"].items():
            assert total(samples, FALLBACKS, moe_cause=cause) == n
        assert "fallbacks" in replica_line(replica) and "(" in replica_line(replica)
        # The replica's calls now travel over gRPC, and their spans say so.
        transports = {
            s.attributes["moe.transport"]
            for s in m.calls()
            if s.attributes["moe.replica"] == m.ucx.address
        }
        assert transports == {"grpc"}


async def test_an_old_frame_version_peer_is_a_clean_grpc_fallback_counted_as_version(
    checkpoint, monkeypatch
) -> None:
    """The replica advertises a fast path that speaks the previous frame version: the call is
    answered over gRPC with the same outputs, and the router's counter names the cause."""

    speak_previous_frame_version(monkeypatch)
    old = FrameServer(lambda header, payload: None, 2**24)
    advertised = await old.start()
    app = await ExpertApp.create(
        ExpertSettings(
            checkpoint=checkpoint("mixtral"), experts="*:0-3", fast_path="off", grace_s=1.0
        )
    )
    await app.start()
    telemetry = Telemetry.create("router", metrics_port=0)
    identity = Identity(app.host.model_id, app.host.weights_checksum)
    config = fast_path_config(RouterSettings(fast_path="ucx"), telemetry)
    backend = RemoteExperts(app.address, identity, 2**24, fast_path=config, fast_paths=[advertised])
    plain = RemoteExperts(app.address, identity, 2**24)
    try:
        torch.manual_seed(0)
        groups = [(3, torch.randn(5, 64)), (0, torch.randn(2, 64))]
        got = await backend.forward(1, groups, 5.0)
        want = await plain.forward(1, groups, 5.0)
        assert got.transport == "grpc" and all(torch.equal(g, w) for g, w in zip(got, want))
        assert dict(backend.fast_path.fallbacks) == {"version": 1}
        samples = scrape(telemetry)
        assert total(samples, FALLBACKS, moe_cause="version") == total(samples, FALLBACKS) == 1
    finally:
        await backend.close()
        await plain.close()
        await app.stop()
        telemetry.shutdown()
        await old.stop()
