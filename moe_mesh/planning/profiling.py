"""What `moe-mesh profile` measures, put together: Ta, Te, the dense layers and the head on this
process's threads (moe_mesh/planning/measure.py), Tc and per-call CPU against an expert service
(moe_mesh/planning/transfers.py), started here on loopback when none is given."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.checkpoint import Checkpoint
from moe_mesh.ops.ready import read_ready_file
from moe_mesh.planning.deploy.plan import PlanError
from moe_mesh.planning.measure import LayerBench, read_bandwidth
from moe_mesh.planning.profile_format import Fit, Measured, Point, ProfileFile, ProfileSettings
from moe_mesh.planning.transfers import measure_transports, say


def _measured(points: list[Point], threads: int) -> Measured:
    xs = [p.x for p in points]
    return Measured(
        wall=Fit.of(xs, [p.wall_s for p in points]),
        cpu=Fit.of(xs, [p.cpu_s for p in points]),
        threads=threads,
        points=points,
    )


def measure_compute(settings: ProfileSettings, bench) -> dict:
    """Ta, Te, dense and head on this process's threads; the fields of ProfileFile they fill."""

    def points(label: str, threads: int, run) -> list[Point]:
        torch.set_num_threads(threads)
        out = []
        for b in settings.sizes:
            t = run(b)
            if t is None:
                return []
            out.append(Point(x=b, wall_s=t.wall_s, cpu_s=t.cpu_s))
            say(f"{label} b={b}: {t.wall_s * 1e3:.3f} ms wall, {t.cpu_s * 1e3:.3f} ms CPU")
        return out

    r, e, n = settings.router_threads, settings.expert_threads, settings.repeats
    ta = points("Ta", r, lambda b: bench.router_layer(b, settings.context, n))
    dense = points("dense layer", r, lambda b: bench.dense_layer(b, settings.context, n))
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

    def __init__(self, settings: ProfileSettings, layer: int, workdir: Path) -> None:
        self.ready_file = workdir / "expert.ready.json"
        self.log_path = workdir / "expert.log"
        cmd = [
            sys.executable,
            "-m",
            "expert_service",
            "--checkpoint",
            str(settings.checkpoint),
            "--experts",
            f"{layer}:*",
            "--dtype",
            settings.dtype,
            "--compute-threads",
            str(settings.expert_threads),
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


def _targets(settings: ProfileSettings) -> list[tuple[str, int | None, str]]:
    """(address, pid, why no pid) of each expert service given; `moe-mesh up`'s ready file has
    the pids (of processes on this machine: it starts them on loopback)."""
    if settings.ready_file is not None:
        ready = read_ready_file(settings.ready_file, "experts")
        try:
            experts = [(e["address"], e.get("pid")) for e in ready["experts"]]
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(
                f"{settings.ready_file}: experts: expected `moe-mesh up`'s ready file ({e})"
            ) from None
        return [
            (a, pid, "" if pid else f"{settings.ready_file} gives no pid for {a}")
            for a, pid in experts
        ]
    why = "a service given by --experts has no known pid (use --ready-file, or let it start one)"
    return [(a, None, why) for a in settings.experts or []]


def profile(settings: ProfileSettings) -> ProfileFile:
    dtype = getattr(torch, settings.dtype)
    checkpoint = Checkpoint(settings.checkpoint, dtype=dtype, prepack=True)
    # Expert timings in the layout expert services hold (batch-invariant), not the router's.
    experts = Checkpoint(settings.checkpoint, dtype=dtype, prepack=True, batch_invariant=True)
    bench = LayerBench(checkpoint, experts=experts)
    spec = bench.spec
    say(f"{spec.family}: {len(spec.moe_layer_ids)} MoE layers x {spec.num_experts} experts")
    compute = measure_compute(settings, bench)
    say("memory read bandwidth")
    bandwidth = read_bandwidth()
    say(f"  {bandwidth / 1e9:.1f} GB/s")
    shares = bench.load_shares(settings.share_tokens)
    targets = _targets(settings)
    started = None
    with tempfile.TemporaryDirectory(prefix="moe-profile-") as workdir:
        if not targets:
            say("starting an expert service on loopback for the transfer times")
            started = StartedExpert(settings, bench.layer_id, Path(workdir))
        try:
            if started:
                address, pid, no_pid = started.wait_ready(), started.proc.pid, ""
            else:
                address, pid, no_pid = targets[0]
            transports = asyncio.run(measure_transports(settings, bench, address, pid, no_pid))
        finally:
            if started:
                started.stop()
    item = bench.dtype.itemsize
    dense_bytes = sum(
        _nbytes(t) for t in (bench.dense.embed, bench.dense.lm_head, bench.dense.final_norm)
    )
    return ProfileFile(
        checkpoint=str(Path(settings.checkpoint).resolve()),
        model_id=settings.model_id or Path(settings.checkpoint).resolve().name,
        family=spec.family,
        dtype=settings.dtype,
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
        context=settings.context,
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
            total += sum(_nbytes(t) for t in vars(part).values())
    return total


def _nbytes(t: object) -> int:
    """A weight's bytes: a tensor's, or a packed one's (common/bf16.py Panels, in bfloat16); 0 for
    anything else a weights object holds."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    nbytes = getattr(t, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else 0
