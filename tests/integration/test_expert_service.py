"""Expert service over real gRPC: Forward/Describe values, a status per bad input, dynamic batching across
callers, and a subprocess that drains an in-flight call on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_mesh.common.checkpoint import Checkpoint
from moe_mesh.common.errors import UnavailableError
from moe_mesh.common.moe import expert_ffn
from moe_mesh.common.placement import parse_experts
from moe_mesh.common.server import channel_options
from moe_mesh.common.weights import FFNWeights
from moe_mesh.common.wire import decode, encode
from moe_mesh.expert_service import batcher as batcher_module
from moe_mesh.expert_service import cli
from moe_mesh.expert_service.app import SERVICE_NAME, build_server
from moe_mesh.expert_service.batcher import DynamicBatcher
from moe_mesh.expert_service.core import ExpertHost
from moe_mesh.expert_service.settings import ExpertSettings
from moe_mesh.protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2

ARCH = "mixtral"
SPEC = "0-1:0-3"  # layer 2 and experts 4-7 are served elsewhere
HIDDEN = 64
MESSAGE_BYTES = 16 * 1024 * 1024
Groups = list[tuple[int, torch.Tensor]]


def reference(
    path: Path, layer: int, groups: Groups, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """What the service must return: expert_ffn on independently loaded weights, one group at a time."""
    weights = Checkpoint(path, dtype=dtype).load_experts([(layer, e) for e, _ in groups])
    return [expert_ffn(rows, weights[(layer, e)]) for e, rows in groups]


def forward_request(
    host: ExpertHost, layer: int, groups: Groups
) -> expert_pb2.ExpertForwardRequest:
    return expert_pb2.ExpertForwardRequest(
        model_id=host.model_id,
        weights_checksum=host.weights_checksum,
        layer=layer,
        expert_ids=[e for e, _ in groups],
        token_counts=[len(rows) for _, rows in groups],
        hidden=encode(torch.cat([rows for _, rows in groups])),
    )


def decode_output(
    response: expert_pb2.ExpertForwardResponse, counts: list[int]
) -> list[torch.Tensor]:
    return list(torch.split(decode(response.output, "output"), counts))


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-6) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.allclose(g.float(), w.float(), atol=atol, rtol=0), (
            (g - w).abs().max()
        )


@asynccontextmanager
async def serving(settings: ExpertSettings) -> AsyncIterator[tuple[str, ExpertHost]]:
    """A real server on a free loopback port, stopped (and its batcher closed) afterwards."""
    server, host = build_server(settings)
    address = await server.start()
    try:
        yield address, host
    finally:
        await server.stop()
        await host.close()


def connect(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(MESSAGE_BYTES))


@pytest.fixture
def settings(checkpoint) -> Callable[..., ExpertSettings]:
    def make(**overrides) -> ExpertSettings:
        return ExpertSettings(
            **{"checkpoint": checkpoint(ARCH), "experts": SPEC, "grace_s": 2.0, **overrides}
        )

    return make


# -- values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "kwargs", "dtype"),
    [
        ("mixtral", {}, "float32"),
        ("qwen3_moe", {"expert_layout": "fused"}, "float32"),
        ("olmoe", {}, "bfloat16"),
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


def test_host_loads_only_its_experts(settings) -> None:
    for spec in (SPEC, "2:7; 0:5"):
        host = ExpertHost(settings(experts=spec))
        assert sorted(host.weights) == parse_experts(spec, host.spec)
        assert all(isinstance(w, FFNWeights) for w in host.weights.values())


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
    async with serving(settings(max_queue_delay_us=200_000)) as (address, host):
        responses, stats = await _two_routers(address, host, groups)
    assert (stats.forward_calls, stats.groups, stats.batches, stats.tokens) == (2, 2, 1, 7)
    for response, g in zip(responses, groups):
        assert_close(
            decode_output(response, [len(g[0][1])]), reference(settings().checkpoint, 0, g)
        )


async def test_batches_are_capped_at_max_batch_tokens_and_results_stay_per_caller(settings) -> None:
    groups = [
        [(2, torch.randn(4, HIDDEN)), (0, torch.randn(1, HIDDEN))],
        [(2, torch.randn(5, HIDDEN))],
    ]
    async with serving(settings(max_queue_delay_us=200_000, max_batch_tokens=3)) as (address, host):
        responses, stats = await _two_routers(address, host, groups)
    # Expert 2's 9 rows fill exactly three batches of 3 (groups split across batches); expert 0 takes one.
    assert (stats.groups, stats.batches, stats.tokens) == (3, 4, 10)
    for response, g in zip(responses, groups):
        assert_close(
            decode_output(response, [len(rows) for _, rows in g]),
            reference(settings().checkpoint, 0, g),
        )


async def test_groups_queued_during_a_compute_merge_into_the_next_batch_without_delay(
    settings, monkeypatch
) -> None:
    started, release = threading.Event(), threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # holds the compute thread until the test has queued more groups
        started.set()
        release.wait(5)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    host = ExpertHost(settings())
    batcher = DynamicBatcher(host.weights, max_queue_delay_us=0)
    rows = [torch.randn(n, HIDDEN) for n in (2, 3, 4)]
    first = asyncio.ensure_future(batcher.submit(0, 1, rows[0]))
    assert await asyncio.to_thread(started.wait, 5)
    rest = [asyncio.ensure_future(batcher.submit(0, 1, r)) for r in rows[1:]]
    await asyncio.sleep(0.02)  # both queue behind the running batch
    release.set()
    results = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    assert (batcher.stats.groups, batcher.stats.batches, batcher.stats.tokens) == (3, 2, 9)
    assert_close(results, [expert_ffn(r, host.weights[(0, 1)]) for r in rows])
    await batcher.close()


async def test_cancelling_a_group_split_across_batches_drops_its_rest_and_serves_the_others(
    settings, monkeypatch
) -> None:
    batches: list[int] = []
    started, release = threading.Event(), threading.Event()
    compute = batcher_module._compute

    def gated(parts, w):  # the first batch holds the compute thread until the test has cancelled
        batches.append(sum(p.shape[0] for p in parts))
        started.set()
        release.wait(5)
        return compute(parts, w)

    monkeypatch.setattr(batcher_module, "_compute", gated)
    host = ExpertHost(settings())
    batcher = DynamicBatcher(host.weights, max_batch_tokens=4, max_queue_delay_us=0)
    big, small = torch.randn(10, HIDDEN), torch.randn(3, HIDDEN)
    cancelled = asyncio.ensure_future(batcher.submit(0, 1, big))  # 10 rows: batches of 4, 4, 2
    assert await asyncio.to_thread(started.wait, 5)  # its first 4 rows are computing
    other = asyncio.ensure_future(batcher.submit(0, 1, small))
    await asyncio.sleep(0.02)
    cancelled.cancel()
    release.set()
    assert_close([await asyncio.wait_for(other, 5)], [expert_ffn(small, host.weights[(0, 1)])])
    assert cancelled.cancelled()
    assert batches == [4, 3]  # the cancelled group's other 6 rows were never computed
    queue = batcher._queues[(0, 1)]
    assert (queue.pending_tokens, len(queue.groups)) == (0, 0)
    again = torch.randn(
        5, HIDDEN
    )  # the queue's accounting is intact: a new group is split and served
    assert_close(
        [await asyncio.wait_for(batcher.submit(0, 1, again), 5)],
        [expert_ffn(again, host.weights[(0, 1)])],
    )
    assert batches[2:] == [4, 1]
    await batcher.close()
    await host.close()


async def test_batcher_fails_every_group_of_a_failing_batch_and_keeps_serving(settings) -> None:
    host = ExpertHost(settings())
    broken = FFNWeights(
        gate=torch.zeros(8, 3), up=torch.zeros(8, 3), down=torch.zeros(3, 8)
    )  # wrong width
    batcher = DynamicBatcher(
        {(0, 0): broken, (0, 1): host.weights[(0, 1)]}, max_queue_delay_us=50_000
    )
    rows = torch.randn(2, HIDDEN)
    results = await asyncio.wait_for(
        asyncio.gather(
            batcher.submit(0, 0, rows),
            batcher.submit(0, 0, rows),
            batcher.submit(0, 1, rows),
            return_exceptions=True,
        ),
        5,
    )
    assert [type(r) for r in results[:2]] == [RuntimeError, RuntimeError]
    assert_close([results[2]], [expert_ffn(rows, host.weights[(0, 1)])])
    assert (batcher.stats.groups, batcher.stats.batches) == (3, 1)
    assert_close(
        [await batcher.submit(0, 1, rows)], [results[2]]
    )  # the queue still works after a failure
    await batcher.close()
    await host.close()


async def test_closing_the_batcher_fails_queued_groups_instead_of_hanging(settings) -> None:
    host = ExpertHost(settings())
    batcher = DynamicBatcher(host.weights, max_queue_delay_us=10_000_000)
    queued = asyncio.ensure_future(batcher.submit(0, 1, torch.randn(2, HIDDEN)))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(batcher.close(), 5)
    with pytest.raises(UnavailableError):
        await queued
    with pytest.raises(UnavailableError):
        await batcher.submit(0, 1, torch.randn(2, HIDDEN))


# -- command line -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--experts", "0:9"], "experts: expert '9' in '0:9' is outside [0, 7]"),
        (["--experts", "nonsense"], "experts: item 'nonsense' is not LAYERS:EXPERTS"),
        (
            ["--max-batch-tokens", "0"],
            "--max-batch-tokens: Input should be greater than or equal to 1",
        ),
    ],
)
def test_cli_bad_configuration_exits_2_with_one_line(checkpoint, capsys, args, message) -> None:
    assert cli.main(["--checkpoint", str(checkpoint(ARCH)), *args]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("moe-mesh serve-expert: error: ") and message in err and err.count("\n") == 1
    ), err


def test_cli_broken_checkpoint_exits_2_naming_the_file(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("moe-mesh serve-expert: error: ")
        and "config.json" in err
        and err.count("\n") == 1
    ), err


async def _wait_for_ready(
    path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 60
) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}: {log.read_text()}"
        assert loop.time() < deadline, f"not ready after {timeout_s}s: {log.read_text()}"
        await asyncio.sleep(0.05)
    return json.loads(path.read_text())


async def test_subprocess_serves_then_drains_an_in_flight_call_on_sigterm(
    checkpoint, tmp_path
) -> None:
    path, ready, log = checkpoint(ARCH), tmp_path / "ready.json", tmp_path / "expert.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moe_mesh.expert_service",
                "--checkpoint",
                str(path),
                "--experts",
                "0:0-3",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--max-queue-delay-us",
                "1500000",
                "--ready-file",
                str(ready),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        info = await _wait_for_ready(ready, proc, log)
        assert info["pid"] == proc.pid and info["address"].startswith("127.0.0.1:")
        async with connect(info["address"]) as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            described = await stub.Describe(expert_pb2.DescribeRequest(), timeout=10)
            assert described.model_id == path.name and [
                (k.layer, k.expert) for k in described.experts
            ] == [(0, 0), (0, 1), (0, 2), (0, 3)]
            group = [(2, torch.randn(3, HIDDEN))]
            request = expert_pb2.ExpertForwardRequest(
                model_id=described.model_id,
                weights_checksum=described.weights_checksum,
                layer=0,
                expert_ids=[2],
                token_counts=[3],
                hidden=encode(group[0][1]),
            )
            in_flight = asyncio.ensure_future(stub.Forward(request, timeout=20))
            queued = False
            for _ in range(
                200
            ):  # queued once the batcher counted its group (it then waits 1.5 s for company)
                queued = (
                    await stub.Describe(expert_pb2.DescribeRequest(), timeout=5)
                ).stats.groups == 1
                if queued:
                    break
                await asyncio.sleep(0.01)
            assert queued and not in_flight.done()
            proc.send_signal(signal.SIGTERM)
            response = await in_flight
        assert_close(decode_output(response, [3]), reference(path, 0, group))
        assert await asyncio.to_thread(proc.wait, 15) == 0
        assert '"event": "stopping"' in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
