"""Part f of bench/gpu_check.py: the GPU host's own CPU, a kind of host CPU sessions do not get
(the H200 lent so far sat on 16 cores of an AMX Xeon). Batch-1 decode of the Qwen3-30B-A3B slice
(part c's checkpoint) and of `small` (part d's where it made one) in bfloat16 and with every
layer in int8 and in int4, on every core and then the slice on 4, by bench/quantized.py, which
computes on the CPU; then where a token's time goes on every core, `small`'s and then the
slice's (bench/step_phases.py); with the CPU's model, cores, L3 and flags. There, int8 ran 1.98x
bfloat16 on 4 threads and 1.72-1.74x on 16 until stop 69 had the step's threads prepare what
they wrote (2.03-2.14x; docs/performance.md, #host-d-stop-69): each lease adds runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_speed import SLICES, make_slice
from bench.gpu_support import Context

GEOMETRIES = ("qwen3-30b-a3b-slice", "small")
FEW = 4  # threads of the comparison run
SMALL = "small-mixtral"  # where part d makes `small` when part c made no slice
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


def checkpoint(ctx: Context, name: str) -> Path:
    """Geometry `name`'s checkpoint under the scratch folder: part c's slice (made where no part
    made it), or `small` where part d made it (else the bench that reads it creates it)."""
    return make_slice(ctx, name, ctx.slice_layers)[0] if name in SLICES else ctx.work / SMALL


def rates(ctx: Context, name: str, threads: int) -> dict:
    """bench/quantized.py's batch-1 rows for geometry `name` on `threads` threads, its checkpoint
    under the scratch folder (created where no part made it). Past the time left, the rows it
    printed."""
    path = checkpoint(ctx, name)
    flags = ["--batch-sizes", "1", "--precisions", PRECISIONS, "--repeats", "5"]
    flags += ["--new-tokens", "64"]  # a 16-thread int4 token is ~1.5 ms: time more of them
    try:
        result = child(ctx, "bench.quantized", name, path, threads, flags)
    except subprocess.TimeoutExpired as e:
        printed = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"timed_out": True, "printed": [x for x in printed.splitlines() if "batch" in x]}
    keep = ("tokens_per_s", "vs_first", "bandwidth_share", "bytes_per_token")
    return {
        "read_bandwidth_gb_per_s": round(result["read_bandwidth_gb_per_s"], 1),
        "rows": {r["precision"]: {k: r[k] for k in keep} for r in result["rows"]},
    }


def runs(cores: int) -> list[tuple[str, int]]:
    """(geometry, threads) in order: each geometry on every core, then the Qwen3 slice on 4
    threads where there are more (host D's ratios differed between 4 and 16, in different runs)."""
    out = [(name, cores) for name in GEOMETRIES]
    return out + [(GEOMETRIES[0], FEW)] if cores > FEW else out


def host_cpu(ctx: Context) -> dict:
    """Part f: each run while time is left; one that fails is recorded and the next runs."""
    facts = cpu_facts()
    ctx.record("cpu", facts)
    heads = []
    for name, threads in runs(facts["cores"]):
        if ctx.left_s() < 30:
            break
        key = f"{name}, {threads} threads"
        try:
            row = rates(ctx, name, threads)
        except Exception as e:
            ctx.record(key, {"error": f"{type(e).__name__}: {e}"[:600]})
            continue
        ctx.record(key, row)
        if "rows" in row:
            ratios = [
                f"{p} {r['vs_first']:.2f}x" for p, r in row["rows"].items() if p != "bfloat16"
            ]
            heads.append(f"{name.split('-')[0]} x{threads}: {', '.join(ratios)}")
    ctx.record("phases", phases(ctx, facts["cores"]))
    ctx.record("summary", "; ".join(heads) or "no rate measured")
    ctx.record("ok", bool(heads))
    return ctx.result


def phases(ctx: Context, threads: int) -> dict:
    """bench/step_phases.py on every core, `small` first (host D's short geometry since stop 69),
    then the slice, while time is left: where a token's time goes, per precision (microseconds:
    the products, the work between them, the decode's wall time)."""
    out: dict = {}
    for name in reversed(GEOMETRIES):
        if ctx.left_s() < 40:
            break
        try:
            result = child(ctx, "bench.step_phases", name, checkpoint(ctx, name), threads, [])
            out[name] = {"threads": threads, "rows": result["rows"]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
    return out


def child(
    ctx: Context, module: str, geometry: str, path: Path, threads: int, flags: list[str]
) -> dict:
    """`python -m module` at the geometry's checkpoint `path` on `threads` threads, within the
    time left: the JSON it wrote. Its exit status not 0 raises, with its stderr's end."""
    out = ctx.work / f"cpu-{module.removeprefix('bench.')}-{geometry}-{threads}.json"
    cmd = [sys.executable, "-m", module, "--geometry", geometry, "--checkpoint", str(path)]
    cmd += ["--threads", str(threads), "--out", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left_s() - 5, 1))
    if done.returncode:
        raise RuntimeError(f"{module} exited {done.returncode}: {done.stderr[-400:]}")
    return json.loads(out.read_text())


def plan_host_cpu(ctx: Context) -> dict:
    facts = cpu_facts()
    return {"runs": runs(facts["cores"]), "precisions": PRECISIONS, "cpu": facts}
