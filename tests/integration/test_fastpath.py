"""The UCX fast path against a real expert service on loopback: the same outputs as gRPC, a matching
error for every kind of bad frame with the service staying healthy, and per-call fallback to gRPC
with back-off and re-probe when the listener goes away."""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch

from moe_mesh.common.errors import MoeMeshError, NotFoundError, PreconditionError, UnavailableError
from moe_mesh.common.fastpath import frame as f
from moe_mesh.common.fastpath import parse_ucx_url
from moe_mesh.common.fastpath.client import FastPathError, FrameClient
from moe_mesh.common.fastpath.server import FrameServer
from moe_mesh.common.fastpath.ucx import FrameReader, UcxRuntime, load_ucxx
from moe_mesh.expert_service.app import ExpertApp
from moe_mesh.expert_service.settings import ExpertSettings
from moe_mesh.router_service.experts.fastpath import FastPathConfig
from moe_mesh.router_service.experts.remote import Identity, RemoteExperts

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None, reason="ucxx cannot be imported (pip install ucxx-cu12)"
)
MESSAGE_BYTES = 16 * 1024 * 1024
HIDDEN = 64


@asynccontextmanager
async def expert(checkpoint, **overrides) -> AsyncIterator[ExpertApp]:
    settings = ExpertSettings(
        checkpoint=checkpoint("mixtral"), experts="0-1:0-3", grace_s=1.0, **overrides
    )
    app = await ExpertApp.create(settings)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


def remote(app: ExpertApp, **config) -> RemoteExperts:
    identity = Identity(app.host.model_id, app.host.weights_checksum)
    return RemoteExperts(
        app.address,
        identity,
        MESSAGE_BYTES,
        fast_path=FastPathConfig(**config),
        fast_paths=app.fast_paths,
    )


def groups() -> list[tuple[int, torch.Tensor]]:
    torch.manual_seed(0)
    return [(3, torch.randn(5, HIDDEN)), (0, torch.randn(1, HIDDEN)), (2, torch.randn(7, HIDDEN))]


async def test_the_service_answers_over_ucx_with_the_same_outputs_as_grpc(checkpoint) -> None:
    async with expert(checkpoint) as app:
        assert app.fast_paths and parse_ucx_url(app.fast_paths) is not None
        assert app._instance().meta["fast_path"] == app.fast_paths[0]
        fast, slow = remote(app), remote(app, mode="off")
        try:
            described = await fast.describe(5.0)
            assert list(described.fast_paths) == app.fast_paths
            got = await fast.forward(1, groups(), 5.0)
            want = await slow.forward(1, groups(), 5.0)
            assert got.transport == "ucx" and want.transport == "grpc"
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            # Concurrent calls over the endpoint pool and over gRPC merge in one batcher.
            outs = await asyncio.gather(
                *(r.forward(1, groups(), 5.0) for r in [fast] * 6 + [slow] * 2)
            )
            # Batched with other calls' rows, float sums may round differently.
            assert all(torch.allclose(o[0], want[0], atol=1e-5, rtol=0) for o in outs)
            assert fast.fast_path.calls == 7 and not fast.fast_path.fallbacks
        finally:
            await fast.close()
            await slow.close()


async def test_service_errors_over_ucx_are_the_grpc_classes_not_fallbacks(checkpoint) -> None:
    async with expert(checkpoint) as app:
        backend = remote(app)
        try:
            with pytest.raises(NotFoundError, match="layer 2"):
                await backend.forward(2, groups(), 5.0)
            backend.identity = Identity(app.host.model_id, "sha256:other")
            with pytest.raises(PreconditionError, match="weights_checksum"):
                await backend.forward(1, groups(), 5.0)
            nan = [(0, torch.full((2, HIDDEN), float("nan")))]
            backend.identity = Identity(app.host.model_id, app.host.weights_checksum)
            with pytest.raises(MoeMeshError, match="non-finite"):
                await backend.forward(1, nan, 5.0)
            assert not backend.fast_path.fallbacks and backend.transport == "ucx"
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
        finally:
            await backend.close()


# -- bad frames, sent raw ---------------------------------------------------------------------------


def good_header(app: ExpertApp, **overrides) -> f.RequestHeader:
    fields = dict(
        model_id=app.host.model_id,
        weights_checksum=app.host.weights_checksum,
        layer=1,
        expert_ids=[0],
        token_counts=[4],
        dtype="float32",
        shape=[4, HIDDEN],
        payload_bytes=4 * HIDDEN * 4,
    )
    return f.RequestHeader(**{**fields, **overrides})


def message(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


async def raw_exchange(port: int, messages: list[np.ndarray]) -> f.Header:
    """Connect, send `messages` as they are, and read the reply frame."""
    ucxx = UcxRuntime.acquire(loopback=True)
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    reader = FrameReader(MESSAGE_BYTES)
    # Submitted in order, not awaited one by one: the service may refuse (and close) after message 1.
    sends = [asyncio.ensure_future(ep.send(m)) for m in messages]
    try:
        header, _ = await asyncio.wait_for(reader.read(ep, 5.0), 5.0)
        return header
    finally:
        ep.abort()  # before `messages` may be freed: UCX does not cancel sends in flight
        await asyncio.gather(*sends, return_exceptions=True)
        UcxRuntime.release()


def payload(n_bytes: int) -> list[np.ndarray]:
    data = torch.randn(n_bytes // 4).numpy().view(np.uint8)
    return [data, message(f.encode_trailer(data.nbytes))]


OVERSIZED = struct.pack("<4sHHI", f.MAGIC, f.VERSION, 1, f.MAX_HEADER_BYTES + 1)


@pytest.mark.parametrize(
    ("name", "frame", "code", "match"),
    [
        (
            "wrong fingerprint",
            lambda a: [f.encode_header(good_header(a, weights_checksum="x")), *payload(1024)],
            "FAILED_PRECONDITION",
            "weights_checksum",
        ),
        (
            "unknown layer",
            lambda a: [f.encode_header(good_header(a, layer=2)), *payload(1024)],
            "NOT_FOUND",
            "layer 2",
        ),
        (
            "shape/hidden mismatch",
            lambda a: [f.encode_header(good_header(a, shape=[8, 32])), *payload(1024)],
            "INVALID_ARGUMENT",
            "hidden.shape",
        ),
        (
            "byte count mismatch",
            lambda a: [f.encode_header(good_header(a, payload_bytes=1000)), *payload(1000)],
            "INVALID_ARGUMENT",
            "needs 1024",
        ),
        (
            "short payload",
            lambda a: [f.encode_header(good_header(a)), *payload(512)],
            "INVALID_ARGUMENT",
            "short payload",
        ),
        (
            "over the size limit",
            lambda a: [
                f.encode_header(
                    good_header(a, shape=[1 << 21, HIDDEN], payload_bytes=(1 << 21) * HIDDEN * 4)
                )
            ],
            "RESOURCE_EXHAUSTED",
            "size limit",
        ),
        (
            "oversized header (prefix)",
            lambda a: [OVERSIZED + b"{}"],
            "INVALID_ARGUMENT",
            "exceeds the limit",
        ),
        (
            "oversized header (message)",
            lambda a: [OVERSIZED + b" " * (f.MAX_HEADER_BYTES + 64)],
            "INVALID_ARGUMENT",
            "exceeds",
        ),
        (
            "garbage",
            lambda a: [b"\x16\x03\x01 hello, is this TLS?"],
            "INVALID_ARGUMENT",
            "not a fast-path frame",
        ),
        (
            "old frame version",
            lambda a: [f.encode_header(good_header(a), version=0), *payload(1024)],
            "VERSION",
            "version 0 is not supported",
        ),
        (
            "a reply where a request belongs",
            lambda a: [f.encode_header(f.ReplyHeader("float32", [1], 4)), *payload(4)],
            "INVALID_ARGUMENT",
            "expected a request",
        ),
    ],
)
async def test_bad_frames_get_the_matching_error_and_the_service_stays_healthy(
    checkpoint, name, frame, code, match
) -> None:
    async with expert(checkpoint) as app:
        port = app.fast_path.server.port
        messages = [message(m) if isinstance(m, bytes) else m for m in frame(app)]
        reply = await raw_exchange(port, messages)
        assert isinstance(reply, f.ErrorHeader), name
        assert reply.code == code and match in reply.message, reply
        # The listener and the service answer the next call on both transports.
        fast, slow = remote(app), remote(app, mode="off")
        try:
            assert (await fast.forward(1, groups(), 5.0)).transport == "ucx"
            assert (await slow.forward(1, groups(), 5.0)).transport == "grpc"
        finally:
            await fast.close()
            await slow.close()


# -- fallback ---------------------------------------------------------------------------------------


async def test_without_the_listener_calls_fall_back_to_grpc_back_off_and_re_probe(
    checkpoint,
) -> None:
    causes: list[str] = []
    async with expert(checkpoint) as app:
        backend = remote(app, backoff_s=0.3, on_fallback=causes.append)
        link = backend.fast_path
        want = await remote(app, mode="off").forward(1, groups(), 5.0)
        try:
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            await app.fast_path.server.stop()  # the listener dies; gRPC stays up
            got = await backend.forward(1, groups(), 5.0)
            assert got.transport == "grpc" and all(torch.equal(g, w) for g, w in zip(got, want))
            assert sum(link.fallbacks.values()) == 1 and causes
            assert backend.transport == "grpc"  # backed off: the next calls skip UCX at once
            assert (await backend.forward(1, groups(), 5.0)).transport == "grpc"
            assert sum(link.fallbacks.values()) == 1
            await asyncio.sleep(0.35)  # back-off over: UCX is tried again, fails, backs off longer
            assert (await backend.forward(1, groups(), 5.0)).transport == "grpc"
            assert sum(link.fallbacks.values()) == 2
            assert link.off_until - link.clock() > 0.4
            # The listener returns. UCX binds without SO_REUSEADDR, so the old port may linger in
            # TIME_WAIT: the new listener takes a free port and the link is pointed at it, as a
            # restarted service's new registration would.
            app.fast_path.server = FrameServer(
                app.fast_path.forward, MESSAGE_BYTES, port=0, loopback=True
            )
            link.client.port = await app.fast_path.server.start()
            await asyncio.sleep(max(0.0, link.off_until - link.clock()) + 0.05)
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
        finally:
            await backend.close()


async def test_an_old_frame_version_peer_makes_the_router_fall_back_cleanly() -> None:
    ucxx = UcxRuntime.acquire(loopback=True)
    endpoints = []

    async def old_service(ep) -> None:
        """A service speaking frame version 0: it refuses our frame, in its own version."""
        endpoints.append(ep)
        await ep.recv(np.empty(f.FIRST_MESSAGE_BYTES, np.uint8))
        refusal = f.ErrorHeader("VERSION", "frame version 1 is not supported", "version")
        await ep.send(message(f.encode_header(refusal, version=0)))

    listener = ucxx.create_listener(old_service, port=0)
    client = FrameClient("127.0.0.1", listener.port, MESSAGE_BYTES)
    try:
        header = f.RequestHeader("m", "c", 0, [0], [2], "float32", [2, 4], 32)
        with pytest.raises(FastPathError) as info:
            await client.call(header, torch.randn(2, 4), 2.0)
        assert info.value.cause == "version" and "version 0 is not supported" in str(info.value)
    finally:
        client.close()
        for ep in endpoints:
            ep.abort()
        listener.close()
        UcxRuntime.release()


async def test_with_ucxx_import_blocked_everything_goes_over_grpc(checkpoint, monkeypatch) -> None:
    async with expert(checkpoint, fast_path="off") as app:
        assert app.fast_paths == []
        monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` now raises ImportError
        assert load_ucxx() is None
        backend = remote(app)
        backend.offer_fast_path(["ucx://127.0.0.1:1"])
        assert backend.fast_path is None
        try:
            assert (await backend.forward(1, groups(), 5.0)).transport == "grpc"
        finally:
            await backend.close()


async def test_retire_aborts_ucx_calls_in_flight_without_falling_back(checkpoint) -> None:
    async with expert(checkpoint, max_queue_delay_us=300_000) as app:
        backend = remote(app)
        try:
            await backend.forward(1, groups(), 5.0)  # connected
            call = asyncio.create_task(backend.forward(1, groups(), 5.0))
            await asyncio.sleep(0.05)  # the call waits in the batcher's queue delay
            backend.retire()
            with pytest.raises(UnavailableError, match="left the mesh"):
                await call
            assert not backend.fast_path.fallbacks
        finally:
            await backend.close()
