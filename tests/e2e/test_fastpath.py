"""The UCX fast path between real processes on loopback: every family's greedy tokens identical to
transformers with every expert remote and every expert call over UCX with UCX_TLS=tcp and the whole
mesh under mutual TLS, so the hellos carry certificate proofs (over shared memory, UCX's default
here, test_mesh.py's all-remote parity shows the same); with ucxx not importable everything goes
over gRPC with the same tokens; a replica whose fast path goes away mid-load costs no request, is
counted, and is used again once it returns; payloads of each UCX protocol (inline, a second eager
message, rendezvous) cross byte for byte.

The router runs as a process of its own: UCX reads its environment when ucxx is imported, which this
test process has long done. What carried the calls is read from the router's Status (each replica's
fast-path calls and fallbacks against all remote calls), its span file and its /metrics."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from common.fastpath import parse_worker_url
from common.fastpath.client import FrameClient
from common.fastpath.frame import RequestHeader
from common.fastpath.ucx import load_ucxx
from common.tls import MeshTls, open_channel
from expert_service.app import ExpertApp
from expert_service.settings import ExpertSettings
from moe_mesh.local import certs
from moe_mesh.local.processes import ServiceProcess, start_experts, stop_all
from moe_mesh.ops.traces import load_spans
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, router_pb2, router_pb2_grpc
from tests.support import hf
from tests.support.metrics import scrape, total
from tests.support.polling import eventually
from tests.support.reference import ALL_REMOTE, PROMPTS
from tests.support.routers import generate, request

pytestmark = pytest.mark.skipif(
    load_ucxx(loopback=True) is None,
    reason="ucxx cannot be imported (the fastpath extra: pip install 'moe-mesh[fastpath]')",
)
FALLBACKS = "moe_router_fast_path_fallbacks_total"


def router_process(
    path: Path, experts: list[str], workdir: Path, *args: str, env: dict | None = None
) -> ServiceProcess:
    """Started, not yet ready (see ServiceProcess.wait_ready)."""
    return ServiceProcess(
        "router_service",
        ["--checkpoint", str(path), *sum((["--expert", a] for a in experts), []), *args],
        workdir,
        "router",
        env,
    )


@contextmanager
def mesh(
    path: Path, workdir: Path, *router_args: str, env: dict | None = None, tls: bool = False
) -> Iterator:
    """Expert services and a router; with `tls` every one of them serves mutual TLS."""
    expert_tls = router_tls = []
    if tls:
        certs.create(workdir / "certs", ["expert", "router"])
        expert_tls, router_tls = (certs.flags(workdir / "certs", k) for k in ("expert", "router"))
    experts = start_experts(path, ALL_REMOTE, workdir, *expert_tls, env=env)
    try:
        addresses = [e.address for e in experts]
        router = router_process(path, addresses, workdir, *router_tls, *router_args, env=env)
        try:
            yield router.wait_ready(), experts
        finally:
            router.stop()
    finally:
        stop_all(experts)


async def generate_all(
    address: str, max_tokens: int = 32, tls: MeshTls | None = None
) -> tuple[tuple[int, ...], ...]:
    """The reference prompts, all in flight at once (one batch), greedy."""
    async with open_channel(address, [], tls=tls) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        replies = await asyncio.gather(
            *(generate(stub, request(i, max_tokens)) for i in range(len(PROMPTS)))
        )
    return tuple(tokens for tokens, _ in replies)


async def status(address: str, tls: MeshTls | None = None) -> router_pb2.RouterStatus:
    async with open_channel(address, [], tls=tls) as channel:
        return await router_pb2_grpc.RouterServiceStub(channel).Status(
            router_pb2.RouterStatusRequest(), timeout=5
        )


async def replica(address: str, backend: str) -> router_pb2.ExpertReplica:
    return next(r for r in (await status(address)).replicas if r.backend == backend)


# -- parity over UCX ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
async def test_every_family_matches_transformers_with_every_call_over_ucx_tcp(
    checkpoint, tmp_path, arch
) -> None:
    path = checkpoint(arch)
    trace_file = tmp_path / "router.spans.jsonl"
    args = ["--fast-path", "ucx", "--trace-file", str(trace_file), "--trace-sample", "1"]
    with mesh(path, tmp_path, *args, env={"UCX_TLS": "tcp"}, tls=True) as (router, experts):
        client = certs.mesh_tls(tmp_path / "certs", "router")
        assert await generate_all(router.address, tls=client) == hf.greedy(path)
        st = await status(router.address, client)
        rows = {r.backend: r for r in st.replicas}
        assert set(rows) == {e.address for e in experts}
        assert all(r.transport == "ucx" and r.fast_path_fallbacks == 0 for r in rows.values())
        # Every call the dispatcher sent to an expert service, the fast path carried.
        assert sum(r.fast_path_calls for r in rows.values()) == st.remote_calls > 0
    calls = [s for s in load_spans([trace_file]) if s["name"] == "moe.expert_call"]
    assert len(calls) == st.remote_calls
    assert {s["attributes"]["moe.transport"] for s in calls} == {"ucx"}


# -- fallback ----------------------------------------------------------------------------------------


async def test_with_ucxx_import_blocked_everything_goes_over_grpc_with_the_same_tokens(
    checkpoint, tmp_path
) -> None:
    shim = tmp_path / "no_ucxx"
    (shim / "ucxx").mkdir(parents=True)
    (shim / "ucxx" / "__init__.py").write_text('raise ImportError("ucxx blocked by the test")\n')
    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    path = checkpoint("mixtral")
    with mesh(path, tmp_path, env=env) as (router, experts):  # fast path: auto
        for e in experts:
            assert e.ready["fast_paths"] == []
            async with grpc.aio.insecure_channel(e.address) as channel:
                described = await expert_pb2_grpc.ExpertServiceStub(channel).Describe(
                    expert_pb2.DescribeRequest(), timeout=5
                )
            assert list(described.fast_paths) == []
        assert await generate_all(router.address) == hf.greedy(path)
        st = await status(router.address)
        assert st.remote_calls > 0
        assert all(
            (r.transport, r.fast_path, r.fast_path_calls, r.fast_path_fallbacks)
            == ("grpc", "", 0, 0)
            for r in st.replicas
        )


async def test_a_fast_path_lost_mid_load_costs_no_request_and_comes_back(
    checkpoint, tmp_path
) -> None:
    """Two expert services in this process (one's fast path is stopped and started again while
    requests keep coming), the router in another."""
    path = checkpoint("qwen3_moe")
    want = tuple(t[:8] for t in hf.greedy(path))
    apps: list[ExpertApp] = []
    try:
        for spec in ALL_REMOTE:
            # The restarted fast path answers at the same worker address (the worker lives as
            # long as this event loop), so the router finds it again without a new Describe.
            app = await ExpertApp.create(
                ExpertSettings(
                    checkpoint=path,
                    experts=spec,
                    fast_path="ucx",
                    compute_threads=1,
                    grace_s=1.0,
                )
            )
            apps.append(app)
            await app.start()
        victim = apps[0]
        router = router_process(
            path,
            [a.address for a in apps],
            tmp_path,
            "--fast-path",
            "ucx",
            "--fast-path-backoff-s",
            "0.2",
            "--metrics-port",
            "0",
        )
        try:
            # Waited for on a thread: this event loop serves the expert services it describes.
            await asyncio.to_thread(router.wait_ready)
            done = asyncio.Event()
            results: list = []

            async def load() -> None:
                for _ in range(300):  # bounded: the phases below end it long before
                    try:
                        results.append(await generate_all(router.address, max_tokens=8))
                    except Exception as e:  # counted: the test requires none
                        results.append(e)
                    if done.is_set():
                        return

            async def phases() -> None:
                calls = lambda: replica(router.address, victim.address)  # noqa: E731
                await eventually(
                    lambda: _fast(calls(), lambda r: r.fast_path_calls > 0), 60, "UCX calls"
                )
                await victim.fast_path.server.stop()
                await eventually(
                    lambda: _fast(calls(), lambda r: r.fast_path_fallbacks > 0), 30, "a fallback"
                )
                before = (await calls()).fast_path_calls
                await victim.fast_path.server.start()
                # Re-probed after the back-off (doubling from 0.2 s while the listener was gone).
                await eventually(
                    lambda: _fast(calls(), lambda r: r.fast_path_calls > before + 5),
                    30,
                    "UCX calls again after the listener returned",
                )

            try:
                await asyncio.gather(load(), _then(phases(), done))
            finally:
                done.set()
            failed = [r for r in results if isinstance(r, Exception)]
            assert results and not failed
            assert all(r == want for r in results)
            row = await replica(router.address, victim.address)
            assert row.transport == "ucx" and row.fast_path_fallbacks > 0
            samples = scrape(router.ready["metrics"])
            assert total(samples, FALLBACKS) == row.fast_path_fallbacks
        finally:
            await asyncio.to_thread(router.stop)
    finally:
        for app in apps:
            await app.stop()


async def _fast(row, ok) -> bool:
    return ok(await row)


async def _then(coro, event: asyncio.Event) -> None:
    try:
        await coro
    finally:
        event.set()


# -- payload sizes between processes -----------------------------------------------------------------

_ECHO_SERVER = """
import asyncio, sys
from common.fastpath.server import FrameServer

async def main():
    async def echo(header, payload):
        return payload
    server = FrameServer(echo, 64 << 20)
    print(await server.start(), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
    await server.stop()

asyncio.run(main())
"""


@pytest.mark.parametrize("tls", ["default", "tcp"])
async def test_payloads_of_every_protocol_cross_between_processes_exactly(tls) -> None:
    """Inline in one eager message, a second eager message (over 256 KiB), and rendezvous (over
    the 2 MiB eager limit within a host): each arrives whole, byte for byte, twice in a row."""
    env = {**os.environ, **({"UCX_TLS": "tcp"} if tls == "tcp" else {})}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    client = None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        target = parse_worker_url(line.strip())
        assert target is not None, line
        client = FrameClient(target, 64 << 20)
        for n_bytes in (8 << 10, 1 << 20, 4 << 20):
            x = torch.randn(n_bytes // 4 // 64, 64)
            header = RequestHeader(
                "m", "c", 0, [0], [x.shape[0]], "float32", list(x.shape), n_bytes
            )
            for _ in range(2):
                out, _ = await client.call(header, x, 20.0)
                assert torch.equal(out, x), n_bytes
    finally:
        if client is not None:
            client.close()
        proc.stdin.close()
        proc.wait(20)
        proc.stdout.close()
