"""What security costs, in one run on the `small` preset: decode tokens/s through the gateway of a
mesh under `moe-mesh up --tls` (mutual TLS on every gRPC hop, authenticated fast-path hellos, TLS
and an API key at the edge) against the same mesh in plaintext, at batch 1 and 32, over the
UCX fast path and over gRPC alone (where TLS encrypts every activation).

Both meshes run side by side and take turns (rounds of every set-up once), so this machine's
drift hits them alike; each is `moe-mesh up` as a user starts it, driven by concurrent gRPC
streams with EOS ignored. The rate counts tokens after each stream's first (decode only).

    .venv/bin/python -m bench.tls_overhead [--checkpoint DIR] [--batches 1 32] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal  # noqa: E402

from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings  # noqa: E402
from common.tls import open_channel
from moe_mesh.benchmark.setups import Setup, started
from moe_mesh.ops.client import mesh_tls
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc

KEY = "sk-bench-tls-0123456789"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = ROOT / ".cache/bench-small-mixtral"  # bench.mesh_dispatch's


def setup(name: str, tls: bool, fast_path: str, keys: Path) -> Setup:
    args = ["--router-arg", f"--fast-path {fast_path} --max-num-seqs 64"]
    return Setup(name, tuple(args + (["--tls", "--api-key-file", str(keys)] if tls else [])))


async def decode_rate(mesh: dict, batch: int, new_tokens: int) -> float:
    tls = mesh_tls(mesh)
    metadata = (("authorization", f"Bearer {KEY}"),) if tls else ()
    async with open_channel(mesh["gateway_grpc"], [], tls=tls) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> tuple[float, float, int]:
            request = inference_pb2.GenerateRequest(
                prompt_token_ids=[(i * 37 + j * 11) % 500 + 5 for j in range(16)],
                max_tokens=new_tokens,
                temperature=0.0,
                ignore_eos=True,
            )
            first = last = 0.0
            tokens = 0
            async for m in stub.GenerateStream(request, metadata=metadata, timeout=600):
                now = time.perf_counter()
                if not tokens and m.token_ids:
                    first = now
                tokens += len(m.token_ids)
                last = now
            return first, last, tokens

        await one(0)  # warm: channels, fast-path hellos, the first prefill
        streams = await asyncio.gather(*(one(i) for i in range(batch)))
    decoded = sum(t - 1 for _, _, t in streams)
    return decoded / (max(s[1] for s in streams) - min(s[0] for s in streams))


async def measure(meshes: dict[str, dict], args: ScriptSettings) -> dict:
    runs: dict[int, dict[str, list[float]]] = {b: {n: [] for n in meshes} for b in args.batches}
    for r in range(args.rounds):
        for b in args.batches:
            for name, mesh in meshes.items():
                rate = await decode_rate(mesh, b, args.new_tokens)
                runs[b][name].append(rate)
                print(f"round {r + 1} batch {b:>2} {name:<10} {rate:7.1f} tok/s", flush=True)
    rows = []
    for b, by_name in runs.items():
        row: dict = {"batch": b}
        for name, rates in by_name.items():
            row[f"{name}_tokens_per_s"] = statistics.median(rates)
        for transport in args.transports:
            ratio = row[f"{transport}-tls_tokens_per_s"] / row[f"{transport}-plain_tokens_per_s"]
            row[f"{transport}_tls_vs_plaintext"] = ratio
            print(f"batch {b}: {transport} TLS / plaintext = {ratio:.3f}", flush=True)
        rows.append(row)
    return {"decode": rows}


class Settings(ScriptSettings):
    out: Path = Field(ROOT / "bench/results/tls_overhead.json", description="the JSON result")
    batches: list[int] = Field([1, 32], description="concurrent requests")
    transports: list[Literal["ucx", "grpc"]] = Field(
        ["ucx", "grpc"], description="expert transports"
    )
    rounds: int = Field(3, ge=1, description="median of this many rounds")
    new_tokens: int = Field(32, ge=1, description="tokens generated per request")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    ensure_checkpoint(args.checkpoint)
    workdir = Path(tempfile.mkdtemp(prefix="moe-bench-tls-"))
    (workdir / "keys").write_text(f"{KEY}\n")
    meshes = {}
    with contextlib.ExitStack() as stack:
        for transport in args.transports:
            fast_path = "ucx" if transport == "ucx" else "off"
            for tls in (False, True):
                name = f"{transport}-{'tls' if tls else 'plain'}"
                # One at a time (start-ups would fight for the cores), then all up side by side.
                ready = stack.enter_context(
                    started(setup(name, tls, fast_path, workdir / "keys"), args.checkpoint, workdir)
                )
                meshes[name] = json.loads(ready.read_text())
        result = asyncio.run(measure(meshes, args))
    result.update(checkpoint=str(args.checkpoint), cpus=os.cpu_count(), new_tokens=args.new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
