"""The UCX fast path against a real expert service on loopback: the same outputs as gRPC, a matching
error for every kind of bad frame with the service staying healthy, per-call fallback to gRPC with
back-off and re-probe when the service's fast path goes away, and a service process that listens
on loopback only."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch
import uvloop

from common.errors import (
    MoeMeshError,
    NotFoundError,
    PreconditionError,
    UnavailableError,
)
from common.fastpath import frame as f
from common.fastpath import parse_worker_url, ucx, worker_url
from common.fastpath.ucx import UcxRuntime, close_endpoint, load_ucxx, read_frame
from expert_service import batcher as batcher_module
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.remote import Identity, RemoteExperts
from tests.support.polling import eventually

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None, reason=f"UCX fast path unavailable: {ucx.unavailable}"
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
        assert app.fast_paths and parse_worker_url(app.fast_paths) is not None
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
            # NOT_FOUND: what a replica placed for experts it no longer serves says, which the
            # backend reports as the replica failing (RemoteExperts.forward), over either transport.
            with pytest.raises(UnavailableError, match="layer 2") as e:
                await backend.forward(2, groups(), 5.0)
            assert isinstance(e.value.__cause__, NotFoundError)
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
        call=1,
    )
    return f.RequestHeader(**{**fields, **overrides})


def message(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


async def raw_exchange(app: ExpertApp, messages: list[np.ndarray]) -> f.Header:
    """Say hello, send `messages` as they are on the request tag, and read the answer: on call 1's
    tag (an error about the call) or on the control tag (a frame the service could not read)."""
    runtime = UcxRuntime.acquire(loopback=True)
    target = parse_worker_url(app.fast_paths)
    ep = await runtime.connect(target.address)
    client_id = 12345
    runtime.send(
        ep, message(f.encode_hello(client_id, runtime.address)), f.hello_tag(target.server)
    )
    answers = [
        asyncio.ensure_future(read_frame(runtime, tag, MESSAGE_BYTES, 5.0))
        for tag in (f.reply_tag(client_id, 1), f.control_tag(client_id))
    ]
    try:
        for m in messages:  # submitted in order, not awaited: the service may refuse after one
            runtime.send(ep, m, f.request_tag(client_id))
        done, _ = await asyncio.wait(answers, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        header, _ = done.pop().result()
        return header
    finally:
        for answer in answers:
            answer.cancel()
        close_endpoint(ep)
        UcxRuntime.release()


def payload(n_bytes: int) -> list[np.ndarray]:
    return [torch.randn(n_bytes // 4).numpy().view(np.uint8)]


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
            "long payload",
            lambda a: [f.encode_header(good_header(a)), *payload(2048)],
            "INVALID_ARGUMENT",
            "more than the 1024 bytes",
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
        messages = [message(m) if isinstance(m, bytes) else m for m in frame(app)]
        reply = await raw_exchange(app, messages)
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


async def test_a_stopping_service_answers_the_fast_path_calls_in_flight(
    checkpoint, monkeypatch
) -> None:
    """Stopping drains the fast path's calls within the grace period, as gRPC's: all of a router's
    calls may go over UCX, and cutting them would leave it only a gRPC server already stopped."""
    release = threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # the call stays in flight until the service is stopping
        release.wait(10)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    settings = ExpertSettings(checkpoint=checkpoint("mixtral"), experts="0-1:0-3", grace_s=5.0)
    app = await ExpertApp.create(settings)
    await app.start()
    backend = remote(app, timeout_s=5.0)  # not the 0.5 s after which a call goes over gRPC
    try:
        await eventually(lambda: backend.transport == "ucx", what="the fast path up")
        call = asyncio.ensure_future(backend.forward(1, groups(), 10.0))
        await eventually(lambda: app.host.batcher.stats.groups == 3, what="the call queued")
        stop = asyncio.ensure_future(app.stop())
        await asyncio.sleep(0.5)  # the gRPC drain is over (no gRPC call): the fast path's next
        assert not call.done() and not stop.done()
        release.set()
        assert (await call).transport == "ucx"
        await asyncio.wait_for(stop, 5.0)
    finally:
        release.set()
        await backend.close()
        await app.stop()


async def test_without_the_fast_path_calls_fall_back_to_grpc_back_off_and_re_probe(
    checkpoint,
) -> None:
    causes: list[str] = []
    async with expert(checkpoint) as app:
        backend = remote(app, backoff_s=0.3, timeout_s=0.2, on_fallback=causes.append)
        link = backend.fast_path
        want = await remote(app, mode="off").forward(1, groups(), 5.0)
        try:
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            await app.fast_path.server.stop()  # the fast path dies; gRPC stays up
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
            # The fast path returns at the same worker address; after the back-off the link says
            # hello again and is back.
            assert await app.fast_path.server.start() == app.fast_paths[0]
            await asyncio.sleep(max(0.0, link.off_until - link.clock()) + 0.05)
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
        finally:
            await backend.close()


async def test_a_large_call_gets_a_fast_path_attempt_scaled_to_its_rows(
    checkpoint, monkeypatch
) -> None:
    """A long prompt's prefill may take longer than --fast-path-timeout-s: abandoning it would
    compute it twice (UCX, then gRPC) and put the replica on gRPC for a back-off."""
    compute = batcher_module._compute
    rows_computed: list[int] = []

    def slow(parts, w):  # 2 ms a row
        rows_computed.append(sum(p.shape[0] for p in parts))
        time.sleep(0.002 * rows_computed[-1])
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", slow)
    async with expert(checkpoint) as app:
        backend = remote(app, timeout_s=0.1)
        try:
            big = [(e, rows.repeat(20, 1)) for e, rows in groups()]  # 260 rows, 0.17 s per expert
            started = time.monotonic()
            got = await backend.forward(1, big, 10.0)
            assert got.transport == "ucx" and time.monotonic() - started > 0.3
            assert not backend.fast_path.fallbacks and sum(rows_computed) == 260
        finally:
            await backend.close()


async def test_garbage_on_the_hello_tag_is_dropped_and_the_service_stays_healthy(
    checkpoint,
) -> None:
    async with expert(checkpoint) as app:
        runtime = UcxRuntime.acquire(loopback=True)
        target = parse_worker_url(app.fast_paths)
        ep = await runtime.connect(target.address)
        try:
            for junk in [
                b"x",
                b"\x16\x03\x01 hello, is this TLS?" * 300,
                f.encode_hello(7, b"no address")[:-1] + b"!",
            ]:
                runtime.send(ep, message(junk), f.hello_tag(target.server))
            await asyncio.sleep(0.1)
            assert not app.fast_path.server.clients
            backend = remote(app)
            try:
                assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            finally:
                await backend.close()
        finally:
            close_endpoint(ep)
            UcxRuntime.release()


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of every LISTEN TCP socket of process `pid` (from /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.append(str(ipaddress.ip_address(raw)))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is a v6 socket's 127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_expert_service_process_listens_on_loopback_only(checkpoint, tmp_path) -> None:
    from moe_mesh.local.processes import start_experts

    (proc,) = start_experts(checkpoint("mixtral"), ["0-1:0-3"], tmp_path, "--fast-path", "ucx")
    try:
        ready = (tmp_path / "expert0.ready.json").read_text()
        assert "ucx-worker:" in ready  # the fast path is on
        addresses = listening_addresses(proc.proc.pid)
        assert addresses, "the gRPC port at least"
        assert all(_loopback(a) for a in addresses), addresses
    finally:
        proc.stop()


async def test_with_ucxx_import_blocked_everything_goes_over_grpc(checkpoint, monkeypatch) -> None:
    async with expert(checkpoint, fast_path="off") as app:
        assert app.fast_paths == []
        monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` now raises ImportError
        assert load_ucxx() is None
        backend = remote(app)
        backend.offer_fast_path(["ucx-worker:AAAA"])
        assert backend.fast_path is None
        try:
            assert (await backend.forward(1, groups(), 5.0)).transport == "grpc"
        finally:
            await backend.close()


async def test_ucx_segments_over_16_bits_turn_the_fast_path_off_saying_why(
    checkpoint, monkeypatch
) -> None:
    """UCX's shared memory truncates fragments over 65535 bytes (a 16-bit length): with such a
    segment size every call would time out or arrive short, so the fast path is off, and a
    service told `--fast-path ucx` refuses to start, naming the variable."""
    assert ucx.oversized_segments({"UCX_MM_SEG_SIZE": "8256"}) is None
    assert ucx.oversized_segments({"UCX_POSIX_SEG_SIZE": "65535"}) is None
    assert ucx.oversized_segments({"UCX_MM_SEG_SIZE": "64k"})  # 65536 does not fit either
    assert ucx.oversized_segments({"UCX_XPMEM_SEG_SIZE": "1GB"})
    assert ucx.oversized_segments({"UCX_MM_SEG_SIZE": "inf"})
    monkeypatch.setenv("UCX_SYSV_SEG_SIZE", "140000")
    assert load_ucxx() is None
    with pytest.raises(PreconditionError, match="UCX_SYSV_SEG_SIZE=140000 is over the 65535"):
        async with expert(checkpoint, fast_path="ucx"):
            pass
    async with expert(checkpoint) as app:  # auto: served over gRPC only
        assert app.fast_paths == []
        assert not FastPathConfig().enabled()


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


async def test_a_check_adopts_the_fast_path_the_service_advertises_now(checkpoint) -> None:
    """A restarted service listens on a new UCX worker address; the check that re-admits it
    (RemoteExperts.check) replaces the link to the old one, which could only fail."""
    async with expert(checkpoint) as app:
        target = parse_worker_url(app.fast_paths)
        before = worker_url(target.address, target.server + 1)  # where it listened before
        backend = remote(app, timeout_s=0.2)
        backend.fast_path.close()
        backend.fast_path = None
        backend.offer_fast_path([before])
        stale = backend.fast_path
        try:
            await backend.check(5.0)
            assert stale.client.closed and backend.fast_path.url == app.fast_paths[0]
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            link = backend.fast_path
            await backend.check(5.0)
            assert backend.fast_path is link and not link.fallbacks  # the same place: kept
        finally:
            await backend.close()


async def test_a_router_says_hello_before_its_first_call(checkpoint) -> None:
    """The backend connects when it learns the fast path, so the first call does not pay for the
    hello (slow enough, under load, to be hedged to another replica)."""
    async with expert(checkpoint) as app:
        backend = remote(app)
        try:
            await eventually(lambda: len(app.fast_path.server.clients) == 1, 10, "the hello")
            assert backend.fast_path.calls == 0
            assert (await backend.forward(1, groups(), 5.0)).transport == "ucx"
            assert len(app.fast_path.server.clients) == 1  # the same connection carried it
        finally:
            await backend.close()


async def test_while_a_message_is_part_way_the_runtime_progresses_every_busy_tick(
    monkeypatch,
) -> None:
    """Nothing is sure to wake the worker for the rest of a message (a send waiting for room at
    its peer, a receive's later fragments), so the guard tick shortens while one is part-way and
    requests keep moving."""
    await _busy_ticks(monkeypatch)


class PartWay:
    """A UCX request for a message still arriving (tag_recv_with_handle's, or a send's)."""

    completed = False

    def check_error(self) -> None:
        pass


def test_under_uvloop_the_busy_tick_is_a_timer_not_a_spin(monkeypatch) -> None:
    """The services and routers run uvloop, which runs a call_later shorter than its 1 ms
    resolution at once: a shorter busy tick spun the loop and failed on the Handle it got."""
    uvloop.run(_busy_ticks(monkeypatch))


def test_a_message_found_part_way_gets_its_sender_the_core_not_a_tick(monkeypatch) -> None:
    """The rest of a message whose first fragment woke us is often held by its sender, preempted
    on our core: the runtime yields the core and progresses again at once, once per loop turn,
    for YIELD_FOR_S, so the receive completes without waiting for the (1 ms) busy tick; a sender
    that never finishes leaves the runtime on the busy tick, not yielding for ever."""
    uvloop.run(_part_way(monkeypatch))


async def _part_way(monkeypatch) -> None:
    runtime = UcxRuntime.acquire(loopback=True)
    yields = probes = 0
    sender_finishes = True

    request = PartWay()

    def sched_yield() -> None:  # the preempted sender runs and sends the rest
        nonlocal yields
        yields += 1
        request.completed = sender_finishes

    class Probe:
        length = 4

        def __init__(self, matched: bool) -> None:
            self.matched = matched

    class Worker:  # the real worker, but a message's first fragment arrives after recv() asks
        def __init__(self, real) -> None:
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def tag_probe(self, tag, remove):
            nonlocal probes
            probes += 1
            return Probe(matched=probes % 2 == 0)

        def tag_recv_with_handle(self, buffer, probe):
            return request

    monkeypatch.setattr(ucx.os, "sched_yield", sched_yield)
    monkeypatch.setattr(ucx, "YIELD_FOR_S", 0.05)
    monkeypatch.setattr(runtime, "worker", Worker(runtime.worker))
    try:
        future = runtime.recv(1, 16)  # not there yet: found by the next progress
        for _ in range(5):  # loop turns, far below uvloop's 1 ms timer resolution
            await asyncio.sleep(0)
        assert future.done() and yields == 1
        # A sender gone mid-message: one yield per loop turn, then the busy tick takes over.
        sender_finishes, request.completed, yields = False, False, 0
        runtime.recv(1, 16)
        for turns in range(1, 21):
            await asyncio.sleep(0)
            assert 0 < yields <= turns + 1
        await asyncio.sleep(ucx.YIELD_FOR_S + 0.01)
        stopped = yields
        await asyncio.sleep(0.02)
        assert yields == stopped and runtime._tick is not None
    finally:
        runtime._requests.clear()
        runtime._waiters.clear()
        UcxRuntime.release()


async def _busy_ticks(monkeypatch) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    runtime = UcxRuntime.acquire(loopback=True)
    progressed = 0
    progress = runtime._progress

    def counted() -> None:
        nonlocal progressed
        progressed += 1
        progress()

    monkeypatch.setattr(runtime, "_progress", counted)  # what kick and the tick call

    def busy() -> bool:  # the next tick is a busy one (uvloop's clock counts whole ms)
        return runtime._tick.when() - loop.time() <= ucx.BUSY_TICK_S * 1.01

    try:
        runtime._requests.append((PartWay(), None, None))
        runtime.kick()  # as a submit does
        await asyncio.sleep(0)
        assert ucx.BUSY_TICK_S < ucx.TICK_S / 100 and busy()
        progressed = 0
        await asyncio.sleep(0.05)
        assert 0 < progressed <= 0.05 / ucx.BUSY_TICK_S + 5, "the busy tick spins"
        runtime._requests.clear()
        await asyncio.sleep(2 * ucx.BUSY_TICK_S)  # the busy tick fired and found nothing part-way
        assert runtime._tick is None or not busy()
        # One that never moves again (its sender gone mid-message) goes back to the guard tick.
        monkeypatch.setattr(ucx, "BUSY_FOR_S", 0.05)
        runtime._requests.append((PartWay(), None, None))
        runtime.kick()
        await asyncio.sleep(0.01)
        assert busy()
        await asyncio.sleep(0.1)
        assert not busy()
        assert errors == []
    finally:
        runtime._requests.clear()
        UcxRuntime.release()
