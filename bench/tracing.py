"""What tracing costs: decode throughput of the same router with tracing off, sampling 1% (the
default) and sampling 100%, in one run against the same expert services.

Each router runs in this process behind its real gRPC server with every expert remote; expert
services write spans of sampled requests to files, as in a deployment. Rounds alternate the three
routers so drift in this machine's speed hits them alike; medians and the ratio to "off" go to
bench/results/tracing.json.

    .venv/bin/python -m bench.tracing [--checkpoint DIR] [--concurrency 8] [--rounds 5]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings  # noqa: E402
from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP

ROOT = Path(__file__).resolve().parent.parent

import grpc  # noqa: E402

from common.telemetry import Telemetry  # noqa: E402
from moe_mesh.dev.create_checkpoint import create_checkpoint  # noqa: E402
from moe_mesh.local.processes import start_experts  # noqa: E402
from protos.moe_mesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from router_service.app import RouterApp  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

SAMPLING = {"off": None, "sample_1pct": 0.01, "sample_100pct": 1.0}


async def load(address: str, concurrency: int, new_tokens: int, seed: int) -> float:
    """`concurrency` requests at once through the router's gRPC API; generated tokens per second."""
    params = router_pb2.SamplingParams(
        max_tokens=new_tokens, temperature=0.0, top_p=1.0, ignore_eos=True
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)

        async def one(i: int) -> int:
            prompt = [(seed * 7919 + i * 104729 + j * 31) % 8000 + 3 for j in range(16)]
            n = 0
            async for msg in stub.Generate(
                router_pb2.RouterGenerateRequest(prompt_token_ids=prompt, params=params)
            ):
                n += len(msg.token_ids)
            return n

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
        return tokens / (time.perf_counter() - start)


async def main_async(args: ScriptSettings, workdir: Path) -> dict:
    experts = start_experts(
        args.checkpoint,
        ["*:0-1", "*:2-3", "*:4-5", "*:6-7"],
        workdir,
        "--compute-threads",
        "1",
        "--trace-sample",
        "1.0",
        "--trace-file",
        str(workdir / "experts.spans.jsonl"),
    )
    endpoints = [e.address for e in experts]
    routers: dict[str, RouterApp] = {}
    try:
        for name, sample in SAMPLING.items():
            telemetry = Telemetry.create(
                f"router-{name}",
                sample=sample,
                metrics_port=0,
                trace_file=workdir / f"{name}.spans.jsonl" if sample else None,
            )
            routers[name] = await RouterApp.create(
                RouterSettings(checkpoint=args.checkpoint, expert_endpoints=endpoints), telemetry
            )
            await routers[name].start()
        addresses = {name: app.server.address for name, app in routers.items()}
        print("==> warm-up", flush=True)
        for address in addresses.values():
            await load(address, args.concurrency, 4, seed=0)
        runs: dict[str, list[float]] = {name: [] for name in routers}
        for r in range(args.rounds):
            for name, address in addresses.items():
                runs[name].append(
                    await load(address, args.concurrency, args.new_tokens, seed=r + 1)
                )
                print(f"round {r + 1} {name:<14} {runs[name][-1]:7.1f} tok/s", flush=True)
    finally:
        for app in routers.values():
            await app.stop()  # flushes their span files
        for e in experts:
            e.stop()
    spans = {
        name: sum(1 for _ in open(workdir / f"{name}.spans.jsonl")) if SAMPLING[name] else 0
        for name in runs
    }
    base = statistics.median(runs["off"])
    summary = {
        name: {
            "tokens_per_s": statistics.median(xs),
            "vs_off": statistics.median(xs) / base,
            "router_spans_written": spans[name],
        }
        for name, xs in runs.items()
    }
    return {
        "checkpoint": str(args.checkpoint),
        "concurrency": args.concurrency,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "summary": summary,
        "runs": runs,
    }


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        ROOT / ".cache/bench-small-mixtral", description="checkpoint (created if missing)"
    )
    out: Path = Field(ROOT / "bench/results/tracing.json", description="the JSON result")
    concurrency: int = Field(8, ge=1, description="requests in flight per round")
    new_tokens: int = Field(24, ge=1, description="tokens generated per request")
    rounds: int = Field(5, ge=1, description="alternating rounds")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    if not (args.checkpoint / "config.json").exists():
        print(f"==> creating {args.checkpoint} (small preset)", flush=True)
        create_checkpoint(args.checkpoint, "mixtral", "small", progress=True)
    with tempfile.TemporaryDirectory(prefix="moe-bench-tracing-") as workdir:
        result = asyncio.run(main_async(args, Path(workdir)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for name, s in result["summary"].items():
        print(
            f"{name:<14} {s['tokens_per_s']:7.1f} tok/s  {s['vs_off']:.3f}x off  "
            f"({s['router_spans_written']} router spans written)"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
