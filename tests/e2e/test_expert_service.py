"""An expert-service process: serves, logs at INFO, then drains an in-flight call on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import torch

from common.wire import encode
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc
from tests.support.experts import ARCH, HIDDEN, assert_close, connect, decode_output, reference


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
                "expert_service",
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
        text = log.read_text()
        assert '"event": "stopping"' in text
        # It logs at INFO as the router does: what its load chose (here, at least the kernels).
        assert " expert INFO " in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
