"""Property-based fuzzing of the gRPC APIs (hypothesis): the public Inference API, the router's
RouterService and the expert service's Forward get generated messages with bad and extreme values.
Every answer is OK or a documented, non-retryable status (never UNKNOWN, INTERNAL or UNAVAILABLE),
the servers keep serving, and a correct request afterwards gets the right answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.wire import encode
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from protos.moe_mesh.v1 import (
    expert_pb2,
    expert_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tensor_pb2,
)
from tests.support.meshes import local_mesh
from tests.support.reference import PROMPTS, monolithic

EXAMPLES = 60
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

u32 = st.one_of(st.integers(0, 600), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
i32 = st.one_of(st.integers(-5, 5), st.sampled_from([-(2**31), 2**31 - 1]))
u64 = st.one_of(st.integers(0, 10), st.sampled_from([2**63, 2**64 - 1]))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1e-45, -0.0])
)
small = st.integers(0, 4)  # max_tokens that keep valid requests short
text = st.text(max_size=12)
ids = st.lists(u32, max_size=6)


def sampling(count: st.SearchStrategy, **extra) -> st.SearchStrategy:
    """Sampling fields; `count` draws max_tokens and top_k (int32 in the public API, uint32 in the router's)."""
    return st.fixed_dictionaries(
        {
            "max_tokens": st.one_of(small, count),
            "temperature": floats,
            "top_p": floats,
            "top_k": count,
            "min_p": floats,
            "stop_token_ids": ids,
        },
        optional={"seed": u64, **extra},
    )


inference_requests = st.builds(
    lambda p, fields, prompt_ids, stop, rid, model, prio: inference_pb2.GenerateRequest(
        **fields,
        **({"prompt_token_ids": prompt_ids} if prompt_ids is not None else {"prompt": p}),
        stop=stop,
        request_id=rid,
        model=model,
        priority=prio,
    ),
    text,
    sampling(i32),
    st.none() | ids,
    st.lists(text, max_size=3),
    text,
    st.sampled_from(["", "x" * 300]),
    i32,
)

router_requests = st.builds(
    lambda rid, prompt, params, prio: router_pb2.RouterGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=router_pb2.SamplingParams(**params),
        priority=prio,
    ),
    text,
    ids,
    sampling(u32, ignore_eos=st.booleans()),
    i32,
)


def forward_requests(model_id: str, checksum: str, hidden: int) -> st.SearchStrategy:
    def make(
        real_ids, layer, experts, counts, dtype, shape, data, nan
    ) -> expert_pb2.ExpertForwardRequest:
        if data is None:  # well-formed bytes for the shape, sometimes poisoned
            rows = torch.randn(shape[0] if shape else 0, hidden)
            if nan and rows.numel():
                rows[0, 0] = float("nan")
            tensor = encode(rows)
        else:
            tensor = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)
        return expert_pb2.ExpertForwardRequest(
            model_id=model_id if real_ids else "other",
            weights_checksum=checksum if real_ids else "x",
            layer=layer,
            expert_ids=experts,
            token_counts=counts,
            hidden=tensor,
        )

    return st.builds(
        make,
        st.booleans(),
        u32,
        st.lists(st.integers(0, 9), max_size=4),
        st.lists(small, max_size=4),
        st.integers(0, 5),
        st.lists(st.integers(0, 70), max_size=3),
        st.none() | st.binary(max_size=64),
        st.booleans(),
    )


def fuzz(call: Callable, strategy: st.SearchStrategy, examples: int) -> list[str]:
    """Send every generated message (sync client, on a worker thread); the answers outside ALLOWED."""
    bad: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(message=strategy)
    def check(message) -> None:
        try:
            call(message)
        except grpc.RpcError as e:
            if e.code() not in ALLOWED:
                bad.append(f"{e.code().name}: {e.details()} for {str(message)[:300]!r}")

    check()
    return bad


def stream_all(stub_call, request) -> None:
    for _ in stub_call(request, timeout=30):
        pass


@pytest.mark.timeout(240)
async def test_generated_messages_get_documented_statuses_and_the_services_stay_correct(
    checkpoint,
) -> None:
    path = checkpoint("mixtral")
    expert_app = await ExpertApp.create(ExpertSettings(checkpoint=path, experts="*:*", grace_s=1.0))
    host = expert_app.host
    expert = await expert_app.start()
    try:
        async with local_mesh(path) as mesh:
            targets = {
                "gateway": mesh.grpc_address,
                "router": mesh.router.server.address,
                "expert": expert,
            }
            channels = {name: grpc.insecure_channel(address) for name, address in targets.items()}
            try:
                inference = inference_pb2_grpc.InferenceStub(channels["gateway"])
                router = router_pb2_grpc.RouterServiceStub(channels["router"])
                experts = expert_pb2_grpc.ExpertServiceStub(channels["expert"])
                bad = await asyncio.to_thread(
                    fuzz, lambda m: inference.Generate(m, timeout=30), inference_requests, EXAMPLES
                )
                bad += await asyncio.to_thread(
                    fuzz, lambda m: stream_all(router.Generate, m), router_requests, EXAMPLES
                )
                bad += await asyncio.to_thread(
                    fuzz,
                    lambda m: experts.Forward(m, timeout=30),
                    forward_requests(host.model_id, host.weights_checksum, host.spec.hidden_size),
                    EXAMPLES,
                )
            finally:
                for channel in channels.values():
                    channel.close()
            assert bad == [], "\n".join(bad[:10])
            async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
                reply = await inference_pb2_grpc.InferenceStub(channel).Generate(
                    inference_pb2.GenerateRequest(
                        prompt_token_ids=PROMPTS[2], max_tokens=32, temperature=0.0
                    ),
                    timeout=30,
                )
            want = monolithic(path)[2]
            assert tuple(reply.token_ids) == want[: len(reply.token_ids)] and reply.token_ids
            assert (
                len(reply.token_ids) == len(want) or reply.finish_reason == 1
            )  # whole, or cut by EOS ("stop")
    finally:
        await expert_app.stop()
