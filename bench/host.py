"""What this host's cores give a mesh of processes, recorded with the mesh benches' results.

A mesh on one host can only beat the monolithic engine by computing in several processes at
once. Some virtual machines list two cores that run two busy processes at well under twice the
speed of one (measured on one: pure Python 1.2x, a GEMM 1.6x), and expert FFNs at small batch
are bound by memory reads, which the cores share. So every mesh ratio is read next to these:

- `speedup`: throughput of one busy process per core, all at once, over one process alone, for
  a Python loop, a float32 GEMM (one torch thread) and a read of a buffer larger than the cache;
- `read_gb_per_s`: that read's bandwidth from one process alone.

The benches measure it before and after their run (`around`).

    .venv/bin/python -m bench.host   (from the checkout root; writes bench/results/host.json)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import host_cpu

ROOT = Path(__file__).resolve().parent.parent
READ_BYTES = 256 << 20
REPEATS = {"python": 100, "gemm": 100, "read": 10}  # ~0.5 s each alone on the host above


_start: Any = None  # a worker's barrier: the workers of one measurement start together


def _init(start: Any) -> None:
    global _start
    _start = start


def _work(kind: str, repeats: int, together: bool = False) -> float:
    """Seconds for `repeats` units of `kind`, in this (worker) process."""
    import torch

    torch.set_num_threads(1)
    if kind == "gemm":
        a = torch.randn(512, 512)
        a @ a  # first call: kernel selection
    elif kind == "read":
        a = torch.ones(READ_BYTES // 4)
        a.sum()  # pages touched before timing
    if together:
        _start.wait(timeout=60)
    start = time.perf_counter()
    for _ in range(repeats):
        if kind == "python":
            sum(range(200_000))
        elif kind == "gemm":
            a @ a
        else:
            a.sum()
    return time.perf_counter() - start


def host_facts() -> dict:
    """CPU model and core count, and the speedups and bandwidth above (a few seconds)."""
    workers = os.cpu_count() or 1
    facts: dict = {"cpu": host_cpu()["cpu"], "cores": workers, "speedup": {}}
    # spawn: fork after torch loaded OpenMP in the caller would hang the workers
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, _init, (spawn.Barrier(workers),)) as pool:
        for kind, repeats in REPEATS.items():
            alone = pool.apply(_work, (kind, repeats))
            together = pool.starmap(_work, [(kind, repeats, True)] * workers)
            facts["speedup"][kind] = round(workers * alone / max(together), 2)
            if kind == "read":
                facts["read_gb_per_s"] = round(repeats * READ_BYTES / alone / 1e9, 2)
    return facts


def around(run: Callable[[], dict]) -> dict:
    """`run()`'s result with `host_facts` from before it (the cores to themselves) and after it:
    a run whose host changed speed in between is one to repeat."""
    before = host_facts()
    print(f"host before: {before}", flush=True)
    result = run()
    after = host_facts()
    print(f"host after: {after}", flush=True)
    return {**result, "host": {"before": before, "after": after}}


def main() -> int:
    from pydantic import Field

    from bench import ScriptSettings, parse_settings, write_result

    class Settings(ScriptSettings):
        out: Path = Field(ROOT / "bench/results/host.json", description="the JSON result")

    args = parse_settings(Settings, __doc__, skip=("checkpoint",))  # it runs no model
    facts = host_facts()
    print(json.dumps(facts, indent=2))
    write_result(args.out, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
