"""router_service/servicer.py over a real gRPC server on loopback, in front of a scripted core: a
request's fields, sampling parameters and deadline reach the core as they were sent, its outputs
come back as the wire's messages, its errors as the matching status code, and Status flattens the
core's status into the proto's fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import grpc
import pytest

from common.errors import AlreadyExistsError, ResourceExhaustedError
from common.server import GrpcServer, Service
from common.status import RETRY_AFTER_KEY
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc, types_pb2
from router_service import servicer as servicer_module
from router_service.core import (
    KvStatus,
    PipelineStatus,
    ReplicaStatus,
    RouterStatus,
    TieringStatus,
)
from router_service.engine.engine import FinishReason, StepOutput
from router_service.engine.sampling import TokenLogprobs
from router_service.servicer import RouterServicer

NOW = 1000.0  # the servicer's clock, fake: a deadline is NOW + the call's time remaining


class ScriptedCore:
    """Answers Generate with `outputs`, then raises `error` if set; records each call."""

    def __init__(self, outputs=(), error=None, status=None) -> None:
        self.outputs, self.error, self._status = list(outputs), error, status
        self.calls: list[tuple] = []

    async def generate(self, request_id, prompt, params, priority=0, deadline=None):
        self.calls.append((request_id, prompt, params, priority, deadline))
        for out in self.outputs:
            yield out
        if self.error is not None:
            raise self.error

    def status(self) -> RouterStatus:
        return self._status


@asynccontextmanager
async def serving(core, monkeypatch) -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    monkeypatch.setattr(servicer_module, "time", SimpleNamespace(monotonic=lambda: NOW))
    service = Service(
        "moe_mesh.v1.RouterService",
        router_pb2_grpc.add_RouterServiceServicer_to_server,
        RouterServicer(core),
    )
    server = GrpcServer([service], grace_s=0.1)
    address = await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield router_pb2_grpc.RouterServiceStub(channel)
    finally:
        await server.stop()


def request(**params) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id="r1",
        prompt_token_ids=[7, 8, 9],
        params=router_pb2.SamplingParams(max_tokens=4, **params),
        priority=-3,
    )


async def test_a_request_reaches_the_core_as_sent_and_its_outputs_come_back(monkeypatch) -> None:
    core = ScriptedCore(
        [
            StepOutput("r1", [5, 6], None, 3, 2, logprobs=[TokenLogprobs(-0.5, ((5, -0.5),))] * 2),
            StepOutput("r1", [7], FinishReason.LENGTH, 3, 3, logprobs=[TokenLogprobs(-1.0, ())]),
        ]
    )
    async with serving(core, monkeypatch) as stub:
        sent = request(
            temperature=0.5, top_k=3, seed=7, stop_token_ids=[2], min_tokens=1, logprobs=1
        )
        replies = [r async for r in stub.Generate(sent, timeout=3600)]
    [(rid, prompt, params, priority, deadline)] = core.calls
    assert (rid, prompt, priority) == ("r1", [7, 8, 9], -3)
    # The call's own deadline, on the router's clock. grpc's time_remaining() reads the wall clock,
    # which a host may step by seconds mid-call (seen: 3610 s left of a 3600 s call), hence a minute.
    assert abs(deadline - (NOW + 3600)) < 60
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (4, 0.5, 3, 7)
    assert (params.stop_token_ids, params.min_tokens, params.logprobs) == ((2,), 1, 1)
    assert params.repetition_penalty == 1.0  # unset on the wire: off
    assert [list(r.token_ids) for r in replies] == [[5, 6], [7]]
    assert [r.finish_reason for r in replies] == [
        types_pb2.FINISH_REASON_UNSPECIFIED,
        types_pb2.FINISH_REASON_LENGTH,
    ]
    assert [(r.prompt_tokens, r.completion_tokens) for r in replies] == [(3, 2), (3, 3)]
    assert [lp.logprob for lp in replies[0].logprobs] == [-0.5, -0.5]
    assert [(t.token_id, t.logprob) for t in replies[0].logprobs[0].top] == [(5, -0.5)]


async def test_without_a_deadline_or_an_id_the_core_gets_none_and_a_fresh_id(monkeypatch) -> None:
    core = ScriptedCore([StepOutput("x", [1], FinishReason.STOP, 1, 1)])
    async with serving(core, monkeypatch) as stub:
        bare = router_pb2.RouterGenerateRequest(
            prompt_token_ids=[1], params=router_pb2.SamplingParams(max_tokens=1)
        )
        [reply] = [r async for r in stub.Generate(bare)]
        [r async for r in stub.Generate(bare)]
    (first, _, params, _, deadline), (second, *_) = core.calls
    assert deadline is None and len(first) == 32 and first != second
    assert params.seed is None and params.logprobs is None
    assert reply.finish_reason == types_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("error", "code", "trailer"),
    [
        (AlreadyExistsError("request_id", "'r1' is already in flight"), "ALREADY_EXISTS", None),
        (ResourceExhaustedError("KV cache full", 2.0), "RESOURCE_EXHAUSTED", "2"),
    ],
)
async def test_a_core_error_is_the_matching_status_after_the_outputs_sent(
    monkeypatch, error, code, trailer
) -> None:
    core = ScriptedCore([StepOutput("r1", [5], None, 3, 1)], error=error)
    async with serving(core, monkeypatch) as stub:
        call = stub.Generate(request())
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for r in call:
                got += r.token_ids
    assert got == [5] and e.value.code() == getattr(grpc.StatusCode, code)
    assert e.value.details() == str(error)
    assert dict(e.value.trailing_metadata() or ()).get(RETRY_AFTER_KEY) == trailer


def status() -> RouterStatus:
    return RouterStatus(
        model_id="m",
        architecture="mixtral",
        vocab_size=512,
        max_model_len=256,
        num_layers=2,
        num_experts=3,
        moe_layers=[0, 1],
        running=1,
        waiting=2,
        steps=9,
        tokens_routed=[[1, 2, 3], [4, 5, 6]],
        failovers=1,
        placement={"colocated": [(0, 0), (0, 1)], "10.0.0.1:5": [(1, 2)]},
        regions={"colocated": "eu", "10.0.0.1:5": "us"},
        precisions={"colocated": "bfloat16", "10.0.0.1:5": "int8"},
        registry_stale=True,
        utilization=[[0.5, 0, 0], [0, 0, 1.5]],
        window_s=30.0,
        region="eu",
        remote_calls=4,
        tokens_colocated=11,
        hedges=2,
        ejections=1,
        tiering=TieringStatus(100, 40, 60, 3, 1, [(0, 0)], [(1, 2)]),
        replicas=[
            ReplicaStatus("colocated", "colocated", "", 0, {}),
            ReplicaStatus("10.0.0.1:5", "ucx", "ucx://w", 7, {"timeout": 2, "closed": 1}),
        ],
        pipeline=PipelineStatus("auto", 2, 1.5, 2.5, 0.5),
        kv=KvStatus(16, 64, 10, 5, 100, 40, 3),
    )


async def test_status_flattens_the_cores_status_into_the_proto(monkeypatch) -> None:
    async with serving(ScriptedCore(status=status()), monkeypatch) as stub:
        st = await stub.Status(router_pb2.RouterStatusRequest())
    assert (st.model_id, st.architecture, st.vocab_size, st.max_model_len) == (
        "m",
        "mixtral",
        512,
        256,
    )
    assert (st.running, st.waiting, st.steps, st.num_layers, st.num_experts) == (1, 2, 9, 2, 3)
    assert list(st.tokens_routed) == [1, 2, 3, 4, 5, 6]  # [layers][experts], row by row
    assert list(st.utilization) == [0.5, 0, 0, 0, 0, 1.5] and st.utilization_window_s == 30
    assert [(p.backend, p.experts, p.region, p.precision) for p in st.placement] == [
        ("colocated", "0:0-1", "eu", "bfloat16"),
        ("10.0.0.1:5", "1:2", "us", "int8"),
    ]
    assert st.registry_stale and list(st.moe_layers) == [0, 1]
    assert (st.expert_bytes, st.colocated_bytes, st.colocate_budget_bytes) == (100, 40, 60)
    assert (st.promotions, st.demotions, st.pinned_hot, st.pinned_remote) == (3, 1, "0:0", "1:2")
    assert (st.remote_calls, st.tokens_colocated, st.hedges, st.ejections) == (4, 11, 2, 1)
    ucx = st.replicas[1]
    assert (ucx.backend, ucx.transport, ucx.fast_path, ucx.fast_path_calls) == (
        "10.0.0.1:5",
        "ucx",
        "ucx://w",
        7,
    )
    assert ucx.fast_path_fallbacks == 3 and dict(ucx.fallback_causes) == {"timeout": 2, "closed": 1}
    assert (st.micro_batches_setting, st.micro_batches, st.ta_ms, st.te_ms, st.tc_ms) == (
        "auto",
        2,
        1.5,
        2.5,
        0.5,
    )
    assert (st.kv_block_size, st.kv_blocks_total, st.kv_blocks_used, st.kv_blocks_cached) == (
        16,
        64,
        10,
        5,
    )
    assert (st.prefix_cache_query_tokens, st.prefix_cache_hit_tokens, st.preemptions) == (
        100,
        40,
        3,
    )
