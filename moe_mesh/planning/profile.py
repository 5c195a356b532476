"""`moe-mesh profile`: measure the costs of MegaScale-Infer's ping-pong model (common/perfmodel.py)
on this machine and write them as JSON for `moe-mesh plan --search`.

- Ta(b): the router's share of one MoE layer for a decode micro-batch of b sequences, at --context
  tokens of KV cache, with the router's torch threads (moe_mesh/planning/measure.py);
- Te(b): every expert FFN of one MoE layer for b tokens routed by the real gate, on an expert
  service's threads; plus each expert's share of its layer's tokens;
- Tc(bytes) per transport: a Forward call's round trip through the real client (RemoteExperts)
  minus the same FFN on the same rows computed here, halved. Against running expert services
  (--experts / --ready-file) or one this command starts on loopback and stops.
- per-call CPU per transport, against bytes: the service process's CPU seconds per Forward call
  (/proc/<pid>/stat over at least --cpu-window-s of back-to-back calls) minus the same FFN's CPU
  here: what a call costs a service beyond its FFN (receive, decode, batcher, hand-off to the
  compute thread, encode, send); and this process's CPU per call, the router side's cost. The
  service's pid is known when this command started it or from `moe-mesh up`'s ready file; with
  --experts it is not, and the CPU is skipped with the reason.

Also the non-MoE parts of a step (dense layers, embedding + LM head) so the planner can predict a
whole step. The file format is ProfileFile (moe_mesh/planning/profile_format.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_mesh.ops.ready import read_ready_file
from moe_mesh.planning.deploy.plan import PlanError, write_output
from moe_mesh.planning.profile_format import Fit, Measured, Point, ProfileFile, TransferPoint

PROG = "moe-mesh profile"


# -- measuring ------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _measured(points: list[Point], threads: int) -> Measured:
    xs = [p.x for p in points]
    return Measured(
        wall=Fit.of(xs, [p.wall_s for p in points]),
        cpu=Fit.of(xs, [p.cpu_s for p in points]),
        threads=threads,
        points=points,
    )


def measure_compute(args: argparse.Namespace, bench) -> dict:
    """Ta, Te, dense and head on this process's threads; the fields of ProfileFile they fill."""
    import torch

    def points(label: str, threads: int, run) -> list[Point]:
        torch.set_num_threads(threads)
        out = []
        for b in args.sizes:
            t = run(b)
            if t is None:
                return []
            out.append(Point(x=b, wall_s=t.wall_s, cpu_s=t.cpu_s))
            _say(f"{label} b={b}: {t.wall_s * 1e3:.3f} ms wall, {t.cpu_s * 1e3:.3f} ms CPU")
        return out

    r, e, n = args.router_threads, args.expert_threads, args.repeats
    ta = points("Ta", r, lambda b: bench.router_layer(b, args.context, n))
    dense = points("dense layer", r, lambda b: bench.dense_layer(b, args.context, n))
    head = points("head", r, lambda b: bench.head(b, n))
    te = points("Te", e, lambda b: bench.expert_layer(b, n))
    return {
        "ta": _measured(ta, r),
        "te": _measured(te, e),
        "dense": _measured(dense, r) if dense else None,
        "head": _measured(head, r),
    }


class StartedExpert:
    """One expert service this command starts on loopback (serving one layer) and stops by pid."""

    def __init__(self, args: argparse.Namespace, layer: int, workdir: Path) -> None:
        self.ready_file = workdir / "expert.ready.json"
        self.log_path = workdir / "expert.log"
        cmd = [
            sys.executable,
            "-m",
            "expert_service",
            "--checkpoint",
            str(args.checkpoint),
            "--experts",
            f"{layer}:*",
            "--dtype",
            args.dtype,
            "--compute-threads",
            str(args.expert_threads),
            "--port",
            "0",
            "--ready-file",
            str(self.ready_file),
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text()[-2000:]
                raise PlanError(f"the expert service it started did not come up:\n{tail}")
            time.sleep(0.05)
        return json.loads(self.ready_file.read_text())["address"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


async def measure_transports(
    args: argparse.Namespace, bench, address: str, pid: int | None, no_pid: str
) -> dict:
    """Tc(bytes) for grpc and ucx against the expert service at `address`, and each end's CPU
    per call when the service's `pid` is known (else `no_pid` says why not)."""
    import torch

    from common.fastpath import LOOPBACK_HOSTS
    from common.fastpath.auth import HelloSigner
    from moe_mesh.ops.client import client_tls
    from router_service.experts.fastpath import FastPathConfig
    from router_service.experts.remote import Identity, RemoteExperts

    # A mesh of `up --tls`: its ready file names the client certificate to call (and say hello) with.
    tls = client_tls(args.ready_file)
    signer = HelloSigner.from_tls(tls) if tls else None
    max_bytes = 256 * 2**20
    probe = RemoteExperts(address, Identity("", ""), max_bytes, tls=tls)
    try:
        info = await probe.describe(args.connect_timeout_s)
    finally:
        await probe.close()
    served = [(k.layer, k.expert) for k in info.experts if k.layer in bench.spec.moe_layer_ids]
    if not served:
        raise PlanError(f"expert service {address} serves no expert of a MoE layer")
    layer, expert = served[0]
    layer_experts = [e for la, e in served if la == layer]
    identity = Identity(info.model_id, info.weights_checksum)
    loopback = address.rpartition(":")[0].strip("[]") in LOOPBACK_HOSTS
    if pid is not None and not loopback:
        pid, no_pid = None, f"expert service {address} is not on this machine's loopback"
    torch.set_num_threads(args.expert_threads)
    out = {}
    for name, mode in (("grpc", "off"), ("ucx", "ucx")):
        config = FastPathConfig(mode=mode, loopback=loopback, signer=signer)
        if mode == "ucx" and not config.enabled():
            out[name] = {"skipped": "ucxx cannot be imported here"}
            _say("ucx skipped: ucxx cannot be imported")
            continue
        if mode == "ucx" and not info.fast_paths:
            out[name] = {"skipped": f"expert service {address} advertises no UCX fast path"}
            _say(f"ucx skipped: {address} advertises no fast path")
            continue
        remote = RemoteExperts(
            address,
            identity,
            max_bytes,
            fast_path=config,
            fast_paths=list(info.fast_paths),
            tls=tls,
        )
        try:
            out[name] = await _round_trips(
                args, bench, remote, name, layer, layer_experts, pid, no_pid
            )
        finally:
            await remote.close()
    return out


async def _round_trips(
    args, bench, remote, name: str, layer: int, experts: list[int], pid: int | None, no_pid: str
) -> dict:
    import statistics

    expert = experts[0]
    points, spread = [], []
    for n in args.transfer_tokens:
        rows = bench.hidden(n)  # [n, hidden] in the compute dtype
        walls, carried = [], set()
        for i in range(args.repeats + 3):  # 3 warm-ups: channel, fast-path hello, service pages
            start = time.perf_counter()
            reply = await remote.forward(layer, [(expert, rows)], timeout_s=30.0)
            if i >= 3:
                walls.append(time.perf_counter() - start)
            carried.add(reply.transport)
        cpu = {}
        if pid is not None:
            cpu = await _call_cpu(args, remote, layer, [(expert, rows)], pid, carried)
            if not cpu:
                no_pid = f"/proc/{pid}/stat of the expert service could not be read"
            k = min(n, len(experts))
            if cpu and k > 1:  # the same rows split over k experts
                spread.append(
                    await _spread(args, bench, remote, name, layer, experts[:k], rows, pid)
                )
        if carried != {name}:
            _say(f"{name} skipped: calls went over {sorted(carried)}")
            return {"skipped": f"calls fell back to {sorted(carried - {name})} from {name}"}
        ffn = bench.expert_call((layer, expert), rows, args.repeats)
        rtt = statistics.median(walls)
        size = rows.numel() * rows.element_size()
        one_way = max(0.0, rtt - ffn.wall_s) / 2
        if cpu:
            cpu["ffn_cpu_s"] = ffn.cpu_s
        points.append(
            TransferPoint(
                tokens=n,
                bytes=size,
                round_trip_s=rtt,
                compute_s=ffn.wall_s,
                one_way_s=one_way,
                **cpu,
            )
        )
        _say(
            f"Tc {name} {n} tokens ({size} B): round trip {rtt * 1e3:.3f} ms, "
            f"FFN {ffn.wall_s * 1e3:.3f} ms, one way {one_way * 1e3:.3f} ms"
            + (
                f"; CPU per call: service {cpu['service_cpu_s'] * 1e3:.3f} ms (FFN "
                f"{ffn.cpu_s * 1e3:.3f} ms), router {cpu['router_cpu_s'] * 1e3:.3f} ms"
                if cpu
                else ""
            )
        )
    out = {
        "fit": Fit.of([p.bytes for p in points], [p.one_way_s for p in points]),
        "points": points,
    }
    if all(p.cpu_calls for p in points):
        xs = [p.bytes for p in points]
        service = Fit.of(xs, [max(0.0, p.service_cpu_s - p.ffn_cpu_s) for p in points])
        router = Fit.of(xs, [p.router_cpu_s for p in points])
        out.update(service_call_cpu=service, router_call_cpu=router)
        spread = [p for p in spread if p is not None]
        if spread:
            out["spread_points"] = spread
            out["service_expert_cpu"] = _per_expert(
                spread, service, lambda p: p.service_cpu_s - p.ffn_cpu_s
            )
            out["router_expert_cpu"] = _per_expert(spread, router, lambda p: p.router_cpu_s)
            _say(
                f"{name}: each expert beyond the first in a call: service "
                f"{out['service_expert_cpu'] * 1e3:.3f} ms, router "
                f"{out['router_expert_cpu'] * 1e3:.3f} ms CPU"
            )
    else:
        out["cpu_skipped"] = no_pid
        _say(f"{name} per-call CPU skipped: {no_pid}")
    return out


def _per_expert(spread: list[TransferPoint], one: Fit, cost) -> float:
    """Median over the spread calls of (cost - the one-expert fit at its bytes) / extra experts."""
    import statistics

    f = one.linear()
    return max(0.0, statistics.median((cost(p) - f(p.bytes)) / (p.experts - 1) for p in spread))


async def _spread(args, bench, remote, name: str, layer: int, experts: list[int], rows, pid: int):
    """A call with `rows` split over `experts` (as even as can be): its CPU at both ends and its
    FFNs in-process (round trip: the mean of the back-to-back calls); None when the service's CPU
    could not be read or a call went over another transport."""
    parts = rows.tensor_split(len(experts))
    groups = list(zip(experts, parts))
    carried: set = set()
    for _ in range(3):  # warm-up: the other experts' pages
        await remote.forward(layer, groups, timeout_s=30.0)
    start = time.perf_counter()
    cpu = await _call_cpu(args, remote, layer, groups, pid, carried)
    if not cpu or carried != {name}:
        return None
    rtt = (time.perf_counter() - start) / cpu["cpu_calls"]
    ffn = bench.experts_call(layer, groups, args.repeats)
    point = TransferPoint(
        tokens=rows.shape[0],
        bytes=rows.numel() * rows.element_size(),
        experts=len(experts),
        round_trip_s=rtt,
        compute_s=ffn.wall_s,
        one_way_s=max(0.0, rtt - ffn.wall_s) / 2,
        ffn_cpu_s=ffn.cpu_s,
        **cpu,
    )
    _say(
        f"Tc {name} {point.tokens} tokens over {len(experts)} experts: CPU per call: service "
        f"{point.service_cpu_s * 1e3:.3f} ms "
        f"(FFN {ffn.cpu_s * 1e3:.3f} ms), router {point.router_cpu_s * 1e3:.3f} ms"
    )
    return point


async def _call_cpu(args, remote, layer: int, groups, pid: int, carried: set) -> dict:
    """CPU seconds per call of the service (pid) and of this process, over back-to-back calls
    for at least --cpu-window-s (and --repeats calls): /proc's clock ticks need a window."""
    from moe_mesh.planning.measure import process_cpu_s

    service_before, router_before = process_cpu_s(pid), time.process_time()
    start, calls = time.perf_counter(), 0
    while calls < args.repeats or time.perf_counter() - start < args.cpu_window_s:
        reply = await remote.forward(layer, groups, timeout_s=30.0)
        carried.add(reply.transport)
        calls += 1
    router = (time.process_time() - router_before) / calls
    service_after = process_cpu_s(pid)
    if service_before is None or service_after is None:
        return {}
    return {
        "cpu_calls": calls,
        "service_cpu_s": (service_after - service_before) / calls,
        "router_cpu_s": router,
    }


def _targets(args: argparse.Namespace) -> list[tuple[str, int | None, str]]:
    """(address, pid, why no pid) of each expert service given; `moe-mesh up`'s ready file has
    the pids (of processes on this machine: it starts them on loopback)."""
    if args.ready_file is not None:
        ready = read_ready_file(args.ready_file, "experts")
        try:
            experts = [(e["address"], e.get("pid")) for e in ready["experts"]]
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(
                f"{args.ready_file}: experts: expected `moe-mesh up`'s ready file ({e})"
            ) from None
        return [
            (a, pid, "" if pid else f"{args.ready_file} gives no pid for {a}") for a, pid in experts
        ]
    why = "a service given by --experts has no known pid (use --ready-file, or let it start one)"
    return [(a, None, why) for a in args.experts or []]


def profile(args: argparse.Namespace) -> ProfileFile:
    import torch

    from common.checkpoint import Checkpoint
    from moe_mesh.planning.measure import LayerBench, read_bandwidth

    dtype = getattr(torch, args.dtype)
    checkpoint = Checkpoint(args.checkpoint, dtype=dtype, prepack=True)
    # Expert timings in the layout expert services hold (batch-invariant), not the router's.
    experts = Checkpoint(args.checkpoint, dtype=dtype, prepack=True, batch_invariant=True)
    bench = LayerBench(checkpoint, experts=experts)
    spec = bench.spec
    _say(f"{spec.family}: {len(spec.moe_layer_ids)} MoE layers x {spec.num_experts} experts")
    compute = measure_compute(args, bench)
    _say("memory read bandwidth")
    bandwidth = read_bandwidth()
    _say(f"  {bandwidth / 1e9:.1f} GB/s")
    shares = bench.load_shares(args.share_tokens)
    targets = _targets(args)
    started = None
    with tempfile.TemporaryDirectory(prefix="moe-profile-") as workdir:
        if not targets:
            _say("starting an expert service on loopback for the transfer times")
            started = StartedExpert(args, bench.layer_id, Path(workdir))
        try:
            if started:
                address, pid, no_pid = started.wait_ready(), started.proc.pid, ""
            else:
                address, pid, no_pid = targets[0]
            transports = asyncio.run(measure_transports(args, bench, address, pid, no_pid))
        finally:
            if started:
                started.stop()
    item = bench.dtype.itemsize
    dense_bytes = sum(
        t.numel() * t.element_size()
        for t in (bench.dense.embed, bench.dense.lm_head, bench.dense.final_norm)
    )
    return ProfileFile(
        checkpoint=str(Path(args.checkpoint).resolve()),
        model_id=args.model_id or Path(args.checkpoint).resolve().name,
        family=spec.family,
        dtype=args.dtype,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        moe_layers=spec.moe_layer_ids,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        bytes_per_token=spec.hidden_size * item,
        expert_bytes=spec.expert_params * item,
        dense_bytes=dense_bytes + _layer_bytes(bench.dense),
        cores=os.cpu_count() or 1,
        memory_bandwidth=bandwidth,
        context=args.context,
        **compute,
        expert_load_shares={str(k): v for k, v in shares.items()},
        transports=transports,
    )


def _layer_bytes(dense) -> int:
    total = 0
    for layer in dense.layers:
        for part in (layer, layer.attention, layer.dense_mlp, layer.shared_expert):
            if part is None:
                continue
            for t in vars(part).values():
                if hasattr(t, "element_size"):
                    total += t.numel() * t.element_size()
    return total


# -- command line ---------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by ',', got {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 600, got {text!r}")
    return value


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `profile` on the moe-mesh CLI; `args.func(args)` returns the exit code."""
    p = subparsers.add_parser(
        "profile",
        help="measure Ta, Te and Tc of the ping-pong model for `moe-mesh plan --search`",
        description="Time the router's share of a MoE layer (Ta), the experts' share (Te), the "
        "transfer of activations per transport (Tc) and the CPU a Forward call costs the expert "
        "service and the caller, on this machine; fit each linearly and write JSON. Progress "
        "goes to stderr.",
    )
    p.add_argument("--checkpoint", type=Path, required=True, metavar="DIR")
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="default stdout")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="compute dtype of router and experts (the services' default: float32)",
    )
    p.add_argument("--model-id", default=None, help="default: the checkpoint directory's name")
    p.add_argument(
        "--context", type=_positive, default=128, help="KV-cache tokens per sequence (128)"
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes("1,2,4,8,16,32,64"),
        metavar="B,B,...",
        help="micro-batch sizes for Ta and Te (1,2,4,8,16,32,64)",
    )
    p.add_argument(
        "--transfer-tokens",
        type=_sizes,
        default=_sizes("1,8,32,128,512"),
        metavar="N,N,...",
        help="tokens per Forward call for Tc (1,8,32,128,512)",
    )
    p.add_argument("--repeats", type=_positive, default=20, help="timed runs per point (20)")
    p.add_argument(
        "--cpu-window-s",
        type=_seconds,
        default=1.0,
        help="back-to-back calls per transfer size for the per-call CPU of both ends, at least "
        "this long (1.0 s: /proc counts CPU in 10 ms ticks)",
    )
    p.add_argument(
        "--router-threads",
        type=_positive,
        default=os.cpu_count() or 1,
        help="torch threads for the router side (default: every core, as the router)",
    )
    p.add_argument(
        "--expert-threads",
        type=_positive,
        default=1,
        help="torch threads for the expert side (1, as `moe-mesh up` gives its services)",
    )
    p.add_argument(
        "--share-tokens",
        type=_positive,
        default=4096,
        help="random tokens routed to estimate each expert's load share (4096)",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--experts",
        nargs="+",
        metavar="HOST:PORT",
        help="time transfers against this running expert service (the first one); default: "
        "start one on loopback",
    )
    target.add_argument(
        "--ready-file", type=Path, metavar="FILE", help="a running `moe-mesh up` mesh's ready file"
    )
    p.add_argument("--connect-timeout-s", type=float, default=30.0, help=argparse.SUPPRESS)
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    if not (args.checkpoint / "config.json").is_file():
        print(f"{PROG}: error: --checkpoint {args.checkpoint}: no config.json", file=sys.stderr)
        return 2
    try:
        result = profile(args)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result.model_dump(mode="json"), indent=1) + "\n"
    try:
        write_output(text, args.out)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.out is not None:
        _say(f"wrote {args.out}")
    return 0
