"""Part f of bench/gpu_check.py: the GPU host's own CPU, a kind of host CPU sessions do not get
(the H200 lent so far sat on 16 cores of an AMX Xeon). Batch-1 decode of the Qwen3-30B-A3B slice
(part c's checkpoint) and of `small` in bfloat16 and with every layer in int8 and in int4, on
every core, by bench/quantized.py, which computes on the CPU; with the CPU's model, cores, L3
and flags. On that host 16 threads read memory 2-3x faster than 4 did, and the int8 ratio fell
below the 1.8x that 4 threads gave (docs/performance.md#host-d)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.gpu_speed import SLICES, make_slice
from bench.gpu_support import Context

GEOMETRIES = ("qwen3-30b-a3b-slice", "small")
PRECISIONS = "bfloat16,int8-all,int4-all"
FLAGS = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512vbmi", "avx2")


def cpu_facts() -> dict:
    """lscpu's model name and L3, the cores this process may use, and the flags that pick kernels."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())
    }
    flags = fields.get("Flags", "").split()
    return {
        "model": fields.get("Model name"),
        "cores": len(os.sched_getaffinity(0)),
        "l3": fields.get("L3 cache"),
        "flags": [f for f in FLAGS if f in flags],
    }


def rates(ctx: Context, name: str) -> dict:
    """bench/quantized.py's batch-1 rows for geometry `name`, its checkpoint under the scratch
    folder (part c's slice, or created here)."""
    path = make_slice(ctx, name, ctx.slice_layers)[0] if name in SLICES else ctx.work / name
    out = ctx.work / f"cpu-{name}.json"
    cmd = [sys.executable, "-m", "bench.quantized", "--geometry", name, "--checkpoint", str(path)]
    cmd += ["--batch-sizes", "1", "--precisions", PRECISIONS, "--repeats", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left_s() - 5, 1))
    if done.returncode:
        raise RuntimeError(f"bench.quantized exited {done.returncode}: {done.stderr[-400:]}")
    result = json.loads(out.read_text())
    keep = ("tokens_per_s", "vs_first", "bandwidth_share", "bytes_per_token")
    return {
        "read_bandwidth_gb_per_s": round(result["read_bandwidth_gb_per_s"], 1),
        "rows": {r["precision"]: {k: r[k] for k in keep} for r in result["rows"]},
    }


def host_cpu(ctx: Context) -> dict:
    """Part f: each geometry while time is left; one that fails is recorded and the next runs."""
    ctx.record("cpu", cpu_facts())
    heads = []
    for name in GEOMETRIES:
        if ctx.left_s() < 30:
            break
        try:
            row = rates(ctx, name)
        except Exception as e:
            ctx.record(name, {"error": f"{type(e).__name__}: {e}"[:600]})
            continue
        ctx.record(name, row)
        ratios = [f"{p} {r['vs_first']:.2f}x" for p, r in row["rows"].items() if p != "bfloat16"]
        heads.append(f"{name.split('-')[0]}: {', '.join(ratios)}")
    ctx.record("summary", "; ".join(heads) or "no rate measured")
    return ctx.result


def plan_host_cpu(ctx: Context) -> dict:
    return {"geometries": list(GEOMETRIES), "precisions": PRECISIONS, "cpu": cpu_facts()}
