"""Expert service over real gRPC: Forward/Describe values, a status per bad input, dynamic batching across
callers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.checkpoint import Checkpoint
from common.errors import PreconditionError, UnavailableError
from common.fastpath.ucx import load_ucxx
from common.placement import parse_experts
from common.server import LIVENESS
from common.wire import encode
from expert_service import batcher as batcher_module
from expert_service.app import SERVICE_NAME, ExpertApp
from expert_service.core import ExpertHost
from expert_service.settings import ExpertSettings
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.remote import Identity, RemoteExperts
from router_service.experts.remote import connect as connect_experts
from tests.support.experts import (
    ARCH,
    HIDDEN,
    SPEC,
    Groups,
    assert_close,
    connect,
    decode_output,
    expert_settings,
    forward_request,
    reference,
)
from tests.support.polling import eventually


@asynccontextmanager
async def serving(settings: ExpertSettings) -> AsyncIterator[tuple[str, ExpertHost]]:
    """A real server on a free loopback port, stopped (and its batcher closed) afterwards."""
    app = await ExpertApp.create(settings)
    address = await app.start()
    try:
        yield address, app.host
    finally:
        await app.stop()


@pytest.fixture
def settings(checkpoint) -> Callable[..., ExpertSettings]:
    return partial(expert_settings, checkpoint)


# -- values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "kwargs", "dtype"),
    [
        ("mixtral", {}, "float32"),
        ("qwen3_moe", {"expert_layout": "fused"}, "float32"),
        ("olmoe", {}, "bfloat16"),
        ("deepseek_v3", {"expert_layout": "fused"}, "bfloat16"),
        ("dbrx", {}, "bfloat16"),
        ("gpt_oss", {"quantize": "mxfp4"}, "bfloat16"),  # biases; MXFP4 computed from its codes
    ],
)
async def test_forward_matches_expert_ffn_and_describe_reports_what_is_served(
    checkpoint, arch, kwargs, dtype
) -> None:
    path = checkpoint(arch, **kwargs)
    torch_dtype = getattr(torch, dtype)
    groups = [(3, torch.randn(5, HIDDEN)), (0, torch.randn(1, HIDDEN)), (2, torch.randn(7, HIDDEN))]
    groups = [(e, rows.to(torch_dtype)) for e, rows in groups]
    async with serving(
        ExpertSettings(checkpoint=path, experts=SPEC, dtype=dtype, region="eu-west")
    ) as (address, host):
        async with connect(address) as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            response = await stub.Forward(forward_request(host, 1, groups))
            described = await stub.Describe(expert_pb2.DescribeRequest())
    assert response.output.dtype == encode(groups[0][1]).dtype
    assert_close(
        decode_output(response, [5, 1, 7]),
        reference(path, 1, groups, torch_dtype),
        atol=1e-6 if dtype == "float32" else 1e-2,
    )
    checkpoint_ = Checkpoint(path)
    assert described.model_id == path.name
    assert described.weights_checksum == checkpoint_.fingerprint()
    assert [(k.layer, k.expert) for k in described.experts] == parse_experts(SPEC, checkpoint_.spec)
    assert described.dtype == encode(torch.zeros(1, dtype=torch_dtype)).dtype
    assert described.hidden_size == HIDDEN and described.region == "eu-west"
    assert (described.stats.forward_calls, described.stats.groups, described.stats.tokens) == (
        1,
        3,
        13,
    )
    assert described.stats.batches == 3  # one caller: nothing to merge


async def test_model_id_setting_overrides_the_directory_name(settings) -> None:
    async with serving(settings(model_id="mixtral-test")) as (address, host):
        async with connect(address) as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            assert (await stub.Describe(expert_pb2.DescribeRequest())).model_id == "mixtral-test"
            assert (
                await stub.Forward(forward_request(host, 0, [(1, torch.randn(2, HIDDEN))]))
            ).output.shape == [2, 64]


async def test_a_routers_check_passes_for_its_model_and_weights_only(settings) -> None:
    """RemoteExperts.check, which re-admits an ejected replica: a service restarted on other
    weights at the same address stays out, and so does one that left the mesh."""
    async with serving(settings(fast_path="off")) as (address, host):
        backend = RemoteExperts(address, Identity(host.model_id, host.weights_checksum), 2**24)
        try:
            await backend.check(5.0)
            backend.identity = Identity(host.model_id, "sha256:other")
            with pytest.raises(PreconditionError, match=f"{address} serves weights_checksum"):
                await backend.check(5.0)
            backend.retire()
            with pytest.raises(UnavailableError, match="left the mesh"):
                await backend.check(5.0)
        finally:
            await backend.close()


@pytest.mark.parametrize("fast_path", ["off", "ucx"])
async def test_a_service_restarted_on_other_experts_fails_its_check_and_its_calls_fail_over(
    settings, fast_path
) -> None:
    """Placed for experts it no longer serves (restarted at the same address on others), a replica
    fails its check and its calls fail as a replica's do (UNAVAILABLE: ejected, tried elsewhere),
    not with the NOT_FOUND that ended the request."""
    if fast_path == "ucx" and load_ucxx() is None:
        pytest.skip("ucxx cannot be imported here")
    async with serving(settings(fast_path=fast_path)) as (address, host):
        backend = RemoteExperts(
            address,
            Identity(host.model_id, host.weights_checksum),
            2**24,
            fast_path=FastPathConfig(mode=fast_path),
        )
        backend.offer_fast_path(list((await backend.describe(5.0)).fast_paths))
        backend.placed = frozenset({(0, 1), (0, 5)})  # 5 is served elsewhere (SPEC)
        transport = fast_path.replace("off", "grpc")
        try:
            await eventually(lambda: backend.transport == transport, what="the fast path up")
            with pytest.raises(PreconditionError, match=f"{address} no longer serves 0:5"):
                await backend.check(5.0)
            with pytest.raises(UnavailableError, match=r"layer 0 expert\(s\) 5: not served here"):
                await backend.forward(0, [(5, torch.randn(2, HIDDEN))], 5.0)
            out = await backend.forward(0, [(1, torch.randn(2, HIDDEN))], 5.0)
            assert out.transport == transport and out[0].shape == (2, HIDDEN)
        finally:
            await backend.close()


@pytest.mark.parametrize("fast_path", ["off", "ucx"])
async def test_a_call_larger_than_a_message_goes_in_pieces_under_the_limit(
    settings, checkpoint, fast_path
) -> None:
    """A long prompt's prefill may carry more rows than one message may hold (--max-message-bytes):
    it goes as several calls, not as one the transport refuses (a replica failure, ejected)."""
    if fast_path == "ucx" and load_ucxx() is None:
        pytest.skip("ucxx cannot be imported here")
    limit = 256 * 1024  # (limit - MESSAGE_SLACK) / (HIDDEN * 4 bytes) = 768 rows a message
    async with serving(settings(fast_path=fast_path)) as (address, host):
        backend = RemoteExperts(
            address,
            Identity(host.model_id, host.weights_checksum),
            limit,
            fast_path=FastPathConfig(mode=fast_path),
        )
        backend.offer_fast_path(list((await backend.describe(5.0)).fast_paths))
        transport = fast_path.replace("off", "grpc")
        torch.manual_seed(0)
        groups = [
            (3, torch.randn(500, HIDDEN)),
            (0, torch.randn(1200, HIDDEN)),
            (2, torch.randn(9, HIDDEN)),
        ]
        try:
            await eventually(lambda: backend.transport == transport, what="the fast path up")
            out = await backend.forward(1, groups, 10.0)
            assert out.transport == transport and [o.shape[0] for o in out] == [500, 1200, 9]
            assert_close(
                list(out), reference(checkpoint(ARCH), 1, groups, torch.float32), atol=1e-5
            )
            assert host.forward_calls == 3  # 1709 rows in 768-row pieces
        finally:
            await backend.close()


async def test_calls_stay_under_the_message_limit_the_service_describes(
    settings, checkpoint
) -> None:
    """A service taking smaller messages than the router sends: the router learns its limit."""
    async with serving(settings(fast_path="off", max_message_bytes=4 * 2**20)) as (address, host):
        identity = Identity(host.model_id, host.weights_checksum)
        placement = await connect_experts([address], identity, 64 * 2**20, 5.0)
        backend = next(iter(placement.values()))[0]
        rows = torch.randn(20000, HIDDEN)  # 5.1 MB
        try:
            assert backend.call_bytes == 4 * 2**20
            [out] = await backend.forward(1, [(0, rows)], 10.0)
            assert out.shape == rows.shape and host.forward_calls == 2
        finally:
            await backend.close()


# -- bad inputs: one status each, then the service still serves ---------------------------------------


def edit(
    hidden: torch.Tensor | None = None, **fields
) -> Callable[[expert_pb2.ExpertForwardRequest], None]:
    """A mutation of a request: scalar fields set, repeated fields replaced, `hidden` re-encoded."""

    def apply(r: expert_pb2.ExpertForwardRequest) -> None:
        for name, value in fields.items():
            if isinstance(value, list):
                r.ClearField(name)
                getattr(r, name).extend(value)
            else:
                setattr(r, name, value)
        if hidden is not None:
            r.hidden.CopyFrom(encode(hidden))

    return apply


def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


# Mutations of a good request (layer 0, experts [1, 3] with [2, 3] rows) -> status and what the details say.
# The server runs with max_request_tokens=8.
BAD_INPUTS = {
    "model_id": (
        edit(model_id="other"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "model_id: expected '{model_id}', got 'other'",
    ),
    "checksum": (
        edit(weights_checksum="deadbeef"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "weights_checksum: expected '{checksum}', got 'deadbeef'",
    ),
    "layer_not_served": (
        edit(layer=2),
        grpc.StatusCode.NOT_FOUND,
        "layer 2: not served here; this service serves '0-1:0-3'",
    ),
    "layer_out_of_range": (
        edit(layer=99),
        grpc.StatusCode.NOT_FOUND,
        "layer 99: not served here; this service serves '0-1:0-3'",
    ),
    "expert_not_served": (
        edit(expert_ids=[1, 5]),
        grpc.StatusCode.NOT_FOUND,
        "layer 0 expert(s) 5: not served here; this service serves '0-1:0-3'",
    ),
    "no_expert_ids": (
        edit(expert_ids=[], token_counts=[], hidden=zeros(0, HIDDEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "expert_ids: empty payload",
    ),
    "zero_tokens": (
        edit(token_counts=[0, 0], hidden=zeros(0, HIDDEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden: empty payload",
    ),
    "count_length": (
        edit(token_counts=[5]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_counts: expected one count per expert id (2), got 1",
    ),
    "duplicate_expert": (
        edit(expert_ids=[1, 1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "expert_ids: expert 1 appears more than once",
    ),
    "zero_count": (
        edit(token_counts=[0, 5]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_counts[0]: expected >= 1 token for expert 1, got 0",
    ),
    "hidden_3d": (
        edit(hidden=zeros(5, 1, HIDDEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.shape: expected [sum(token_counts)=5, hidden_size=64], got [5, 1, 64]",
    ),
    "hidden_width": (
        edit(hidden=zeros(5, 32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.shape: expected [sum(token_counts)=5, hidden_size=64], got [5, 32]",
    ),
    "hidden_rows": (
        edit(hidden=zeros(4, HIDDEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.shape: expected [sum(token_counts)=5, hidden_size=64], got [4, 64]",
    ),
    "hidden_dtype": (
        edit(hidden=zeros(5, HIDDEN, dtype=torch.float16)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.dtype: expected DTYPE_FLOAT32, got DTYPE_FLOAT16",
    ),
    "too_many_tokens": (
        edit(token_counts=[4, 5], hidden=zeros(9, HIDDEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden: sum(token_counts)=9 exceeds max_request_tokens=8",
    ),
    "wire_dtype": (
        lambda r: setattr(r.hidden, "dtype", tensor_pb2.DTYPE_UNSPECIFIED),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.dtype: unsupported dtype DTYPE_UNSPECIFIED; expected one of DTYPE_FLOAT32",
    ),
    "data_length": (
        lambda r: setattr(r.hidden, "data", r.hidden.data[:-4]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden.data: has 1276 bytes; shape [5, 64] of DTYPE_FLOAT32 needs 1280",
    ),
    "hidden_nan": (
        edit(hidden=zeros(5, HIDDEN).index_fill_(1, torch.tensor([3]), float("nan"))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden: holds 5 non-finite value(s) (NaN or inf)",
    ),
    "hidden_inf": (
        edit(hidden=zeros(5, HIDDEN).index_fill_(0, torch.tensor([4]), float("-inf"))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden: holds 64 non-finite value(s) (NaN or inf)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
async def test_bad_input_gets_a_status_naming_the_field_and_the_service_keeps_serving(
    settings, case
) -> None:
    mutate, code, details = BAD_INPUTS[case]
    async with serving(settings(max_request_tokens=8)) as (address, host):
        good = [(1, torch.randn(2, HIDDEN)), (3, torch.randn(3, HIDDEN))]
        bad = forward_request(host, 0, good)
        mutate(bad)
        async with connect(address) as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Forward(bad)
            assert e.value.code() == code
            assert (
                details.format(model_id=host.model_id, checksum=host.weights_checksum)
                in e.value.details()
            )
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            response = await stub.Forward(forward_request(host, 0, good))
        assert_close(decode_output(response, [2, 3]), reference(settings().checkpoint, 0, good))


# -- dynamic batching ------------------------------------------------------------------------------------


async def _two_routers(
    address: str, host: ExpertHost, groups: list[Groups]
) -> tuple[list, expert_pb2.ExpertStats]:
    """Each caller on its own channel, as two routers would be; all calls in flight at once."""
    channels = [connect(address) for _ in groups]
    try:
        calls = [
            expert_pb2_grpc.ExpertServiceStub(ch).Forward(forward_request(host, 0, g))
            for ch, g in zip(channels, groups)
        ]
        responses = await asyncio.wait_for(asyncio.gather(*calls), 10)
        stats = (
            await expert_pb2_grpc.ExpertServiceStub(channels[0]).Describe(
                expert_pb2.DescribeRequest()
            )
        ).stats
    finally:
        for ch in channels:
            await ch.close()
    return responses, stats


async def test_concurrent_callers_of_one_expert_share_one_batch(settings) -> None:
    groups = [[(2, torch.randn(3, HIDDEN))], [(2, torch.randn(4, HIDDEN))]]
    # A queue delay far beyond the test, ended by the batch filling up: the batch closes when both
    # callers' 7 rows are queued, however long the second caller takes to arrive.
    delay = settings(max_queue_delay_us=60_000_000, max_batch_tokens=7)
    async with serving(delay) as (address, host):
        responses, stats = await _two_routers(address, host, groups)
    assert (stats.forward_calls, stats.groups, stats.batches, stats.tokens) == (2, 2, 1, 7)
    for response, g in zip(responses, groups):
        assert_close(
            decode_output(response, [len(g[0][1])]), reference(settings().checkpoint, 0, g)
        )


async def test_batches_are_capped_at_max_batch_tokens_and_results_stay_per_caller(
    settings, monkeypatch
) -> None:
    groups = [
        [(2, torch.randn(4, HIDDEN)), (0, torch.randn(1, HIDDEN))],
        [(2, torch.randn(5, HIDDEN))],
    ]
    release = threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # the first batch holds the compute thread until every group is queued
        release.wait(10)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    async with serving(settings(max_batch_tokens=3)) as (address, host):
        both = asyncio.ensure_future(_two_routers(address, host, groups))
        await eventually(lambda: host.batcher.stats.groups == 3, 10, "both callers' groups queued")
        release.set()
        responses, stats = await both
    # Expert 2's 9 rows fill exactly three batches of 3 (groups split across batches), whichever
    # caller came first; expert 0 takes one.
    assert (stats.groups, stats.batches, stats.tokens) == (3, 4, 10)
    for response, g in zip(responses, groups):
        assert_close(
            decode_output(response, [len(rows) for _, rows in g]),
            reference(settings().checkpoint, 0, g),
        )


async def test_a_device_error_ends_serving_and_liveness_while_a_plain_one_fails_its_call(
    settings, monkeypatch
) -> None:
    """A CUDA error outlives its call, so the service stops serving for good: liveness
    NOT_SERVING (an orchestrator restarts it) and later calls UNAVAILABLE (routers fail over)."""
    failure: list[Exception] = []
    compute = batcher_module._compute

    def failing(parts, w):
        if failure:
            raise failure[0]
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", failing)
    groups = [(1, torch.randn(2, HIDDEN))]
    async with serving(settings()) as (address, host), connect(address) as channel:
        stub, health = (
            expert_pb2_grpc.ExpertServiceStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )

        async def forward() -> expert_pb2.ExpertForwardResponse:
            return await stub.Forward(forward_request(host, 0, groups), timeout=10)

        async def live() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        failure.append(RuntimeError("a bug in one batch"))
        with pytest.raises(grpc.aio.AioRpcError, match="a bug in one batch"):
            await forward()
        failure.clear()
        assert_close(
            decode_output(await forward(), [2]), reference(settings().checkpoint, 0, groups)
        )
        assert await live()

        failure.append(torch.AcceleratorError("CUDA error: an illegal memory access"))
        with pytest.raises(grpc.aio.AioRpcError, match="illegal memory access"):
            await forward()

        async def dead() -> bool:
            return not await live()

        await eventually(dead, 5, "liveness NOT_SERVING")
        failure.clear()  # the device would still fail; the service no longer tries it
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await forward()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped serving" in e.value.details() and "device failed" in e.value.details()
        # Describe too: it is a router's health check of an ejected replica, which stays out
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Describe(expert_pb2.DescribeRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# -- command line -------------------------------------------------------------------------------------------
