"""Ping-pong micro-batches on the `small` preset (float32), in one run: decode tokens/s at batch 32
and 64 of the monolithic engine and of the all-remote mesh with m = 1, 2, 3, 4 and auto
micro-batches, over gRPC and over the UCX fast path, each as a ratio to monolithic.

The expert services are separate processes (one torch thread each) shared by every router; each
router runs in this process with its compute thread, like `moe-mesh serve-router`.

    .venv/bin/python -m bench.pipelining [--checkpoint DIR] [--services 4] [--batches 32 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from moe_mesh.common import runtime

runtime.configure()  # before torch loads OpenMP
import torch  # noqa: E402

from bench.mesh_dispatch import DEFAULT_CHECKPOINT, ROOT, decode_rate, transports  # noqa: E402
from moe_mesh.common.checkpoint import Checkpoint  # noqa: E402
from moe_mesh.common.fastpath.ucx import load_ucxx  # noqa: E402
from moe_mesh.dev.create_checkpoint import create_checkpoint  # noqa: E402
from moe_mesh.router_service.build import build_local_engine, build_router  # noqa: E402
from moe_mesh.router_service.settings import RouterSettings  # noqa: E402
from tests.support.processes import start_experts  # noqa: E402

SETTINGS = ("1", "2", "3", "4", "auto")


async def rate(engine, batch: int, args, vocab: int) -> float:
    runs = [await decode_rate(engine, batch, args.new_tokens, vocab) for _ in range(args.repeats)]
    return statistics.median(runs)


async def main_async(args: argparse.Namespace) -> dict:
    spec = Checkpoint(args.checkpoint).spec
    per = spec.num_experts // args.services
    specs = [f"*:{i * per}-{(i + 1) * per - 1}" for i in range(args.services)]
    workdir = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    experts = start_experts(
        args.checkpoint, specs, workdir, "--compute-threads", str(args.expert_threads)
    )
    fast_paths = ["off"] + (["ucx"] if load_ucxx(loopback=True) is not None else [])
    base = dict(checkpoint=args.checkpoint, max_num_seqs=max(args.batches))
    rows = []
    try:
        local = build_local_engine(RouterSettings(**base))
        for batch in args.batches:
            mono = await rate(local, batch, args, spec.vocab_size)
            row = {"batch": batch, "monolithic_tokens_per_s": mono}
            print(f"batch {batch}: monolithic {mono:.1f} tok/s", flush=True)
            for fast_path in fast_paths:
                transport = "grpc" if fast_path == "off" else "ucx"
                for m in SETTINGS:
                    parts = await build_router(
                        RouterSettings(
                            **base,
                            expert_endpoints=[e.address for e in experts],
                            fast_path=fast_path,
                            micro_batches=m,
                        )
                    )
                    try:
                        tokens_per_s = await rate(parts.engine, batch, args, spec.vocab_size)
                        used = dict(sorted(parts.engine.planner.steps_by_m.items()))
                        carried = transports(parts.remotes)
                    finally:
                        for r in parts.remotes:
                            await r.close()
                        parts.engine.model.close()
                    if transport == "ucx" and (carried["fallbacks"] or not carried["ucx"]):
                        raise SystemExit(f"the UCX mesh did not run over UCX alone: {carried}")
                    key = f"{transport}_m{m}"
                    row[f"{key}_tokens_per_s"] = tokens_per_s
                    row[f"{key}_vs_monolithic"] = tokens_per_s / mono
                    if m == "auto":
                        row[f"{key}_steps_by_m"] = used
                    print(
                        f"  all-remote {transport} m={m}{f' (steps by m: {used})' if m == 'auto' else ''}: "
                        f"{tokens_per_s:.1f} tok/s = {tokens_per_s / mono:.2f}x monolithic",
                        flush=True,
                    )
            rows.append(row)
    finally:
        for e in experts:
            e.stop()
    return {"decode": rows}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--services", type=int, default=4)
    parser.add_argument("--expert-threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/pipelining.json")
    args = parser.parse_args()
    if not (args.checkpoint / "config.json").exists():
        create_checkpoint(args.checkpoint, "mixtral", "small", seed=0, progress=True)
    result = asyncio.run(main_async(args))
    result.update(
        checkpoint=str(args.checkpoint),
        services=args.services,
        expert_threads=args.expert_threads,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
