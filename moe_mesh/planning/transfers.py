"""Tc(bytes) per transport for `moe-mesh profile`: a Forward call's round trip through the router's
real client (RemoteExperts) minus the same FFN computed here, halved; and, when the expert
service's pid is known, the CPU a call costs the service beyond its FFN and the caller."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from common.fastpath import LOOPBACK_HOSTS
from common.fastpath.auth import HelloSigner
from moe_mesh.ops.client import client_tls
from moe_mesh.planning.deploy.plan import PlanError
from moe_mesh.planning.measure import process_cpu_s
from moe_mesh.planning.profile_format import Fit, ProfileSettings, TransferPoint
from router_service.experts.fastpath import FastPathConfig
from router_service.experts.remote import Identity, RemoteExperts

PROG = "moe-mesh profile"


def say(text: str) -> None:
    """One line of `moe-mesh profile`'s progress, on stderr."""
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


async def measure_transports(
    settings: ProfileSettings, bench, address: str, pid: int | None, no_pid: str
) -> dict:
    """Tc(bytes) for grpc and ucx against the expert service at `address`, and each end's CPU
    per call when the service's `pid` is known (else `no_pid` says why not)."""
    # A mesh of `up --tls`: its ready file names the client certificate to call (and say hello) with.
    tls = client_tls(settings.ready_file)
    signer = HelloSigner.from_tls(tls) if tls else None
    max_bytes = 256 * 2**20
    probe = RemoteExperts(address, Identity("", ""), max_bytes, tls=tls)
    try:
        info = await probe.describe(settings.connect_timeout_s)
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
    torch.set_num_threads(settings.expert_threads)
    out = {}
    for name, mode in (("grpc", "off"), ("ucx", "ucx")):
        config = FastPathConfig(mode=mode, loopback=loopback, signer=signer)
        if mode == "ucx" and not config.enabled():
            out[name] = {"skipped": "ucxx cannot be imported here"}
            say("ucx skipped: ucxx cannot be imported")
            continue
        if mode == "ucx" and not info.fast_paths:
            out[name] = {"skipped": f"expert service {address} advertises no UCX fast path"}
            say(f"ucx skipped: {address} advertises no fast path")
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
                settings, bench, remote, name, layer, layer_experts, pid, no_pid
            )
        finally:
            await remote.close()
    return out


async def _round_trips(
    settings: ProfileSettings,
    bench,
    remote,
    name: str,
    layer: int,
    experts: list[int],
    pid: int | None,
    no_pid: str,
) -> dict:
    expert = experts[0]
    points, spread = [], []
    for n in settings.transfer_tokens:
        rows = bench.hidden(n)  # [n, hidden] in the compute dtype
        walls, carried = [], set()
        for i in range(settings.repeats + 3):  # 3 warm-ups: channel, fast-path hello, service pages
            start = time.perf_counter()
            reply = await remote.forward(layer, [(expert, rows)], timeout_s=30.0)
            if i >= 3:
                walls.append(time.perf_counter() - start)
            carried.add(reply.transport)
        cpu = {}
        if pid is not None:
            cpu = await _call_cpu(settings, remote, layer, [(expert, rows)], pid, carried)
            if not cpu:
                no_pid = f"/proc/{pid}/stat of the expert service could not be read"
            k = min(n, len(experts))
            if cpu and k > 1:  # the same rows split over k experts
                spread.append(
                    await _spread(settings, bench, remote, name, layer, experts[:k], rows, pid)
                )
        if carried != {name}:
            say(f"{name} skipped: calls went over {sorted(carried)}")
            return {"skipped": f"calls fell back to {sorted(carried - {name})} from {name}"}
        ffn = bench.expert_call((layer, expert), rows, settings.repeats)
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
        say(
            f"Tc {name} {n} tokens ({size} B): round trip {rtt * 1e3:.3f} ms, "
            f"FFN {ffn.wall_s * 1e3:.3f} ms, one way {one_way * 1e3:.3f} ms"
            + (
                f"; CPU per call: service {cpu['service_cpu_s'] * 1e3:.3f} ms (FFN "
                f"{ffn.cpu_s * 1e3:.3f} ms), router {cpu['router_cpu_s'] * 1e3:.3f} ms"
                if cpu
                else ""
            )
        )
    return _fitted(name, points, spread, no_pid)


def _fitted(name: str, points: list[TransferPoint], spread: list, no_pid: str) -> dict:
    """Tc fitted over the points; with the CPU of every call known, each end's CPU per call too,
    and per expert beyond the first from the `spread` calls."""
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
            say(
                f"{name}: each expert beyond the first in a call: service "
                f"{out['service_expert_cpu'] * 1e3:.3f} ms, router "
                f"{out['router_expert_cpu'] * 1e3:.3f} ms CPU"
            )
    else:
        out["cpu_skipped"] = no_pid
        say(f"{name} per-call CPU skipped: {no_pid}")
    return out


def _per_expert(spread: list[TransferPoint], one: Fit, cost) -> float:
    """Median over the spread calls of (cost - the one-expert fit at its bytes) / extra experts."""
    f = one.linear()
    return max(0.0, statistics.median((cost(p) - f(p.bytes)) / (p.experts - 1) for p in spread))


async def _spread(
    settings: ProfileSettings,
    bench,
    remote,
    name: str,
    layer: int,
    experts: list[int],
    rows,
    pid: int,
):
    """A call with `rows` split over `experts` (as even as can be): its CPU at both ends and its
    FFNs in-process (round trip: the mean of the back-to-back calls); None when the service's CPU
    could not be read or a call went over another transport."""
    parts = rows.tensor_split(len(experts))
    groups = list(zip(experts, parts))
    carried: set = set()
    for _ in range(3):  # warm-up: the other experts' pages
        await remote.forward(layer, groups, timeout_s=30.0)
    start = time.perf_counter()
    cpu = await _call_cpu(settings, remote, layer, groups, pid, carried)
    if not cpu or carried != {name}:
        return None
    rtt = (time.perf_counter() - start) / cpu["cpu_calls"]
    ffn = bench.experts_call(layer, groups, settings.repeats)
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
    say(
        f"Tc {name} {point.tokens} tokens over {len(experts)} experts: CPU per call: service "
        f"{point.service_cpu_s * 1e3:.3f} ms "
        f"(FFN {ffn.cpu_s * 1e3:.3f} ms), router {point.router_cpu_s * 1e3:.3f} ms"
    )
    return point


async def _call_cpu(
    settings: ProfileSettings, remote, layer: int, groups, pid: int, carried: set
) -> dict:
    """CPU seconds per call of the service (pid) and of this process, over back-to-back calls
    for at least --cpu-window-s (and --repeats calls): /proc's clock ticks need a window."""
    service_before, router_before = process_cpu_s(pid), time.process_time()
    start, calls = time.perf_counter(), 0
    while calls < settings.repeats or time.perf_counter() - start < settings.cpu_window_s:
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
