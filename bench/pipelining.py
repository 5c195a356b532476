"""Ping-pong micro-batches on the `small` preset (float32), in one run: decode tokens/s at batch 32
and 64 of the monolithic engine and of the all-remote mesh with m = 1, 2, 3, 4 and auto
micro-batches, over gRPC and over the UCX fast path, each as a ratio to monolithic (medians of
rounds that run every set-up once in turn).

The expert services are separate processes (one torch thread each) shared by every router; each
router runs in this process with its compute thread, like `moe-mesh serve-router`. Auto's steps
per m are printed with each run.

    .venv/bin/python -m bench.pipelining [--checkpoint DIR] [--services 4] [--batches 32 64]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Literal  # noqa: E402

from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings  # noqa: E402
from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP

from bench.mesh_dispatch import DEFAULT_CHECKPOINT, ROOT, decode_rate, run, transports  # noqa: E402
from common.checkpoint import Checkpoint  # noqa: E402
from common.fastpath.ucx import load_ucxx  # noqa: E402
from moe_mesh.local.processes import start_experts  # noqa: E402
from router_service.build import build_local_engine, build_router  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

SETTINGS = ("1", "2", "3", "4", "auto")


async def main_async(args: ScriptSettings) -> dict:
    spec = Checkpoint(args.checkpoint).spec
    per = spec.num_experts // args.services
    specs = [f"*:{i * per}-{(i + 1) * per - 1}" for i in range(args.services)]
    workdir = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    experts = start_experts(
        args.checkpoint, specs, workdir, "--compute-threads", str(args.expert_threads)
    )
    transports_ = {"grpc": "off"}
    if load_ucxx(loopback=True) is not None:
        transports_["ucx"] = "ucx"
    # Eleven routers live in this process: each KV cache sized for twice a sequence's 16 prompt
    # and new tokens (room for the previous run's cached prefixes, so no step waits for blocks),
    # not `auto`'s share of free memory (eleven of those swap the machine).
    longest = 2 * (16 + args.new_tokens)
    base = dict(checkpoint=args.checkpoint, max_num_seqs=max(args.batches), max_model_len=longest)
    routers = {}
    try:
        engines = {"monolithic": build_local_engine(RouterSettings(**base))}
        for transport, fast_path in transports_.items():
            for m in args.micro_batches:
                routers[f"{transport}_m{m}"] = parts = await build_router(
                    RouterSettings(
                        **base,
                        expert_endpoints=[e.address for e in experts],
                        fast_path=fast_path,
                        micro_batches=m,
                    )
                )
                engines[f"{transport}_m{m}"] = parts.engine
        # Rounds run every set-up once in turn, so this machine's drift hits them alike.
        runs = {b: {name: [] for name in engines} for b in args.batches}
        for r in range(args.rounds):
            for b in args.batches:
                for name, engine in engines.items():
                    before = Counter(engine.planner.steps_by_m)
                    runs[b][name].append(
                        await decode_rate(engine, b, args.new_tokens, spec.vocab_size)
                    )
                    used = dict(sorted((engine.planner.steps_by_m - before).items()))
                    print(
                        f"round {r + 1} batch {b:>2} {name:<11} {runs[b][name][-1]:7.1f} tok/s"
                        f"  steps by m {used}",
                        flush=True,
                    )
        for name, parts in routers.items():
            carried = transports(parts.remotes)
            if name.startswith("ucx") and (carried["fallbacks"] or not carried["ucx"]):
                raise SystemExit(f"{name} did not run over UCX alone: {carried}")
    finally:
        for parts in routers.values():
            for r in parts.remotes:
                await r.close()
            parts.engine.model.close()
        for e in experts:
            e.stop()
    rows = []
    for b, by_name in runs.items():
        mono = statistics.median(by_name["monolithic"])
        row = {"batch": b, "monolithic_tokens_per_s": mono}
        for name, rates in by_name.items():
            if name != "monolithic":
                row[f"{name}_tokens_per_s"] = statistics.median(rates)
                row[f"{name}_vs_monolithic"] = statistics.median(rates) / mono
        rows.append(row)
        print(
            f"batch {b}: monolithic {mono:.1f} tok/s; "
            + ", ".join(
                f"{k.removesuffix('_vs_monolithic')} {v:.2f}x"
                for k, v in row.items()
                if k.endswith("_vs_monolithic")
            ),
            flush=True,
        )
    return {
        "decode": rows,
        "steps_by_m": {n: dict(e.planner.steps_by_m) for n, e in engines.items()},
    }


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        DEFAULT_CHECKPOINT, description="checkpoint; the small Mixtral is created if missing"
    )
    out: Path = Field(ROOT / "bench/results/pipelining.json", description="the JSON result")
    services: int = Field(4, ge=1, description="expert services")
    expert_threads: int = Field(1, ge=1, description="torch threads per expert service")
    batches: list[int] = Field([32, 64], description="batch sizes")
    micro_batches: list[Literal["1", "2", "3", "4", "auto"]] = Field(
        list(SETTINGS), description="micro-batch settings compared"
    )
    rounds: int = Field(3, ge=1, description="median of this many rounds")
    new_tokens: int = Field(16, ge=1, description="tokens generated per run")


def main() -> int:
    return run(main_async, parse_settings(Settings, __doc__))


if __name__ == "__main__":
    sys.exit(main())
