"""expert_service/servicer.py over a real gRPC server on loopback, in front of a scripted host: a
Forward's fields and tensor reach the host as sent, its output and the service's own time come
back, a host error is the matching status code, a bad tensor is INVALID_ARGUMENT naming the field,
and Describe carries the host's description, its fast paths and its message limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import count
from types import SimpleNamespace

import grpc
import pytest
import torch

from common import wire
from common.errors import PreconditionError
from common.server import GrpcServer, Service
from expert_service import servicer as servicer_module
from expert_service.servicer import ExpertServicer
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2


class ScriptedHost:
    """Answers forward with its input times 2 (or raises `error`); records each call."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []

    async def forward(self, model_id, checksum, layer, expert_ids, token_counts, hidden):
        self.calls.append((model_id, checksum, layer, expert_ids, token_counts, hidden))
        if self.error is not None:
            raise self.error
        return hidden * 2

    def check_serving(self) -> None:
        pass

    def describe(self):
        stats = SimpleNamespace(forward_calls=5, groups=9, batches=4, tokens=40)
        return SimpleNamespace(
            model_id="m",
            weights_checksum="sha256:abc",
            experts=[(0, 1), (1, 3)],
            dtype=torch.bfloat16,
            hidden_size=64,
            region="eu",
            stats=stats,
            precision="int4-g64",
            device="cuda:1",
        )


@asynccontextmanager
async def serving(host, monkeypatch, **kwargs) -> AsyncIterator[expert_pb2_grpc.ExpertServiceStub]:
    ticks = count()  # the servicer's clock, fake: each reading a quarter second after the last
    monkeypatch.setattr(
        servicer_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) / 4)
    )
    service = Service(
        "moe_mesh.v1.ExpertService",
        expert_pb2_grpc.add_ExpertServiceServicer_to_server,
        ExpertServicer(host, **kwargs),
    )
    server = GrpcServer([service], grace_s=0.1)
    address = await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield expert_pb2_grpc.ExpertServiceStub(channel)
    finally:
        await server.stop()


def forward(hidden: tensor_pb2.Tensor) -> expert_pb2.ExpertForwardRequest:
    return expert_pb2.ExpertForwardRequest(
        model_id="m",
        weights_checksum="sha256:abc",
        layer=1,
        expert_ids=[3, 0],
        token_counts=[2, 1],
        hidden=hidden,
    )


async def test_forward_gives_the_host_what_was_sent_and_returns_its_output(monkeypatch) -> None:
    host = ScriptedHost()
    x = torch.randn(3, 8).to(torch.bfloat16)
    async with serving(host, monkeypatch) as stub:
        reply = await stub.Forward(forward(wire.encode(x)))
    [(model_id, checksum, layer, experts, counts, hidden)] = host.calls
    assert (model_id, checksum, layer, experts, counts) == ("m", "sha256:abc", 1, [3, 0], [2, 1])
    assert hidden.dtype == torch.bfloat16 and torch.equal(hidden, x)
    assert torch.equal(wire.decode(reply.output), x * 2)
    assert reply.service_seconds == 0.25  # one tick of the fake clock


async def test_host_errors_and_bad_tensors_are_their_status_codes(monkeypatch) -> None:
    host = ScriptedHost(PreconditionError("weights_checksum: sha256:abc is not this service's"))
    async with serving(host, monkeypatch) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Forward(forward(wire.encode(torch.zeros(3, 8))))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == str(host.error)
        short = tensor_pb2.Tensor(dtype=wire.TO_WIRE[torch.float32], shape=[3, 8], data=b"\0" * 5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Forward(forward(short))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("hidden")
    assert len(host.calls) == 1  # the bad tensor never reached the host


async def test_describe_carries_the_hosts_description_and_the_apps_fast_paths(
    monkeypatch,
) -> None:
    paths = ["ucx-worker://a"]
    async with serving(
        ScriptedHost(), monkeypatch, fast_paths=lambda: paths, max_message_bytes=1 << 20
    ) as stub:
        d = await stub.Describe(expert_pb2.DescribeRequest())
        paths.append("ucx-worker://b")  # read at each call: known once the app has started it
        later = await stub.Describe(expert_pb2.DescribeRequest())
    assert (d.model_id, d.weights_checksum, d.hidden_size, d.region, d.precision) == (
        "m",
        "sha256:abc",
        64,
        "eu",
        "int4-g64",
    )
    assert [(k.layer, k.expert) for k in d.experts] == [(0, 1), (1, 3)]
    assert d.device == "cuda:1"
    assert d.dtype == wire.TO_WIRE[torch.bfloat16] and d.max_message_bytes == 1 << 20
    s = d.stats
    assert (s.forward_calls, s.groups, s.batches, s.tokens) == (5, 9, 4, 40)
    assert list(d.fast_paths) == ["ucx-worker://a"]
    assert list(later.fast_paths) == ["ucx-worker://a", "ucx-worker://b"]
