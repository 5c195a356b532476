"""Resident memory of expert services against the weights they hold, in one run:

0. (`--products`, on by default) what the float32 layout the services hold costs in speed: products
   of 1-64 rows over 64 MiB of weights as stored against oneDNN's layout, GB/s of each;
1. the import floor: a child process that imports what a service imports (torch, gRPC, the
   service's modules, ucxx unless the fast path is off) and holds no weights, its RSS;
2. one expert service per `--specs` (default one expert, then every expert), and two replicas of
   one group (`--replica-spec`), all started together and waited for; each is then sent one
   Forward call per layer it serves, over every expert it holds, so every weight is touched;
3. for each: weight bytes, peak RSS (VmHWM), RSS, PSS (/proc/PID/smaps_rollup) and the PSS of
   its mappings of the checkpoint's files and packed-weight cache files, and the peak's margin over weights + floor (target:
   at most 100 MiB). For the replicas: how many copies of their weights their PSS holds (target 1:
   the page-cache pages of the checkpoint's files and of the packed-weight cache files, which
   PSS splits between the processes mapping them).

    .venv/bin/python -m bench.memory [--checkpoint DIR] [--dtype auto] [--prepack auto]

(from the checkout root). `--prepack off` (MOE_MESH_PREPACK for the services) keeps every weight
in the file's layout. By default an expert service needs batch-invariant products
(common/linear.py). float32 weights are read as stored by moe-mesh's kernel (views of the file,
whose pages every service shares; `--prepack on`: oneDNN's layout); bfloat16 ones are held
in moe-mesh's panels, packed once into cache files that every service maps (common/packcache.py;
MOE_MESH_PACK_CACHE=off: a copy each); otherwise oneDNN's layout, a copy per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from common import runtime

runtime.configure(shares_cores=True)  # several services on this host: before torch loads OpenMP
import grpc  # noqa: E402
import torch  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings, write_result  # noqa: E402
from common import packcache  # noqa: E402
from common.arch import checkpoint_spec  # noqa: E402
from common.placement import parse_experts  # noqa: E402
from common.quant import Quantization  # noqa: E402
from common.server import channel_options  # noqa: E402
from common.wire import FROM_WIRE, encode  # noqa: E402
from moe_mesh.local.processes import ServiceProcess, start_experts, stop_all  # noqa: E402
from protos.moe_mesh.v1 import expert_pb2, expert_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
MARGIN_MIB = 100  # the target: peak RSS <= weights + import floor + this
QUANTIZED_MARGIN_MIB = 150  # with int4 experts (issue 41): weights are their int4 bytes and scales

# What `python -m expert_service` imports before it loads weights (expert_service/cli.py), and
# ucxx as its fast path does (common/fastpath/ucx.py): the floor every service pays.
FLOOR = r"""
import json, sys
from common import runtime
runtime.configure(shares_cores=True)
import uvloop, torch
from common.server import serve_app
from expert_service.app import ExpertApp
if sys.argv[1] != "off":
    from common.fastpath.ucx import load_ucxx
    load_ucxx(loopback=True)
print(json.dumps({"modules": len(sys.modules), "status": open("/proc/self/status").read()}))
"""


def status_kib(text: str) -> dict[str, int]:
    """The kB fields of a /proc status or smaps_rollup text, e.g. {"VmHWM": 301234, "Pss": ...}."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key.strip()] = int(parts[0])
    return out


def checkpoint_pss_kib(pid: int, checkpoint: Path) -> int:
    """PSS of the process's mappings of the checkpoint's files and of its packed-weight cache
    files (common/packcache.py): its weights used as stored or as packed once for the host."""
    roots, total, inside = (
        (str(checkpoint.resolve()), str(packcache.directory(checkpoint))),
        0,
        False,
    )
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(".safetensors") and any(r in line for r in roots)
        elif inside and first == "Pss:":
            total += int(line.split()[1])
    return total


def memory(pid: int, checkpoint: Path) -> dict[str, float]:
    """Peak RSS, RSS, PSS (anonymous and of the checkpoint's pages) of a process, in MiB."""
    status = status_kib(Path(f"/proc/{pid}/status").read_text())
    rollup = status_kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
    return {
        "peak_rss_mib": status["VmHWM"] / 1024,
        "rss_mib": status["VmRSS"] / 1024,
        "pss_mib": rollup["Pss"] / 1024,
        "pss_anon_mib": rollup.get("Pss_Anon", 0) / 1024,
        "pss_checkpoint_mib": checkpoint_pss_kib(pid, checkpoint) / 1024,
    }


def import_floor(fast_path: str) -> dict:
    """RSS of a fresh process that imported what a service imports (FLOOR), and its module count."""
    env = runtime.shared_cores_env(dict(os.environ))
    out = subprocess.run(
        [sys.executable, "-c", FLOOR, fast_path],
        check=True, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    status = status_kib(reply["status"])
    return {
        "rss_mib": status["VmRSS"] / 1024,
        "peak_rss_mib": status["VmHWM"] / 1024,
        "anon_mib": status.get("RssAnon", 0) / 1024,
        "modules": reply["modules"],
    }


def touch(address: str) -> tuple[str, int]:
    """One Forward call per layer the service serves, one token for each of its experts there, so
    every weight it holds is read; its dtype and how many experts it holds."""
    with grpc.insecure_channel(address, options=channel_options(256 * MIB)) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        d = stub.Describe(expert_pb2.DescribeRequest(), timeout=30)
        dtype = FROM_WIRE[d.dtype]
        layers: dict[int, list[int]] = {}
        for key in d.experts:
            layers.setdefault(key.layer, []).append(key.expert)
        for layer, experts in sorted(layers.items()):
            hidden = torch.randn(len(experts), d.hidden_size).to(dtype)  # [experts, hidden]
            stub.Forward(
                expert_pb2.ExpertForwardRequest(
                    model_id=d.model_id, weights_checksum=d.weights_checksum, layer=layer,
                    expert_ids=experts, token_counts=[1] * len(experts), hidden=encode(hidden),
                ),
                timeout=120,
            )  # fmt: skip
    return str(dtype).removeprefix("torch."), len(d.experts)


def row(
    proc: ServiceProcess, spec: str, touched: tuple[str, int], args: Settings, floor: dict
) -> dict:
    """One service's memory next to its weights and the floor, once every service's calls have
    touched every weight: PSS splits a page between the processes mapping it at that moment."""
    dtype, count = touched
    weights = count * expert_bytes(args, dtype) / MIB
    m = memory(proc.proc.pid, args.checkpoint)
    margin = m["peak_rss_mib"] - weights - floor["rss_mib"]
    print(
        f"{spec:>10} {dtype}: weights {weights:6.0f} MiB, peak RSS {m['peak_rss_mib']:6.0f}, "
        f"RSS {m['rss_mib']:6.0f}, PSS {m['pss_mib']:6.0f} (mapped weight pages "
        f"{m['pss_checkpoint_mib']:.0f}), peak - weights - floor {margin:+.0f} MiB",
        flush=True,
    )
    return {"experts": spec, "dtype": dtype, "weights_mib": weights, **m, "margin_mib": margin}


def expert_bytes(args: Settings, dtype: str) -> int:
    """One expert's weights as a service holds them: gate, up and down at the dtype, or
    quantized (data and scales)."""
    model = checkpoint_spec(args.checkpoint)
    h, i = model.hidden_size, model.expert_intermediate_size
    if (q := Quantization.parse(args.quantize, args.quantize_group_size)) is None:
        return 3 * h * i * getattr(torch, dtype).itemsize
    return sum(n * t.itemsize for s in ((2 * i, h), (h, i)) for n, t in q.layout(s).values())


def replicas(rows: list[dict], floor: dict) -> dict:
    """How many copies of the group's weights two replicas' PSS holds: their checkpoint pages
    plus their anonymous memory above the floor's, over one copy's bytes."""
    weights = rows[0]["weights_mib"]
    held = sum(r["pss_checkpoint_mib"] + r["pss_anon_mib"] - floor["anon_mib"] for r in rows)
    copies = held / weights
    print(f"two replicas of {rows[0]['experts']}: {copies:.2f} copies of the weights in their PSS")
    return {"experts": rows[0]["experts"], "weight_copies_in_pss": copies, "rows": rows}


def everyone(rows: list[dict], specs: list[str], args: Settings, floor: dict) -> dict:
    """Copies of the distinct weights that every service started holds between them (their
    specs overlap: one copy a host is 1.0, one a process the sum of their weights over this)."""
    model = checkpoint_spec(args.checkpoint)
    pairs = set().union(*(parse_experts(spec, model) for spec in specs))
    distinct = len(pairs) * expert_bytes(args, rows[0]["dtype"]) / MIB
    held = sum(r["pss_checkpoint_mib"] + r["pss_anon_mib"] - floor["anon_mib"] for r in rows)
    print(
        f"all {len(rows)} services: {held / distinct:.2f} copies of their distinct weights in PSS"
    )
    return {"distinct_weights_mib": distinct, "weight_copies_in_pss": held / distinct}


def products(working_set: int = 64 << 20, shape: tuple[int, int] = (2048, 1024)) -> dict | None:
    """What the float32 layout an expert service holds costs in speed: products of 1-64 rows over
    `working_set` bytes of weights as stored (common/float32_rows.py) against the same weights in
    oneDNN's layout, each the best of 5 passes; GB/s of weights read. None where either is
    missing here."""
    from common import bf16
    from common.float32_rows import Rows
    from common.linear import _can_pack, _pack, _packed_linear

    if bf16.kernel("moe_f32_linear") is None or not _can_pack(torch.float32):
        return None
    weights = [torch.randn(shape) * 0.02 for _ in range(working_set // (shape[0] * shape[1] * 4))]
    layouts = {"as stored": [Rows(w) for w in weights], "oneDNN": [_pack(w) for w in weights]}
    call = {"as stored": lambda x, w: w(x), "oneDNN": _packed_linear}
    table: dict[int, dict[str, float]] = {}
    for rows in (1, 2, 4, 8, 16, 32, 64):
        x, table[rows] = torch.randn(rows, shape[1]), {}
        for name, held in layouts.items():
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for w in held:
                    call[name](x, w)
                best = min(best, time.perf_counter() - start)
            table[rows][name] = len(weights) * shape[0] * shape[1] * 4 / best / 1e9
        ratio = table[rows]["oneDNN"] / table[rows]["as stored"]
        print(
            f"float32 products of {rows:2d} rows: as stored {table[rows]['as stored']:5.1f} GB/s, "
            f"oneDNN's layout {table[rows]['oneDNN']:5.1f} GB/s (time ratio {ratio:.2f})",
            flush=True,
        )
    return {"gb_per_s": table, "threads": torch.get_num_threads(), "shape": shape}


def main_run(args: Settings) -> dict:
    timed = products() if args.products else None
    floor = import_floor(args.fast_path)
    print(f"import floor: RSS {floor['rss_mib']:.0f} MiB ({floor['modules']} modules)", flush=True)
    model = checkpoint_spec(args.checkpoint)
    for spec in [*args.specs, args.replica_spec]:
        parse_experts(spec, model)  # a bad spec fails here, not in a service's log
    specs = [*args.specs, args.replica_spec, args.replica_spec]
    extra = ["--dtype", args.dtype, "--fast-path", args.fast_path, "--quantize", args.quantize]
    extra += ["--quantize-group-size", str(args.quantize_group_size)]
    env = {} if args.prepack == "auto" else {"MOE_MESH_PREPACK": args.prepack}
    procs = start_experts(
        args.checkpoint, specs, Path(tempfile.mkdtemp(prefix="moe-memory-")), *extra, env=env
    )
    try:
        touched = [touch(p.address) for p in procs]
        rows = [row(p, s, t, args, floor) for p, s, t in zip(procs, specs, touched)]
    finally:
        stop_all(procs)
    return {
        "float32_products": timed,
        "import_floor": floor,
        "services": rows[: len(args.specs)],
        "replicas": replicas(rows[len(args.specs) :], floor),
        "all_services": everyone(rows, specs, args, floor),
        "margin_target_mib": MARGIN_MIB if args.quantize == "none" else QUANTIZED_MARGIN_MIB,
        "quantize": args.quantize,
        "prepack": args.prepack,
    }


class Settings(ScriptSettings):
    out: Path = Field(ROOT / "bench/results/memory.json", description="the JSON result")
    specs: list[str] = Field(["0:0", "*:*"], description="one service per expert spec")
    replica_spec: str = Field("*:0-1", description="the group two replicas serve")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the services' --dtype"
    )
    prepack: Literal["auto", "on", "off", "panels"] = Field(
        "auto", description="MOE_MESH_PREPACK for the services (common/linear.py)"
    )
    fast_path: Literal["auto", "off"] = Field("auto", description="the services' --fast-path")
    quantize: Literal["none", "int8", "int4"] = Field(
        "none", description="the services' --quantize (with --dtype bfloat16)"
    )
    quantize_group_size: Literal[32, 64, 128] = Field(64, description="--quantize-group-size")
    products: bool = Field(
        True, description="first, time float32 products as stored against oneDNN's layout"
    )


def main() -> int:
    args = parse_settings(Settings, __doc__)
    ensure_checkpoint(args.checkpoint)
    write_result(args.out, {**main_run(args), "checkpoint": str(args.checkpoint)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
