"""A soak of the autoscaler (issue 43): a `tiny` mesh started with `up --autoscale`, under a load
that ramps from 1 to 16 concurrent streams, holds (±20% noise), drops to 1 and steps back to 16,
mixing greedy and seeded streams over gRPC and HTTP; loopback only, bounded in time and count.

Before it, the same requests run once on a mesh without the autoscaler, one at a time: the
reference every soak output is compared with, token for token. Then a 15 s burst of 16 streams
warms the soak's mesh up, and the soak starts once the autoscaler has brought it back to one
replica a group. Every 2 s it records the load, each
group's replicas, the p99 time per output token of the requests that ended in the last 10 s, and
the RSS and open file descriptors of the long-lived processes (`up`, gateway, router, the first
replica of each group). It writes bench/results/soak.json and a PNG of load, replicas and p99 TPOT.

    .venv/bin/python -m bench.soak [--quick] [--checkpoint DIR]

Targets: 0 failed and 0 changed outputs; scale-up within SCALE_UP_BOUND_S of the load step;
scale-down only after the scale-down window; at most one change per group per window under the
held load; RSS growth < 5% and file descriptors back to their count, from the start (after the warm-up,
no client) to the end (the clients gone, the replicas back to their starting count).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP

import grpc  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings  # noqa: E402
from bench.chaos import Request, Result, mesh_up, request_set, stream_grpc, stream_http  # noqa: E402
from bench.soak_report import analyse, plot  # noqa: E402
from moe_mesh.benchmark import client  # noqa: E402
from moe_mesh.dev.create_checkpoint import create_checkpoint  # noqa: E402
from protos.moe_mesh.v1 import inference_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 2.0
MAX_REQUESTS = 20_000  # a bound on the whole soak, far above what 10 minutes send here


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    start: int  # streams at its start
    end: int  # ... and at its end (linear in between)
    noise: float = 0.0  # a new level every 10 s within ±noise of `end`


def schedule(quick: bool) -> list[Phase]:
    """~10 minutes (quick: ~3) of load; the drop is longer than the scale-down window plus the
    time to remove replicas one step at a time."""
    k = 0.3 if quick else 1.0
    return [
        Phase("idle", 30 * k, 1, 1),
        Phase("ramp", 60 * k, 1, 16),
        Phase("hold", 150 * k, 16, 16, noise=0.2),
        Phase("drop", 150 * k, 1, 1),
        Phase("step", 90 * k, 16, 16),
        Phase("cool", 0, 0, 0),  # no load until the replicas are back where they began
    ]


def streams_at(phases: list[Phase], t: float, rng: random.Random, last: dict) -> tuple[str, int]:
    begin = 0.0
    for p in phases[:-1]:
        if t < begin + p.seconds:
            level = p.start + (p.end - p.start) * (t - begin) / p.seconds
            if p.noise:
                slot = int((t - begin) // 10)
                if last.get("slot") != (p.name, slot):
                    last["slot"] = (p.name, slot)
                    last["level"] = p.end * (1 + rng.uniform(-p.noise, p.noise))
                level = last["level"]
            return p.name, max(1, round(level))
        begin += p.seconds
    return phases[-1].name, 0


def policy_flags(quick: bool) -> list[str]:
    """Token rows per replica: 500/s is about a third of what one replica of each group computed at
    16 streams here (AMD EPYC, 2 cores), so the load asks for 3 (the maximum)."""
    window = 30 if quick else 60
    policy = (
        f"--metric token_rows --target 500 --max-replicas 3 --interval-s 2 --scale-up-window-s 4 "
        f"--scale-down-window-s {window} --step-period-s 10"
    )
    return ["--expert-services", "2", "--autoscale", f"--autoscale-arg={policy}"]


async def reference(mesh, requests: list[Request]) -> dict[int, tuple]:
    """Each request once, one at a time, on a mesh nothing disturbs."""
    results = await run_each(mesh, requests)
    failed = [r for r in results if r.error]
    if failed:
        raise SystemExit(f"the reference run failed: {failed[0].error}")
    return {r.key: (r.tokens, r.finish) for r in results}


async def run_each(mesh, requests: list[Request]) -> list[Result]:
    async with clients(mesh) as (stub, session, url):
        return [await one(stub, session, url, r) for r in requests]


@contextlib.asynccontextmanager
async def clients(mesh):
    """A gRPC stub and an HTTP session on the mesh's gateway, and its HTTP URL."""
    async with (
        grpc.aio.insecure_channel(mesh.info["gateway_grpc"]) as channel,
        client.session(timeout_s=120) as session,
    ):
        yield (
            inference_pb2_grpc.InferenceStub(channel),
            session,
            f"http://{mesh.info['gateway_http']}",
        )


async def one(stub, session, url: str, r: Request) -> Result:
    return await (
        stream_grpc(stub, r, 120) if r.transport == "grpc" else stream_http(session, url, r)
    )


class Soak:
    """The load, its streams, and the samples taken meanwhile."""

    def __init__(self, mesh, requests: list[Request], phases: list[Phase], seed: int) -> None:
        self.mesh, self.requests, self.phases = mesh, requests, phases
        self.rng = random.Random(seed)
        self.results: list[tuple[float, Result]] = []  # (seconds from the start when it ended, ...)
        self.samples: list[dict] = []
        self.warm_up_results: list[Result] = []
        self.streams: dict[int, asyncio.Task] = {}  # stream i runs while i < wanted
        self.wanted = 0
        self.t0 = self.wall0 = 0.0
        self._next = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        await self.warm_up()
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.sample("start")
        async with clients(self.mesh) as (stub, session, url):
            sampler = asyncio.ensure_future(self.sampling())
            last: dict = {}
            while True:
                phase, self.wanted = streams_at(self.phases, self.now(), self.rng, last)
                for i in range(self.wanted):
                    if i not in self.streams or self.streams[i].done():
                        self.streams[i] = asyncio.ensure_future(self.stream(i, stub, session, url))
                if phase == "cool" or len(self.results) >= MAX_REQUESTS:
                    break
                await asyncio.sleep(0.25)
            self.wanted = 0
            await asyncio.gather(*self.streams.values())
        sampler.cancel()
        await self.cool_down(self.samples[0]["replicas"])
        self.sample("end")

    async def warm_up(self, seconds: float = 15.0) -> None:
        """What a process allocates for the largest batch it will see (16 streams on the starting
        replicas), or opens on its first call (a compute thread, a connection to each replica),
        is not growth: the RSS and file descriptors to compare with are taken after this burst,
        once its clients have gone and the autoscaler has brought the replicas back."""
        start = json.loads(self.mesh.ready_file.read_text())["experts"]
        self.t0 = time.monotonic()
        async with clients(self.mesh) as (stub, session, url):
            self.wanted = 16
            streams = [self.stream(i, stub, session, url) for i in range(16)]
            stop = asyncio.get_running_loop().call_later(
                seconds, lambda: setattr(self, "wanted", 0)
            )
            await asyncio.gather(*streams)
            stop.cancel()
        self.warm_up_results = [r for _, r in self.results]  # checked too, not timed
        self.results.clear()
        await self.cool_down(_groups(start), keep=False)

    async def stream(self, i: int, stub, session, url: str) -> None:
        """Requests one after another while the load wants stream i (it is started again when
        the load rises again)."""
        while i < self.wanted and len(self.results) < MAX_REQUESTS:
            r = self.requests[self._next % len(self.requests)]
            self._next += 1
            self.results.append((self.now(), await one(stub, session, url, r)))

    async def sampling(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            self.sample("load")

    async def cool_down(self, start: dict[str, int], keep: bool = True, bound_s: float = 240.0):
        """No load until every group is back to its `start` replicas (bounded)."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            if keep:
                self.sample("cool")
            if self.replicas() == start:
                await asyncio.sleep(3)  # retired replicas' connections close
                return
            await asyncio.sleep(SAMPLE_S)

    def replicas(self) -> dict[str, int]:
        return _groups(json.loads(self.mesh.ready_file.read_text()).get("experts", []))

    def sample(self, phase: str) -> None:
        replicas = self.replicas()
        t = self.now()
        tpots = sorted(
            x for end, r in self.results if end > t - 10 and (x := tpot_s(r)) is not None
        )
        self.samples.append({
            "t": round(t, 2), "phase": phase, "streams": self.wanted,
            "replicas": replicas,
            "tpot_p99_ms": round(1e3 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))], 1) if tpots else None,
            "processes": processes(self.long_lived()),
        })  # fmt: skip

    def long_lived(self) -> dict[str, int]:
        """`up`, the gateway, the router and the replicas it started with (scale-down retires
        the newest first)."""
        pids = self.mesh.info.get("pids", {})
        keep = {"up": self.mesh.proc.pid}
        keep |= {
            n: p for n, p in pids.items() if n in ("gateway", "router-0", "expert-1", "expert-2")
        }
        return keep


def _groups(experts: list[dict]) -> dict[str, int]:
    """Replicas per group (expert spec) in a ready file's `experts`."""
    out: dict[str, int] = {}
    for e in experts:
        out[e["experts"]] = out.get(e["experts"], 0) + 1
    return dict(sorted(out.items()))


def tpot_s(r: Result) -> float | None:
    """Mean time per output token after the first (None with fewer than two tokens)."""
    n = len(r.tokens)
    return (r.latency_s - r.ttft_s) / (n - 1) if n > 1 and not r.error else None


def processes(pids: dict[str, int]) -> dict[str, dict]:
    """RSS (MiB) and open file descriptors of each live process."""
    out = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:"))
            out[name] = {
                "rss_mib": round(rss / 1024, 1),
                "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())),
            }
        except (OSError, StopIteration):
            out[name] = {"rss_mib": None, "fds": None}
    return out


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        ROOT / ".cache" / "chaos-tiny-mixtral",
        description="checkpoint to use; created (tiny Mixtral) if missing",
    )
    out: Path = Field(ROOT / "bench" / "results" / "soak.json", description="the JSON report")
    png: Path = Field(ROOT / "bench" / "results" / "soak.png", description="the plot")
    distinct: int = Field(48, ge=4, description="distinct requests the streams cycle through")
    seed: int = Field(0, description="the noise of the held load")
    quick: bool = Field(False, description="a ~3-minute schedule (a smoke run)")


def main() -> int:
    args = parse_settings(Settings, __doc__)
    if not (args.checkpoint / "config.json").exists():
        print(f"==> creating {args.checkpoint} (tiny preset)", flush=True)
        create_checkpoint(args.checkpoint, "mixtral", "tiny")
    requests = request_set(args.distinct)
    phases = schedule(args.quick)
    flags = policy_flags(args.quick)
    with tempfile.TemporaryDirectory(prefix="moe-soak-") as tmp:
        work = Path(tmp)
        print("==> reference: each request once on a mesh without the autoscaler", flush=True)
        with mesh_up(args.checkpoint, work, "reference", "--expert-services", "2") as mesh:
            expected = asyncio.run(reference(mesh, requests))
        print(
            f"==> soak: {sum(p.seconds for p in phases):.0f} s of load, then a cool-down",
            flush=True,
        )
        with mesh_up(args.checkpoint, work, "soak", *flags) as mesh:
            soak = Soak(mesh, requests, phases, args.seed)
            asyncio.run(soak.run())
            log = Path(mesh.info["autoscaler"]["log"]).read_text().splitlines()
    decisions = [json.loads(line) for line in log if line.strip()]
    report = analyse(soak, expected, decisions, flags)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.png)
    for name, met in report["met"].items():
        print(f"{name:<28} {'met' if met else 'NOT MET'}  {report['figures'].get(name, '')}")
    print(f"==> wrote {args.out} and {args.png}")
    return 0 if all(report["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
