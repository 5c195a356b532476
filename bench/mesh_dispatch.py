"""Mesh costs at a model geometry (`--geometry`, bench/geometry.py: the `small` preset in float32 by
default, or a bfloat16 slice of Qwen3-30B-A3B or Mixtral-8x7B at their real layer shapes, created
under .cache/ on first use; every process computes in the checkpoint's dtype), all in one run:

1. per-layer dispatch round trip (route, scatter to the expert services, gather, combine) p50/p99
   at 1, 32 and 256 tokens (`--dispatch-tokens`) over gRPC and over the UCX fast path, next to the
   same layer with every expert colocated; the fast path's overhead over colocated against a third
   of gRPC's; and the part of the remote round trip beyond the slowest service's own time (what a
   transport controls);
2. decode tokens/s of the all-remote mesh (gRPC only, then UCX) vs the monolithic engine at batch 1
   and 32 (`--decode-batches`; "mesh efficiency");
3. peak RSS of each expert-service process vs the bytes of expert weights it holds;
4. the whole mesh's memory: the weights this process (the monolithic engine and both routers) and
   every expert service hold, the files they map and their own memory above each one's floor,
   against one copy of the model's weights at the compute dtype (issue 40: one copy a host,
   whatever the processes).

Both remote routers talk to the same expert-service processes; one has its fast path off. The
set-ups are timed in turn, repeat by repeat, so drift in this host's speed hits them alike.

Each dispatch row also gives the weight bytes the layer reads (gate and the experts its tokens hit)
and each decode row the weight bytes read per token (bench.geometry.bytes_per_token), with every
set-up's share of the read bandwidth measured in the same run, before the services start.

    .venv/bin/python -m bench.mesh_dispatch [--geometry small] [--checkpoint DIR] [--services 4]
        [--dispatch-tokens 1 32 256] [--decode-batches 1 32]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP
import torch  # noqa: E402
import uvloop  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, ensure_checkpoint, parse_settings  # noqa: E402
from bench.geometry import GeometrySettings, bytes_per_token, checkpoint_for  # noqa: E402
from bench.host import around  # noqa: E402
from bench.memory import import_floor, memory, status_kib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from common.checkpoint import Checkpoint  # noqa: E402
from common.moe import route  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from moe_mesh.local.processes import start_experts  # noqa: E402
from moe_mesh.planning.measure import read_bandwidth  # noqa: E402
from router_service.build import build_local_engine, build_router  # noqa: E402
from router_service.engine.pipeline import CallTimes  # noqa: E402
from router_service.settings import RouterSettings  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache/bench-small-mixtral"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def time_layer(dispatcher, layer_weights, x: torch.Tensor) -> tuple[float, float]:
    """One call of MoE layer 0 (ms): its whole time, and the part of its remote calls' round trip
    that was not the slowest service's own time (transfer, framing, waking up; 0 colocated)."""
    calls: list[CallTimes] = []
    start = time.perf_counter()
    await dispatcher.moe_layer(0, x, layer_weights, calls=calls)
    beyond = sum(c.wall - c.service for c in calls)  # no entry when colocated
    return (time.perf_counter() - start) * 1000, beyond * 1000


async def time_layers(
    engines: dict, x: torch.Tensor, repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """time_layer per engine, in rounds that take each engine in turn, so that drift in this
    host's speed hits them alike; the first rounds warm channels and page in weights."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in engines}
    for r in range(repeats + 3):
        for name, engine in engines.items():
            ms, beyond = await time_layer(
                engine.model.dispatcher, engine.model.weights.layers[0], x
            )
            if r >= 3:
                times[name][0].append(ms)
                times[name][1].append(beyond)
    return times


async def decode_rate(engine, batch: int, new_tokens: int, vocab: int) -> float:
    """Decode tokens/s of `batch` greedy sequences, timed within one run from the step that gave
    every sequence its first token (the prefill's) to the last. Taking a 1-token run's time from
    a whole run's gave the Mixtral slice's engine 450 tok/s (2130% of the read bandwidth) on host
    E, when the short run's prefill ran slower than the long one's."""
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, 16), generator=gen).tolist()

    async def run(n: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"{n}-{i}", p, params)
        count, started, first = 0, set(), None
        while engine.has_unfinished():
            for o in await engine.step():
                if o.error is not None:
                    raise o.error
                count += len(o.new_token_ids)
                if o.new_token_ids:
                    started.add(o.request_id)
            if first is None and len(started) == batch:  # later prefills outside the window
                first = (time.perf_counter(), count)
        if first is None:
            raise RuntimeError(f"{batch} sequences ended before each had a token")
        return time.perf_counter() - first[0], count - first[1]

    # Untimed first: on host C the first run's page faults on mapped weights outweighed a few
    # tokens' decode.
    await run(1)
    seconds, tokens = await run(new_tokens)
    return tokens / seconds


def transports(remotes) -> dict[str, int]:
    """Calls each transport carried, from the backends' own counters, and fast-path fallbacks."""
    links = [r.fast_path for r in remotes if r.fast_path is not None]
    return {
        "ucx": sum(link.calls for link in links),
        "fallbacks": sum(sum(link.fallbacks.values()) for link in links),
    }


def model_bytes(checkpoint: Path, itemsize: int) -> int:
    """One copy of every weight of the checkpoint at `itemsize` bytes each."""
    from safetensors import safe_open

    total = 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total * itemsize


def mesh_memory(args, spec, services: list, floor, engines: dict, own_anon_mib: float) -> dict:
    """The weights this process and every service hold, against one copy at the compute dtype:
    each one's PSS of the checkpoint's and the packed-weight cache's files (bench/memory.py) and
    its anonymous memory, less its anonymous floor (this process's before it built any engine, a
    service's import floor) and the engines' KV caches (zeroed at start-up, so resident). The
    one-expert `floor` service is stopped first: it maps pages the services map too."""
    floor.stop()
    itemsize = getattr(torch, spec.torch_dtype, torch.float32).itemsize
    weights = model_bytes(args.checkpoint, itemsize)
    experts = spec.expert_params * itemsize * len(spec.moe_layer_ids) * spec.num_experts
    kv_mib = sum(e.cache.nbytes for e in engines.values()) / 2**20
    anon_floor = import_floor("ucx")["anon_mib"]
    pids = {
        "this process": os.getpid(),
        **{f"expert service {s.name}": s.proc.pid for s in services},
    }
    held = {name: memory(pid, args.checkpoint) for name, pid in pids.items()}
    mapped = sum(m["pss_checkpoint_mib"] for m in held.values())
    anon = sum(m["pss_anon_mib"] for m in held.values())
    floors = own_anon_mib + anon_floor * len(services)
    copies = (mapped + anon - floors - kv_mib) / (weights / 2**20)
    print(
        f"mesh memory: {len(held)} processes map {mapped:.0f} MiB of weight files and hold "
        f"{anon:.0f} MiB of their own, less floors {floors:.0f} (this process {own_anon_mib:.0f}, "
        f"a service {anon_floor:.0f}) and KV caches {kv_mib:.0f}: {copies:.2f} copies of the "
        f"model's {weights / 2**20:.0f} MiB of weights ({(weights - experts) / 2**20:.0f} MiB "
        "of them dense)",
        flush=True,
    )
    return {
        "processes": held,
        "mapped_weights_mib": mapped,
        "anonymous_mib": anon,
        "anonymous_floors_mib": floors,
        "kv_caches_mib": kv_mib,
        "weights_mib": weights / 2**20,
        "dense_weights_mib": (weights - experts) / 2**20,
        "weight_copies": copies,
    }


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def dispatch_row(
    engines: dict, layer0, spec, n: int, repeats: int, itemsize: int, bandwidth: float
) -> dict:
    """One MoE layer's round trip at `n` tokens: colocated, over gRPC and over UCX."""
    x = torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))
    x = x.to(getattr(torch, spec.torch_dtype, torch.float32))  # the compute dtype (auto)
    hit = route(x, layer0.router, spec, layer0.router_bias, layer0.router_correction).experts
    row = {"tokens": n, "experts_hit": int(hit.unique().numel())}
    # The layer's weight reads: its gate and each expert its tokens hit, once.
    reads = row["weight_bytes_read"] = (
        spec.num_experts * spec.hidden_size + row["experts_hit"] * spec.expert_params
    ) * itemsize
    for name, (ms, beyond) in (await time_layers(engines, x, repeats)).items():
        row[f"{name}_p50_ms"] = statistics.median(ms)
        row[f"{name}_p99_ms"] = percentile(ms, 0.99)
        row[f"{name}_bandwidth_share"] = reads / (row[f"{name}_p50_ms"] / 1000) / bandwidth
        if name != "colocated":
            row[f"{name}_beyond_service_p50_ms"] = statistics.median(beyond)
    for t in ("grpc", "ucx"):
        row[f"{t}_overhead_p50_ms"] = row[f"{t}_p50_ms"] - row["colocated_p50_ms"]
    # Target: the fast path's overhead over colocated <= 1/3 of gRPC's (at 32 and 256 tokens).
    # An overhead can be negative (four services computing experts side by side can beat one
    # process): then the share is no figure, the inequality still is.
    ucx, grpc = row["ucx_overhead_p50_ms"], row["grpc_overhead_p50_ms"]
    share = row["ucx_overhead_share_of_grpc"] = ucx / grpc if grpc > 0 else None
    within = row["ucx_overhead_within_a_third_of_grpc"] = ucx <= grpc / 3
    # What the transport itself controls: the round trip beyond the services' own time.
    row["ucx_beyond_service_share_of_grpc"] = (
        row["ucx_beyond_service_p50_ms"] / row["grpc_beyond_service_p50_ms"]
    )
    print(
        f"dispatch {n:>3} tokens: p50/p99 ms gRPC {row['grpc_p50_ms']:.2f}/{row['grpc_p99_ms']:.2f} | "
        f"UCX {row['ucx_p50_ms']:.2f}/{row['ucx_p99_ms']:.2f} | "
        f"colocated {row['colocated_p50_ms']:.2f}/{row['colocated_p99_ms']:.2f} | "
        f"overhead over colocated gRPC {grpc:+.2f}, UCX {ucx:+.2f}"
        f"{'' if share is None else f' ({share:.2f} of gRPC)'}, "
        f"{'within' if within else 'over'} a third of gRPC's | beyond the "
        f"services' own time: gRPC {row['grpc_beyond_service_p50_ms']:.2f}, UCX "
        f"{row['ucx_beyond_service_p50_ms']:.2f} ({row['ucx_beyond_service_share_of_grpc']:.2f}) | "
        f"reads {reads / 1e6:.1f} MB: colocated {row['colocated_bandwidth_share']:.0%}, gRPC "
        f"{row['grpc_bandwidth_share']:.0%}, UCX {row['ucx_bandwidth_share']:.0%} of read bandwidth",
        flush=True,
    )
    return row


async def decode_efficiency(
    engines: dict, spec, b: int, args: ScriptSettings, itemsize: int, bandwidth: float
) -> dict:
    """Decode tokens/s at batch `b` of the monolithic engine and the two all-remote meshes, and
    each one's share of the read bandwidth (bytes_per_token at batch `b`)."""
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.decode_repeats):  # in turn, as the layer timings
        for name, engine in engines.items():
            runs[name].append(await decode_rate(engine, b, args.new_tokens, spec.vocab_size))
    rates = {name: statistics.median(r) for name, r in runs.items()}
    mono = rates["monolithic"]
    per_token = bytes_per_token(spec, itemsize, b)
    share = {name: rate * per_token / bandwidth for name, rate in rates.items()}
    print(
        f"decode batch {b:>2}: monolithic {mono:.1f} tok/s; all-remote mesh over gRPC "
        f"{rates['grpc']:.1f} tok/s ({rates['grpc'] / mono:.2f}), over UCX {rates['ucx']:.1f} tok/s "
        f"({rates['ucx'] / mono:.2f}) | {per_token / 1e6:.1f} MB/token: monolithic "
        f"{share['monolithic']:.0%}, gRPC {share['grpc']:.0%}, UCX {share['ucx']:.0%} of read "
        "bandwidth",
        flush=True,
    )
    meshes = ("grpc", "ucx")
    return {
        "batch": b,
        "monolithic_tokens_per_s": mono,
        **{f"{t}_mesh_tokens_per_s": rates[t] for t in meshes},
        **{f"{t}_mesh_efficiency": rates[t] / mono for t in meshes},
        "bytes_per_token": per_token,
        "monolithic_bandwidth_share": share["monolithic"],
        **{f"{t}_mesh_bandwidth_share": share[t] for t in meshes},
    }


def rss_row(proc, s: str, spec, per: int, floor_rss: int, itemsize: int) -> dict:
    """An expert service's peak RSS next to the weights it holds and the one-expert floor."""
    expert_bytes = spec.expert_params * itemsize
    held = per * len(spec.moe_layer_ids) * expert_bytes
    peak = peak_rss_bytes(proc.proc.pid)
    print(
        f"expert service {s}: holds {held / 2**20:.0f} MiB of weights, peak RSS {peak / 2**20:.0f} MiB "
        f"({(peak - floor_rss) / 2**20:.0f} MiB above the one-expert floor)"
    )
    return {
        "experts": s,
        "weights_mib": held / 2**20,
        "peak_rss_mib": peak / 2**20,
        "peak_rss_above_floor_mib": (peak - floor_rss) / 2**20,
    }


async def main_async(args: ScriptSettings) -> dict:
    spec = Checkpoint(args.checkpoint).spec
    # Every process computes in the checkpoint's dtype (their `--dtype auto`).
    itemsize = getattr(torch, spec.torch_dtype, torch.float32).itemsize
    bandwidth = read_bandwidth(repeats=20)  # best of 20, before the services start
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    print(
        f"cores: {len(os.sched_getaffinity(0))}; {args.services} expert services with "
        f"{args.expert_threads} torch threads each, the router with {torch.get_num_threads()}",
        flush=True,
    )
    per = spec.num_experts // args.services
    specs = [f"*:{i * per}-{(i + 1) * per - 1}" for i in range(args.services)]
    workdir = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    # Each service computes with every core this process may use (--expert-threads, default),
    # its OpenMP threads sleeping when idle (shared_cores_env): at the Mixtral slice, one token's
    # two experts often land on one service, and one thread there made a layer 1.6x colocated's
    # (66.9 vs 41.2 ms) against 1.14x with two (38.7 vs 33.8; AMD EPYC, 2 cores, 2 services).
    # Services loading GBs of experts on shared cores take a while: the Qwen3 slice's 4.7 GB over
    # four services took 54 s to be ready here (2 cores, load average 5.5).
    gib = spec.expert_params * itemsize * len(spec.moe_layer_ids) * spec.num_experts / 2**30
    experts = start_experts(
        args.checkpoint,
        specs + ["0:0"],
        workdir,
        "--compute-threads",
        str(args.expert_threads),
        ready_timeout_s=60 + 40 * gib,
    )
    floor = experts.pop()  # one expert: the process's own footprint (Python, torch, gRPC)
    own_anon = status_kib(Path("/proc/self/status").read_text())["RssAnon"] / 1024  # no engine
    try:
        seqs = max(64, *args.decode_batches)
        local = build_local_engine(RouterSettings(checkpoint=args.checkpoint, max_num_seqs=seqs))
        meshes = {}
        for transport, fast_path in (("grpc", "off"), ("ucx", "ucx")):
            meshes[transport] = await build_router(
                RouterSettings(
                    checkpoint=args.checkpoint,
                    max_num_seqs=seqs,
                    expert_endpoints=[e.address for e in experts],
                    fast_path=fast_path,
                )
            )
        layer0 = local.model.weights.layers[0]
        engines = {"colocated": local, **{t: p.engine for t, p in meshes.items()}}
        dispatch = [
            await dispatch_row(engines, layer0, spec, n, args.repeats, itemsize, bandwidth)
            for n in args.dispatch_tokens
        ]
        engines = {"monolithic": local, **{t: p.engine for t, p in meshes.items()}}
        efficiency = [
            await decode_efficiency(engines, spec, b, args, itemsize, bandwidth)
            for b in args.decode_batches
        ]
        floor_rss = peak_rss_bytes(floor.proc.pid)
        whole = mesh_memory(args, spec, experts, floor, engines, own_anon)
        carried = {t: transports(p.remotes) for t, p in meshes.items()}
        print(f"calls per transport: {carried}", flush=True)
        if carried["ucx"].get("ucx", 0) == 0 or carried["ucx"].get("fallbacks"):
            raise SystemExit(f"the UCX mesh did not run over UCX alone: {carried['ucx']}")
        for p in meshes.values():
            for r in p.remotes:
                await r.close()
        print(f"one-expert service (process floor): peak RSS {floor_rss / 2**20:.0f} MiB")
        rss = [rss_row(e, s, spec, per, floor_rss, itemsize) for e, s in zip(experts, specs)]
    finally:
        for e in [*experts, floor]:
            e.stop()
    return {
        "geometry": args.geometry,
        "compute_dtype": spec.torch_dtype,
        "memory_read_bandwidth_bytes_per_s": bandwidth,
        "dispatch_round_trip": dispatch,
        "calls_per_transport": carried,
        "decode": efficiency,
        "expert_service_rss": rss,
        "one_expert_service_peak_rss_mib": floor_rss / 2**20,
        "mesh_memory": whole,
    }


class Settings(GeometrySettings):
    out: Path = Field(ROOT / "bench/results/mesh_dispatch.json", description="the JSON result")
    services: int = Field(4, ge=1, description="expert services")
    expert_threads: int = Field(
        len(os.sched_getaffinity(0)),
        ge=1,
        description="torch threads per expert service (default: the cores this process may use)",
    )
    repeats: int = Field(50, ge=1, description="layer calls timed per size")
    decode_repeats: int = Field(3, ge=1, description="decode runs per batch")
    new_tokens: int = Field(16, ge=2, description="tokens generated per decode run")
    dispatch_tokens: list[int] = Field([1, 32, 256], description="tokens per timed MoE layer call")
    decode_batches: list[int] = Field([1, 32], description="decode batch sizes")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    args.checkpoint = checkpoint_for(args.geometry, args.checkpoint)
    return run(main_async, args)


def run(main_async, args: ScriptSettings) -> int:
    """The `small` checkpoint made if missing, `main_async(args)` run, its result written to
    args.out with the set-up it ran on (shared by the benches of expert services)."""
    ensure_checkpoint(args.checkpoint)
    # uvloop, as `moe-mesh serve-router` runs the router: on asyncio's own loop a remote layer cost
    # the router ~0.5 ms more CPU here (1.9 against 1.45 ms at 1 token), which is no transport's.
    result = around(lambda: uvloop.run(main_async(args)))
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
