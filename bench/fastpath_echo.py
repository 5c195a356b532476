"""Round trip of one fast-path call vs one gRPC unary call, between two processes, no model:
a FrameServer (or a gRPC server) whose handler returns its input, called in turn at each size.

    .venv/bin/python -m bench.fastpath_echo [--sizes 8192 131072 1048576] [--calls 300] [--gap-ms 0]

Prints p50/p99 per size and transport, and the server's CPU over 2 s idle (after the calls).
With --gap-ms both ends are idle between calls, as a decode step's expert calls find them: a
message then wakes its receiver, which may preempt the sender part-way (fastpath/ucx.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path  # noqa: E402

import grpc
import torch
import uvloop
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings  # noqa: E402
from common.fastpath import parse_worker_url
from common.fastpath.client import FrameClient
from common.fastpath.frame import RequestHeader
from common.fastpath.server import FrameServer

LIMIT = 64 << 20
_ECHO = "/bench.Echo/Echo"


async def serve() -> None:
    async def echo(header: RequestHeader, payload: torch.Tensor | None) -> torch.Tensor:
        return payload

    fast = FrameServer(echo, LIMIT)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", LIMIT),
            ("grpc.max_send_message_length", LIMIT),
        ]
    )

    async def unary(request: bytes, context) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(unary)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(await fast.start(), port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
    await fast.stop()
    await server.stop(0)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(args: argparse.Namespace) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fastpath_echo", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url, port = proc.stdout.readline().split()
        client = FrameClient(parse_worker_url(url), LIMIT)
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_receive_message_length", LIMIT),
                ("grpc.max_send_message_length", LIMIT),
            ],
        )
        echo = channel.unary_unary(_ECHO)
        for size in args.sizes:
            x = torch.randn(size // 4 // 64, 64)
            header = RequestHeader("m", "c", 0, [0], [x.shape[0]], "float32", list(x.shape), size)
            data = x.numpy().tobytes()
            times: dict[str, list[float]] = {"ucx": [], "grpc": []}
            for i in range(args.calls + 10):
                if args.gap_ms:
                    await asyncio.sleep(args.gap_ms / 1e3)
                t = time.perf_counter()
                out, _ = await client.call(header, x, 5.0)
                if i >= 10:
                    times["ucx"].append(time.perf_counter() - t)
                if args.gap_ms:
                    await asyncio.sleep(args.gap_ms / 1e3)
                t = time.perf_counter()
                await echo(data)
                if i >= 10:
                    times["grpc"].append(time.perf_counter() - t)
            assert torch.equal(out, x)
            for name, ts in times.items():
                ts.sort()
                print(
                    f"{size:>9} B {name:4}  p50 {statistics.median(ts) * 1e3:6.3f} ms  "
                    f"p99 {ts[int(len(ts) * 0.99)] * 1e3:6.3f} ms"
                )
        before = cpu_s(proc.pid)
        await asyncio.sleep(2.0)
        print(f"server idle CPU: {(cpu_s(proc.pid) - before) / 2.0 * 100:.1f}% of a core")
        client.close()
        await channel.close()
    finally:
        proc.stdin.close()
        proc.wait(10)


class Settings(ScriptSettings):
    out: Path = Field(Path("bench/results/fastpath_echo.json"), description="unused: it prints")
    serve: bool = Field(False, description="be the echo server")
    sizes: list[int] = Field([8192, 131072, 1048576], description="message bytes")
    calls: int = Field(300, ge=1, description="calls per size")
    gap_ms: float = Field(0.0, ge=0, description="idle time between calls")


if __name__ == "__main__":
    a = parse_settings(Settings, __doc__)
    uvloop.run(serve() if a.serve else main(a))  # as the services and routers run
