"""Chaos and fuzz against a real `moe-mesh up` (every service its own process, loopback): faults under
load, overload, and hostile input, each compared with an undisturbed run.

Scenarios, in one mesh of 2 routers and 2 replicas of every expert group (bounded, stops itself):
  baseline        the request set with nothing disturbed: the reference outputs
  expert_sigstop  one expert replica hung (SIGSTOP) for a while under load, then resumed
  expert_sigkill  one expert replica killed under load
  router_sigkill  the router serving streams killed under load (the gateway resumes them elsewhere)
  fuzz            >= 10,000 hostile HTTP bodies and gRPC messages, then a correctness check
and, in a second mesh with a small admission queue:
  overload        far more concurrent requests than admitted: the excess is refused at once

Per scenario: requests and failures, outputs that differ from the baseline (whole token sequence and
finish reason), p50/p99 of each request's longest gap between tokens ("stall"), and the targets met.
Results go to bench/results/chaos.json.

    .venv/bin/python -m bench.chaos [--quick] [--fuzz-cases 10000] [--checkpoint DIR]

(from the checkout root, where `bench` imports as a package)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import runtime

runtime.configure(shares_cores=True)  # a mesh on this host: before torch loads OpenMP

ROOT = Path(__file__).resolve().parent.parent

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import httpx  # noqa: E402
from pydantic import Field  # noqa: E402

from bench import ScriptSettings, parse_settings  # noqa: E402
from moe_mesh.benchmark import client  # noqa: E402
from moe_mesh.dev.create_checkpoint import create_checkpoint  # noqa: E402
from moe_mesh.local.processes import RunningMesh, running_up  # noqa: E402
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

NEW_TOKENS = 32
PROMPTS = [[7], [11, 3, 250, 9, 31], list(range(40, 53)), [(i * 37) % 400 + 5 for i in range(29)]]


@dataclass(frozen=True)
class Request:
    key: int
    prompt: list[int]
    seed: int | None  # None: greedy
    transport: str  # "grpc" | "http"


@dataclass
class Result:
    key: int
    tokens: tuple[int, ...] = ()
    finish: str | None = None
    max_gap_s: float = 0.0
    error: str | None = None
    latency_s: float = 0.0
    ttft_s: float = 0.0  # to the first token


def request_set(n: int) -> list[Request]:
    """Greedy and seeded-sampling streams over gRPC and HTTP, alternating."""
    return [
        Request(
            i, PROMPTS[i % len(PROMPTS)], None if i % 3 else 1000 + i, "grpc" if i % 2 else "http"
        )
        for i in range(n)
    ]


class Settings(ScriptSettings):
    checkpoint: Path = Field(
        ROOT / ".cache" / "chaos-tiny-mixtral",
        description="checkpoint to use; created (tiny Mixtral) if missing",
    )
    out: Path = Field(ROOT / "bench" / "results" / "chaos.json", description="the JSON report")
    requests: int = Field(64, ge=1, description="requests per fault scenario")
    concurrency: int = Field(8, ge=1, description="clients at once")
    fuzz_cases: int = Field(10_000, ge=0, description="hostile HTTP bodies and gRPC messages")
    quick: bool = Field(False, description="small counts: a smoke run in about a minute")


def mesh_up(checkpoint: Path, workdir: Path, name: str, *flags: str):
    """`moe-mesh up` for a scenario (moe_mesh/local/processes.py): addresses and pids in `.info`."""
    return running_up(
        checkpoint, flags, ready_file=workdir / f"{name}.json", run_dir=workdir / name,
        log_path=workdir / f"{name}.log", ready_timeout_s=180,
    )  # fmt: skip


def _finish_name(value: int) -> str:
    enum = inference_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
    return enum.values_by_number[value].name.removeprefix("FINISH_REASON_").lower()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


# -- clients ----------------------------------------------------------------------------------------


async def stream_grpc(stub, r: Request, timeout_s: float) -> Result:
    out = Result(r.key)
    msg = inference_pb2.GenerateRequest(
        prompt_token_ids=r.prompt, max_tokens=NEW_TOKENS, temperature=0.0 if r.seed is None else 0.8
    )
    if r.seed is not None:
        msg.seed = r.seed
    start = last = time.monotonic()
    tokens: list[int] = []
    try:
        async for m in stub.GenerateStream(msg, timeout=timeout_s):
            now = time.monotonic()
            if m.token_ids:
                out.ttft_s = out.ttft_s or now - start
                out.max_gap_s = max(out.max_gap_s, now - last)
                last = now
                tokens += m.token_ids
            if m.finish_reason:
                out.finish = _finish_name(m.finish_reason)
    except grpc.aio.AioRpcError as e:
        out.error = f"{e.code().name}: {e.details()}"
    out.tokens, out.latency_s = tuple(tokens), time.monotonic() - start
    return out


async def stream_http(s: aiohttp.ClientSession, url: str, r: Request) -> Result:
    body = {
        "prompt": r.prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0 if r.seed is None else 0.8,
        "stream": True,
        "return_token_ids": True,
    }
    if r.seed is not None:
        body["seed"] = r.seed
    start = time.monotonic()
    streamed = await client.stream_tokens(s, url, body, clock=time.monotonic)
    return Result(
        r.key, tuple(streamed.token_ids), streamed.finish_reason, streamed.max_gap_s,
        streamed.error, time.monotonic() - start, streamed.ttft_s,
    )  # fmt: skip


async def run_load(
    mesh: RunningMesh, requests: list[Request], concurrency: int, fault=None
) -> list[Result]:
    """Run `requests` `concurrency` at a time; `fault` (a coroutine function) starts once a few are done."""
    gate = asyncio.Semaphore(concurrency)
    started_fault = asyncio.Event()
    done = 0
    async with (
        grpc.aio.insecure_channel(mesh.info["gateway_grpc"]) as channel,
        client.session(timeout_s=120) as session,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)
        url = f"http://{mesh.info['gateway_http']}"

        async def one(r: Request) -> Result:
            nonlocal done
            async with gate:
                result = await (
                    stream_grpc(stub, r, 120)
                    if r.transport == "grpc"
                    else stream_http(session, url, r)
                )
            done += 1
            if done == concurrency:
                started_fault.set()
            return result

        async def inject() -> None:
            await started_fault.wait()
            await fault()

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        injector = asyncio.ensure_future(inject()) if fault else None
        results = await asyncio.gather(*tasks)
        if injector is not None:
            started_fault.set()
            await injector
    return results


def summarize(name: str, results: list[Result], expected: dict[int, tuple]) -> dict:
    failed = [r for r in results if r.error]
    changed = [
        r
        for r in results
        if not r.error and (r.tokens, r.finish) != expected.get(r.key, (r.tokens, r.finish))
    ]
    gaps = sorted(r.max_gap_s for r in results if not r.error)
    p50, p99 = _q(gaps, 0.5), _q(gaps, 0.99)
    row = {
        "scenario": name,
        "requests": len(results),
        "failed": len(failed),
        "output_changes": len(changed),
        "stall_p50_ms": round(p50 * 1e3, 1),
        "stall_p99_ms": round(p99 * 1e3, 1),
        "errors": sorted({r.error for r in failed})[:5],
    }
    row["met"] = not failed and not changed and p99 < 1.0
    return row


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


# -- scenarios ----------------------------------------------------------------------------------------


async def fault_scenarios(
    mesh: RunningMesh, n: int, concurrency: int, stop_s: float, killed: set[int]
) -> tuple[list[dict], dict[int, tuple]]:
    """The baseline, then each fault under the same load; pids killed on purpose go to `killed`."""
    requests = request_set(n)
    baseline = await run_load(mesh, requests, concurrency)
    bad = [r for r in baseline if r.error]
    if bad:
        raise RuntimeError(f"the undisturbed run failed: {bad[0].error}")
    expected = {r.key: (r.tokens, r.finish) for r in baseline}
    rows = [summarize("baseline", baseline, expected)]
    experts = mesh.info["experts"]

    async def hang() -> None:
        os.kill(experts[0]["pid"], signal.SIGSTOP)
        await asyncio.sleep(stop_s)
        os.kill(experts[0]["pid"], signal.SIGCONT)

    def kill(pid: int) -> None:
        killed.add(pid)
        os.kill(pid, signal.SIGKILL)

    async def kill_expert() -> None:
        kill(experts[1]["pid"])

    async def kill_router() -> None:
        kill(mesh.pids["router-0"])

    for name, fault in (
        ("expert_sigstop", hang),
        ("expert_sigkill", kill_expert),
        ("router_sigkill", kill_router),
    ):
        print(f"==> {name}", flush=True)
        rows.append(summarize(name, await run_load(mesh, requests, concurrency, fault), expected))
    return rows, expected


async def overload(mesh: RunningMesh, n: int, expected: dict[int, tuple]) -> dict:
    """n greedy requests at once against max_in_flight=2, max_queued=2: how fast the excess is refused."""
    greedy = [r for r in request_set(len(expected)) if r.seed is None]
    requests = [greedy[i % len(greedy)] for i in range(n)]
    refused, accepted = [], []
    async with grpc.aio.insecure_channel(mesh.info["gateway_grpc"]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(r: Request) -> None:
            start = time.monotonic()
            try:
                reply = await stub.Generate(
                    inference_pb2.GenerateRequest(
                        prompt_token_ids=r.prompt, max_tokens=NEW_TOKENS, temperature=0.0
                    ),
                    timeout=120,
                )
                accepted.append(
                    (tuple(reply.token_ids), _finish_name(reply.finish_reason)) == expected[r.key]
                )
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.append(time.monotonic() - start)
                else:
                    accepted.append(False)

        await asyncio.gather(*(one(r) for r in requests))
    p99 = _q(sorted(refused), 0.99)
    return {
        "scenario": "overload",
        "requests": n,
        "refused": len(refused),
        "accepted": len(accepted),
        "accepted_correct": sum(accepted),
        "refusal_p99_ms": round(p99 * 1e3, 1),
        "met": bool(refused) and p99 < 0.1 and all(accepted),
    }


def hostile_value(rng: random.Random):
    return rng.choice(
        [
            lambda: "\ud800" * rng.randint(1, 3),
            lambda: float("nan"),
            lambda: float("inf"),
            lambda: -1e308,
            lambda: 2**64,
            lambda: -(2**63),
            lambda: -1,
            lambda: 0,
            lambda: "x" * rng.choice([1, 300, 100_000]),
            lambda: [rng.randint(-(2**40), 2**40) for _ in range(rng.randint(0, 5))],
            lambda: None,
            lambda: True,
            lambda: {"a": [{"b": [None] * 3}] * 3},
            lambda: [[[[[[[]]]]]]],
            lambda: ["s"] * rng.choice([1, 40, 5000]),
            lambda: [
                {
                    "role": rng.choice(["user", "system", "x", ""]),
                    "content": rng.choice(["hi", "\ud800", 5, None]),
                }
                for _ in range(rng.randint(0, 4))
            ],
            lambda: rng.randint(0, 4),
            lambda: rng.random(),
        ]
    )()


FIELDS = (
    "prompt messages max_tokens temperature top_p top_k min_p seed stop stop_token_ids n stream "
    "request_id model priority ignore_eos logprobs return_token_ids"
).split()


def hostile_body(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.05:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))  # not JSON at all
    if kind < 0.08:
        return b"[" * 10_000  # deep nesting
    body = {f: hostile_value(rng) for f in rng.sample(FIELDS, rng.randint(1, 5))}
    body.setdefault("max_tokens", 2)
    return json.dumps(body, allow_nan=True).encode()


def hostile_grpc(rng: random.Random) -> inference_pb2.GenerateRequest:
    msg = inference_pb2.GenerateRequest(
        prompt_token_ids=[rng.choice([0, 5, 2**31, 2**32 - 1]) for _ in range(rng.randint(0, 4))],
        max_tokens=rng.choice([0, 1, 2, -5, 2**31 - 1]),
        temperature=rng.choice([0.0, 1e-45, float("nan"), 5.0]),
        top_p=rng.choice([0.0, 0.5, float("inf")]),
        top_k=rng.choice([0, 3, -1]),
        min_p=rng.choice([0.0, 0.2, -0.5, float("nan")]),
        stop=["s" * rng.choice([1, 1000])] * rng.choice([0, 1, 100]),
        priority=rng.choice([0, -(2**31)]),
        request_id=rng.choice(["", "dup", "r" * 100_000]),
        model=rng.choice(["", "x" * 20_000]),
    )
    if rng.random() < 0.5 and not msg.prompt_token_ids:
        msg.prompt = rng.choice(["hi", "x" * 10_000, ""])
    return msg


async def fuzz(
    mesh: RunningMesh,
    cases: int,
    expected: dict[int, tuple],
    killed: set[int],
    concurrency: int = 16,
) -> dict:
    rng = random.Random(0)
    counts = {"http": 0, "grpc": 0, "5xx": 0, "internal": 0, "hangs": 0}
    examples: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    paths = ["/v1/completions", "/v1/chat/completions"]
    async with (
        grpc.aio.insecure_channel(mesh.info["gateway_grpc"]) as channel,
        httpx.AsyncClient(base_url=f"http://{mesh.info['gateway_http']}", timeout=20) as http,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> None:
            async with gate:
                if i % 4 == 3:
                    counts["grpc"] += 1
                    try:
                        await stub.Generate(hostile_grpc(rng), timeout=20)
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                            counts["hangs"] += 1
                        elif e.code() in (
                            grpc.StatusCode.INTERNAL,
                            grpc.StatusCode.UNKNOWN,
                            grpc.StatusCode.UNAVAILABLE,
                        ):
                            counts["internal"] += 1
                            examples.append(f"gRPC {e.code().name}: {e.details()[:120]}")
                    return
                counts["http"] += 1
                try:
                    r = await http.post(
                        rng.choice(paths),
                        content=hostile_body(rng),
                        headers={"content-type": "application/json"},
                    )
                    if r.status_code >= 500:
                        counts["5xx"] += 1
                        examples.append(f"HTTP {r.status_code}: {r.text[:120]}")
                except httpx.TimeoutException:
                    counts["hangs"] += 1

        for start in range(0, cases, 1000):  # batches keep the pending-task count bounded
            await asyncio.gather(*(one(i) for i in range(start, min(cases, start + 1000))))
            print(f"    fuzz {min(cases, start + 1000)}/{cases}", flush=True)
    crashes = [name for name, pid in mesh.pids.items() if pid not in killed and not _alive(pid)]
    check = await run_load(mesh, [r for r in request_set(8) if r.seed is None], 4)
    correct = all(not r.error and (r.tokens, r.finish) == expected[r.key] for r in check)
    row = {
        "scenario": "fuzz",
        "cases": cases,
        **counts,
        "crashes": len(crashes),
        "correct_after": correct,
        "examples": examples[:5],
    }
    row["met"] = (
        cases >= 10_000
        and not crashes
        and not counts["5xx"]
        and not counts["internal"]
        and not counts["hangs"]
        and correct
    )
    return row


def main() -> int:
    args = parse_settings(Settings, __doc__)
    if args.quick:
        args.requests, args.fuzz_cases = 24, 1000
    if not (args.checkpoint / "config.json").exists():
        print(f"==> creating {args.checkpoint} (tiny preset)", flush=True)
        create_checkpoint(args.checkpoint, "mixtral", "tiny")
    with tempfile.TemporaryDirectory(prefix="moe-chaos-") as tmp:
        rows = scenarios(args, Path(tmp))
    report = {
        "bench": "chaos",
        "quick": args.quick,
        "new_tokens": NEW_TOKENS,
        "scenarios": rows,
        "all_met": all(r["met"] for r in rows if r["scenario"] != "baseline"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for r in rows:
        figures = {k: v for k, v in r.items() if k not in ("scenario", "errors", "examples", "met")}
        print(f"{r['scenario']:<15} {'met' if r['met'] else 'NOT MET':<8} {figures}")
        for e in r.get("errors", []) + r.get("examples", []):
            print(f"{'':<24}{e}")
    print(f"==> wrote {args.out}")
    return 0 if report["all_met"] else 1


def scenarios(args: Settings, work: Path) -> list[dict]:
    """The faults and the fuzz in one mesh, then the overload in a second, smaller one."""
    print("==> mesh: 2 routers, 2 expert groups x 2 replicas", flush=True)
    flags = ("--routers", "2", "--replicas", "2", "--expert-services", "2")
    killed: set[int] = set()
    with mesh_up(args.checkpoint, work, "mesh", *flags) as mesh:
        rows, expected = asyncio.run(
            fault_scenarios(
                mesh, args.requests, args.concurrency, 4.0 if args.quick else 10.0, killed
            )
        )
        print(f"==> fuzz ({args.fuzz_cases} cases)", flush=True)
        rows.append(asyncio.run(fuzz(mesh, args.fuzz_cases, expected, killed)))
    print("==> overload: max_in_flight 2, max_queued 2", flush=True)
    flags = ("--expert-services", "2", "--max-in-flight", "2", "--max-queued", "2")
    with mesh_up(args.checkpoint, work, "small", *flags) as small:
        rows.append(asyncio.run(overload(small, 40, expected)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
